"""A/B/C of selfspec's kernels on the roofline's passes, side by side: MKL's products and torch's
operations, the few-row kernel for the products, and the block kernels (each block two compiled calls).

    python eval/kernel_ab.py --model runs/smollm2/base --exit-layer 10 --repeats 30
    python eval/kernel_ab.py --model runs/smollm2/base --exit-layer 10 --dtype bfloat16

Builds the roofline's cache of 256 positions, then times each pass (plain step, draft step,
verification of 2, 4 and 5 positions through blocks [E, N) and the head, the whole model on 5
positions) in each arm (`selfspec.model.fast._KERNEL`, `_BLOCK_KERNEL`), rotating which goes first,
after 3 untimed rounds. Prints the medians, each as a share of the read bandwidth (a 512 MiB sum timed
once a round) and in plain steps of its own arm, and the speedups. Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from selfspec.evaluation.benchmark import load_model
from selfspec.evaluation.roofline import _Passes, pass_bytes
from selfspec.model import DecoderView, fast, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--exit-layer", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    if kernels.few_rows_linear() is None:
        raise SystemExit("error: selfspec's kernel is not available here (needs a C++ compiler, ninja, AVX2)")
    lm, _ = load_model(args.model, None, args.dtype)
    view = DecoderView(lm)
    n, e = view.num_layers, args.exit_layer
    passes = {"plain": (0, n, 1), "draft": (0, e, 1), "verify_2": (e, n, 2), "verify_4": (e, n, 4),
              "verify_5": (e, n, 5), "full_5": (0, n, 5)}
    runner = _Passes(view, args.context, 5)
    arms = {"mkl": (False, False), "rows": (True, False), "block": (True, True)}  # (_KERNEL, _BLOCK_KERNEL)
    names = list(arms)
    times = {(name, arm): [] for name in passes for arm in arms}
    source = torch.ones(512 * 2**20 // 4)  # the read that sets the limit, timed in the same rounds
    reads = []
    for round_index in range(args.repeats + 3):
        start = time.perf_counter()
        source.sum()
        reads.append(time.perf_counter() - start)
        for name, spec in passes.items():
            shift = round_index % len(names)
            for arm in names[shift:] + names[:shift]:
                fast._KERNEL, fast._BLOCK_KERNEL = arms[arm]
                start = time.perf_counter()
                runner.run(*spec)
                if round_index >= 3:
                    times[(name, arm)].append(time.perf_counter() - start)
    fast._KERNEL, fast._BLOCK_KERNEL = True, True
    rate = source.numel() * 4 / statistics.median(reads[3:])
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"{args.model} ({args.dtype}), E = {e}, {args.repeats} rotated rounds, "
          f"read bandwidth {rate / 1e9:.1f} GB/s; each arm: ms, share of bandwidth, plain steps")
    print("| pass | MKL | few-row kernel | block kernels | rows / MKL | blocks / rows |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (start, end, _) in passes.items():
        limit = pass_bytes(view, start, end, args.context) / rate
        cells = [f"{median[(name, arm)] * 1e3:.2f} ms, {limit / median[(name, arm)]:.0%}, "
                 f"{median[(name, arm)] / median[('plain', arm)]:.2f}" for arm in names]
        print(f"| {name} | {' | '.join(cells)} | {median[(name, 'mkl')] / median[(name, 'rows')]:.2f}x "
              f"| {median[(name, 'rows')] / median[(name, 'block')]:.2f}x |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
