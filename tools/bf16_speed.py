"""Plain decoding in fp32 and bf16, with selfspec's kernel and without, against Hugging Face's bf16 greedy.

    python tools/bf16_speed.py --model runs/smollm2/base --prompts runs/prompts/mtbench_chat_ids.json \
        --num-prompts 4 --max-new-tokens 48 --repeats 2

Prompts as `selfspec eval speedup` reads them (a JSON list of token lists or strings, or a text file;
`runs/prompts/mtbench_chat_ids.json` holds MT-bench first turns through the chat template). Decodes
each greedily, batch 1, with every method in turn, the order
reversed every other round, after one untimed round; prints the median tokens/s of each end to end
and, for selfspec's arms, after the prefill (the decode steps alone: the engine times its prefill),
and the ratios, and whether each arm's tokens equal its reference (each kernel arm against the same dtype
without it; Hugging Face's bf16 against selfspec's, for information: different kernels round bf16
differently). Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from selfspec.checkpoint import load_tuned
from selfspec.evaluation.prompts import read_prompts
from selfspec.model import fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True,
                        help="a JSON list of token lists or strings, or a text file, one prompt per line")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    generators = {dtype: load_tuned(args.model, dtype=dtype) for dtype in ("float32", "bfloat16")}
    prompts = read_prompts(generators["float32"].tokenizer, args.prompts, num_prompts=args.num_prompts)
    new = args.max_new_tokens

    prefill = {}  # method -> seconds of its last run's prefills

    def selfspec(dtype: str, kernel: bool, name: str):
        with fast.kernels_up_to("rounds" if kernel else None):
            runs = [generators[dtype].generate([p], max_new_tokens=new, num_speculations=0, eos_token_id=[])
                    for p in prompts]
        prefill[name] = sum(run.stats.prefill_time for run in runs)
        return [run.sequences[0] for run in runs]

    def hugging_face():
        model = generators["bfloat16"].view.model
        return [model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)[0, len(p):].tolist() for p in prompts]

    methods = {"fp32, kernel": lambda: selfspec("float32", True, "fp32, kernel"),
               "fp32, MKL": lambda: selfspec("float32", False, "fp32, MKL"),
               "bf16, kernel": lambda: selfspec("bfloat16", True, "bf16, kernel"),
               "bf16, MKL": lambda: selfspec("bfloat16", False, "bf16, MKL"),
               "HF greedy bf16": hugging_face}
    speeds, steps, outputs = {name: [] for name in methods}, {name: [] for name in methods}, {}
    for round_index in range(args.repeats + 1):
        order = list(methods) if round_index % 2 else list(methods)[::-1]
        for name in order:
            start = time.perf_counter()
            outputs[name] = methods[name]()
            seconds = time.perf_counter() - start
            if round_index:
                speeds[name].append(new * len(prompts) / seconds)
                if name in prefill:
                    steps[name].append(new * len(prompts) / (seconds - prefill.pop(name)))
    median = {name: statistics.median(values) for name, values in speeds.items()}
    after = {name: statistics.median(values) for name, values in steps.items() if values}
    print(f"{args.model}: {len(prompts)} prompts, {new} greedy tokens, batch 1, median of {args.repeats}")
    print("| method | tokens/s | × fp32 with the kernel | after the prefill: tokens/s | × fp32 kernel |")
    print("|---|---:|---:|---:|---:|")
    for name, value in median.items():
        decode = (f"{after[name]:.1f} | {after[name] / after['fp32, kernel']:.2f}" if name in after
                  else "— | —")
        print(f"| {name} | {value:.1f} | {value / median['fp32, kernel']:.2f} | {decode} |")
    print(f"bf16 with the kernel / HF greedy bf16: {median['bf16, kernel'] / median['HF greedy bf16']:.2f}")
    same_as_hf = sum(a == b for a, b in zip(outputs["HF greedy bf16"], outputs["bf16, kernel"]))
    print(f"tokens equal: fp32 kernel vs MKL {outputs['fp32, kernel'] == outputs['fp32, MKL']}; "
          f"bf16 kernel vs MKL {outputs['bf16, kernel'] == outputs['bf16, MKL']}; "
          f"HF bf16 vs selfspec bf16 {same_as_hf}/{len(prompts)} prompts")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
