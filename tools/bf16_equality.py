"""How often speculative decoding in bf16 differs from plain bf16 decoding, with and without fixed width.

    python tools/bf16_equality.py --model runs/smollm2/base --prompts runs/prompts/mtbench.jsonl \
        --num-prompts 4 --max-new-tokens 64 --exit-layer 10

Loads the model in bf16 and decodes each prompt (chat template applied) greedily: plain decoding,
then the early exit (k = 1, 3, 4), copies and the hybrid, each once with `fixed_width` (the
engine's default for bf16) and once without. Prints, per method, the rows whose tokens equal plain
decoding's (plain itself run the same way) and where the first difference falls.
"""

from __future__ import annotations

import argparse
import json

import torch

from selfspec.checkpoint import load_tuned

METHODS = {"early exit k=1": dict(drafter="early_exit", num_speculations=1),
           "early exit k=3": dict(drafter="early_exit", num_speculations=3),
           "early exit k=4": dict(drafter="early_exit", num_speculations=4),
           "copies": dict(drafter="ngram", num_speculations=4),
           "hybrid": dict(drafter="hybrid", num_speculations=3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help=".jsonl with a 'prompt' field per line")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--exit-layer", type=int, default=10)
    args = parser.parse_args()
    generator = load_tuned(args.model, dtype="bfloat16", exit_layer=args.exit_layer, draft_vocab_size=0,
                           stop_below=0.0)
    tokenizer = generator.tokenizer
    rows = [json.loads(line)["prompt"] for line in open(args.prompts)][:args.num_prompts]
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                       add_generation_prompt=True))["input_ids"]
               for text in rows]
    print(f"{args.model} in {generator.view.dtype}, {len(prompts)} prompts, {args.max_new_tokens} tokens, "
          f"E = {args.exit_layer}")
    print("| method | fixed width: rows equal to plain | without: rows equal to plain "
          "| without: first difference |")
    print("|---|---:|---:|---|")
    results = {}
    for fixed in (True, False):
        generator.runner.fixed_width = fixed
        plain = [generator.generate([p], max_new_tokens=args.max_new_tokens, num_speculations=0,
                                    eos_token_id=[]).sequences[0] for p in prompts]
        for name, method in METHODS.items():
            equal, first = 0, []
            for prompt, expected in zip(prompts, plain):
                out = generator.generate([prompt], max_new_tokens=args.max_new_tokens, eos_token_id=[],
                                         **method).sequences[0]
                equal += out == expected
                if out != expected:
                    first.append(next(i for i, (a, b) in enumerate(zip(out, expected)) if a != b))
            results.setdefault(name, {})[fixed] = (equal, first)
    for name, by_mode in results.items():
        (on, _), (off, first) = by_mode[True], by_mode[False]
        where = ", ".join(f"token {i}" for i in first) or "-"
        print(f"| {name} | {on}/{len(prompts)} | {off}/{len(prompts)} | {where} |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
