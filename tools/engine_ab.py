"""Tokens/s of `generate` for a few cells, one JSON line: one run of one code tree (`tools/tree_ab.py`
alternates the trees and takes the medians).

    python tools/engine_ab.py                                         # a random Llama (8 blocks, 256 wide)
    python tools/engine_ab.py --model runs/demo/model --cells plain,stored
    python tools/engine_ab.py --model runs/smollm2/base --cells plain,ngram --new-tokens 64

Cells: `plain` (k = 0), `stored` (the checkpoint's own settings: its stored pick), `ngram` (copies),
`hybrid`, `k=N` (the early exit at k = N), `batch4` (the stored settings, 4 rows). Batch 1, greedy, fp32;
each cell is warmed up first, then timed over the prompts. Only `load_tuned` and `generate` are used, so
the script runs against older trees of the package too.
"""

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch

CELLS = {"plain": dict(num_speculations=0), "ngram": dict(drafter="ngram"), "hybrid": dict(drafter="hybrid"),
         "stored": {}, "batch4": dict(batch=4)}


def _random_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfspec.decoding import SelfSpecGenerator
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper distributions: the early exit agrees more often
    prompt = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    return SelfSpecGenerator(model, exit_layer=3), [prompt + prompt[:32]]  # a repeat: copies find one


def _checkpoint(path: str, count: int):
    from selfspec import load_tuned
    generator = load_tuned(path, device="cpu")
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    chunks = [source[i:i + 600] for i in range(20000, 20000 + 4000 * count, 4000)]
    return generator, [generator.tokenizer(text)["input_ids"] for text in chunks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: a random Llama)")
    parser.add_argument("--cells", default="plain,k=3,ngram,batch4")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    generator, prompts = _random_model() if args.model is None else _checkpoint(args.model, args.prompts)
    rates = {}
    for name in args.cells.split(","):
        cell = dict(CELLS[name] if name in CELLS else {"num_speculations": int(name.removeprefix("k="))})
        batch = cell.pop("batch", 1)
        generator.generate([prompts[0]] * batch, max_new_tokens=16, eos_token_id=[], **cell)  # warm-up
        start, tokens = time.perf_counter(), 0
        for prompt in prompts:
            out = generator.generate([prompt] * batch, max_new_tokens=args.new_tokens, eos_token_id=[],
                                     **cell)
            tokens += sum(len(s) for s in out.sequences)
        rates[name] = tokens / (time.perf_counter() - start)
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
