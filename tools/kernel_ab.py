"""A/B/C/D of selfspec's kernels on the roofline's passes, side by side: MKL's products and torch's
operations, the few-row kernel for the products, the block kernels (each block two compiled calls), and
a pass's blocks in one compiled call.

    python tools/kernel_ab.py --model runs/smollm2/base --exit-layer 10 --repeats 30
    python tools/kernel_ab.py --model runs/smollm2/base --exit-layer 10 --dtype bfloat16
    python tools/kernel_ab.py --model runs/smollm2/base --exit-layer 8 --wide 9 16 24 32 48
    mkdir -p /tmp/before && git archive HEAD~1 selfspec | tar -x -C /tmp/before
    python tools/kernel_ab.py --model runs/smollm2/base --exit-layer 10 --against /tmp/before

Builds the roofline's cache of 256 positions, then times each pass (plain step, draft step, verification
of 2, 4 and 5 positions through blocks [E, N) and the head, the whole model on 5 positions, and on each
`--wide` count of positions) in each arm (`selfspec.model.fast.kernels_up_to` None, products, blocks,
passes), rotating which goes first, after 3 untimed rounds. Prints the medians, each as a share of the
read bandwidth (a 512 MiB sum timed once a round) and in plain steps of its own arm, and the speedups.
`--against PATH` builds another version of the kernels beside the package's and adds its one-call pass
as a fifth arm (a kernel change measured side by side): PATH is a folder holding another revision's
`selfspec/` (its `model/kernels/few_rows.cpp`, `few_rows.h` and `backends/cpu_rounds/rounds.cpp`, built
together as the package's are; a revision from before the decoding calls moved to `rounds.cpp` has its
whole extension in `few_rows.cpp`), or one .cpp file that is a whole extension (`git show
REV:selfspec/model/kernels/few_rows.cpp > FILE`, for such a revision). Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from selfspec.evaluation.roofline import pass_bytes
from selfspec.evaluation.timing import Passes, load_model
from selfspec.model import DecoderView, fast, kernels


def against_sources(path: Path) -> list[Path]:
    """The sources of `--against PATH`: PATH where it is one .cpp file; in a folder holding a revision's
    `selfspec/`, the extension's sources there, or its `few_rows.cpp` alone where the revision is from
    before the decoding calls moved to `rounds.cpp` (that file was the whole extension)."""
    if path.is_file():
        return [path]
    files = kernels.sources(path / "selfspec")
    if all(file.is_file() for file in files):
        return files
    if files[0].is_file():
        return files[:1]
    raise SystemExit(f"error: --against {path}: no {files[0]}; unpack a revision there with "
                     f"`git archive REV selfspec | tar -x -C {path}`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--exit-layer", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--wide", type=int, nargs="*", default=[], metavar="M",
                        help="also time the whole model on M positions (a wide verification, a batch)")
    parser.add_argument("--against", metavar="PATH",
                        help="another revision's kernels: a folder holding its selfspec/, or one .cpp "
                             "file of a whole extension; its one-call pass as a fifth arm")
    args = parser.parse_args()
    if kernels.few_rows_linear() is None:
        raise SystemExit("error: selfspec's kernel is not available here (needs a C++ compiler, ninja, AVX2)")
    modules = {}  # arm -> the extension it runs (the package's where absent)
    if args.against:
        modules["against"] = kernels.build(against_sources(Path(args.against)), "selfspec_kernels_against")
    lm, _ = load_model(args.model, None, args.dtype)
    view = DecoderView(lm)
    n, e = view.num_layers, args.exit_layer
    passes = {"plain": (0, n, 1), "draft": (0, e, 1), "verify_2": (e, n, 2), "verify_4": (e, n, 4),
              "verify_5": (e, n, 5), "full_5": (0, n, 5),
              **{f"full_{m}": (0, n, m) for m in args.wide}}
    runner = Passes(view, args.context, max([5, *args.wide]))
    arms = {"mkl": None, "rows": "products", "block": "blocks", "pass": "passes"}  # `fast.kernels_up_to`
    if modules:
        arms["against"] = "passes"
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
                build = (kernels.wrapped(lambda _, module=modules[arm]: module) if arm in modules
                         else contextlib.nullcontext())
                with build, fast.kernels_up_to(arms[arm]):
                    start = time.perf_counter()
                    runner.run(*spec)
                    if round_index >= 3:
                        times[(name, arm)].append(time.perf_counter() - start)
    rate = source.numel() * 4 / statistics.median(reads[3:])
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"{args.model} ({args.dtype}), E = {e}, {args.repeats} rotated rounds, "
          f"read bandwidth {rate / 1e9:.1f} GB/s; each arm: ms, share of bandwidth, plain steps")
    against = f" | one call, kernels of {args.against} | one call / those" if modules else ""
    print(f"| pass | MKL | few-row kernel | block kernels | one call per pass | rows / MKL | blocks / rows "
          f"| one call / blocks{against} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if modules else ""))
    for name, (start, end, _) in passes.items():
        limit = pass_bytes(view, start, end, args.context) / rate
        ms = {arm: median[(name, arm)] for arm in names}
        cells = {arm: f"{ms[arm] * 1e3:.2f} ms, {limit / ms[arm]:.0%}, {ms[arm] / median[('plain', arm)]:.2f}"
                 for arm in names}
        row = [cells["mkl"], cells["rows"], cells["block"], cells["pass"], f"{ms['mkl'] / ms['rows']:.2f}x",
               f"{ms['rows'] / ms['block']:.2f}x", f"{ms['block'] / ms['pass']:.2f}x"]
        if modules:
            row += [cells["against"], f"{ms['against'] / ms['pass']:.2f}x"]
        print(f"| {name} | {' | '.join(row)} |")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
