"""Tokens/s of `generate` for a few cells, one JSON line: one run of one code tree (`tools/tree_ab.py`
alternates the trees and takes the medians).

    python tools/engine_ab.py                                         # a random Llama (8 blocks, 256 wide)
    python tools/engine_ab.py --model runs/demo/model --cells plain,stored
    python tools/engine_ab.py --model runs/smollm2/base --cells plain,ngram --new-tokens 64

Cells: `plain` (k = 0), `stored` (the checkpoint's own settings: its stored pick; sampled, its sampled
pick where it has one), `ngram` (copies), `hybrid`, `early_exit` (each drafter at the stored E, k and V'),
`k=N` (the stored drafter at k = N), `overlapped` (the early exit at the stored E, k, V' with its rounds
overlapped), `batch4` (the stored settings, 4 rows), each greedy, or sampled with
a suffix: `plain@t0.8p0.95` (temperature 0.8, top-p 0.95, seed 0), `stored@t0.3`, `stored@t1k50`.
Rows of their own settings in one batch, through the engine API (`engine().add(NewRow(...))`: the
stored settings; sampled rows at the sampled pick where the tree decodes them in a lane of their own):
`rows8` (8 greedy rows), `mixed8` (7 greedy + 1 at temperature 0.8, top-p 0.95),
`sampled8` (8 rows at temperature 0.8, top-p 0.95, seeds 0..7). fp32; each cell is warmed up first, then
timed over the prompts, the cells taking turns prompt by prompt. Only `load_tuned`, `generate` and the
engine API are used, so the script runs against older trees of the package too.

`--seeds N`: a sampled cell decodes every prompt N times, seeds 0..N-1: a sampled decode's speed depends
on the text it draws (its drafts' acceptance on that text), so one draw per prompt measures little.

`--context L`: the prompts are windows of L tokens of `argparse.py` (long contexts), and a cell's rate
counts decode time only (the call's total less its prefill), as a server's inter-token latency does;
`--decode-only` counts so at the default prompts too (a prefill, which drafting does not touch, is some
fifth of a 128-token call there).
"""

import argparse
import json
import re
import sysconfig
import time
from pathlib import Path

import torch

CELLS = {"plain": dict(num_speculations=0), "ngram": dict(drafter="ngram"), "hybrid": dict(drafter="hybrid"),
         "early_exit": dict(drafter="early_exit"), "stored": {}, "batch4": dict(batch=4)}


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


def _checkpoint(path: str, count: int, context: int | None):
    from selfspec import load_tuned
    generator = load_tuned(path, device="cpu")
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    if context:  # `count` windows of `context` tokens, spread over the file
        ids = generator.tokenizer(source)["input_ids"]
        step = (len(ids) - context) // max(count, 1)
        return generator, [ids[i * step:i * step + context] for i in range(count)]
    chunks = [source[i:i + 600] for i in range(20000, 20000 + 4000 * count, 4000)]
    return generator, [generator.tokenizer(text)["input_ids"] for text in chunks]


def sampling(suffix: str) -> dict:
    """`generate`'s sampling keywords of a cell's suffix: t<temperature>[p<top_p>][k<top_k>]."""
    found = dict(re.findall(r"([tpk])([0-9.]+)", suffix))
    return {"temperature": float(found.get("t", 0)), "top_p": float(found.get("p", 1)),
            "top_k": int(found.get("k", 0)), "seed": 0}


ROWS = {"rows8": [""] * 8, "mixed8": [""] * 7 + ["t0.8p0.95"], "sampled8": ["t0.8p0.95"] * 8}


def rows_rate(generator, prompts: list, suffixes: list[str], new_tokens: int) -> float:
    """Tokens/s of one batch of rows through the engine API, each row its own sampling (`suffixes`)."""
    from selfspec.decoding import NewRow, SamplingParams

    engine = generator.engine(eos_token_id=[])
    start = time.perf_counter()
    for i, suffix in enumerate(suffixes):
        keywords = sampling(suffix) if suffix else {"seed": 0}
        seed = keywords.pop("seed") + i
        engine.add(NewRow(prompts[i % len(prompts)], new_tokens, seed=seed,
                          sampling=SamplingParams(**keywords)))
    tokens = 0
    while not engine.done:
        tokens += sum(len(out.tokens) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: a random Llama)")
    parser.add_argument("--cells", default="plain,k=3,ngram,batch4")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=None,
                        help="prompts of this many tokens; decode time only")
    parser.add_argument("--seeds", type=int, default=1, help="draws per prompt of a sampled cell")
    parser.add_argument("--decode-only", action="store_true",
                        help="rates over decode time (implied by --context)")
    args = parser.parse_args()
    generator, prompts = (_random_model() if args.model is None
                          else _checkpoint(args.model, args.prompts, args.context))
    rates, cells = {}, {}
    for name in args.cells.split(","):
        if name in ROWS:
            rows_rate(generator, prompts, ROWS[name], 16)  # warm-up
            rates[name] = rows_rate(generator, prompts, ROWS[name], args.new_tokens)
            continue
        base, _, suffix = name.partition("@")
        if base == "overlapped":
            cell = {"settings": generator.settings.override(drafter="early_exit", overlap=True)}
        else:
            cell = dict(CELLS[base] if base in CELLS else {"num_speculations": int(base.removeprefix("k="))})
        if suffix:
            cell.update(sampling(suffix))
        batch = cell.pop("batch", 1)
        generator.generate([prompts[0]] * batch, max_new_tokens=16, eos_token_id=[], **cell)  # warm-up
        cells[name] = (cell, batch, [{"seed": seed} for seed in range(args.seeds)] if suffix else [{}])
    # the cells take turns prompt by prompt (the order rotating), so that a slow second of the machine
    # falls on all of them, not on one cell's whole run
    totals = {name: [0, 0.0] for name in cells}
    names = list(cells)
    for i, prompt in enumerate(prompts if names else []):
        for name in names[i % len(names):] + names[:i % len(names)]:
            cell, batch, draws = cells[name]
            for draw in draws:
                start = time.perf_counter()
                out = generator.generate([prompt] * batch, max_new_tokens=args.new_tokens, eos_token_id=[],
                                         **{**cell, **draw})
                wall = time.perf_counter() - start
                totals[name][0] += sum(len(s) for s in out.sequences)
                totals[name][1] += (out.stats.total_time - out.stats.prefill_time
                                    if args.context or args.decode_only else wall)
    rates.update({name: tokens / seconds for name, (tokens, seconds) in totals.items()})
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
