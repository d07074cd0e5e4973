"""Tokens/s of `generate` for a few drafters on a random Llama (8 blocks, 256 wide), one JSON line.

Run it once per code tree and alternate the trees, with the machine to itself, e.g.

    for i in 1 2 3 4 5; do for tree in /tmp/old /work/main; do
        PYTHONPATH=$tree python tools/engine_ab.py; done; done

as docs/results.md did for the stepped engine against the call before it; take the medians.
"""

import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfspec.decoding import SelfSpecGenerator

NEW_TOKENS = 128
CELLS = {"plain": dict(num_speculations=0), "early_exit k=3": dict(num_speculations=3),
         "ngram": dict(drafter="ngram"), "early_exit k=3 batch 4": dict(num_speculations=3, batch=4)}


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper distributions: the early exit agrees more often
    generator = SelfSpecGenerator(model, exit_layer=3)
    prompt = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt += prompt[:32]  # a repeat: copies find something
    rates = {}
    for name, cell in CELLS.items():
        cell = dict(cell)
        prompts = [prompt] * cell.pop("batch", 1)
        generator.generate(prompts, max_new_tokens=16, eos_token_id=[], **cell)  # warm-up
        start = time.perf_counter()
        generator.generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_id=[], **cell)
        rates[name] = NEW_TOKENS * len(prompts) / (time.perf_counter() - start)
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
