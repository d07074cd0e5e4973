"""Syncs a decoding round costs on a GPU, counted on the emulated CUDA device (tests/virtual_cuda.py).

    python tools/round_syncs.py                         # early exit, copies, hybrid; eager and graphs
    python tools/round_syncs.py --static eager,graph --family llama --batch 1

A sync is a wait of the host for the device: a host read of a device value (`host_reads`) or a copy
to the device that waits for the work queued before it (`host_uploads`: from pageable memory, or
blocking). Each setting decodes one prompt (or `--batch` copies of it, each row its own) three times
at growing lengths; a round's syncs are what the longer decodes add per round they add, so the
call's own start (prefill, captures) is left out. No timing: the counts are exact and the machine's
load does not change them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CASES = {"early exit k=4": ("early_exit", 4), "plain (k=0)": ("early_exit", 0), "copies": ("ngram", 3),
         "hybrid k=2": ("hybrid", 2)}
PROMPT = [5, 17, 33, 2, 71, 8, 5, 17, 33]


def per_round(device, generator, prompts: list, drafter: str, k: int) -> tuple[float, float, int]:
    """(reads, uploads) per round of `generator` on `prompts`, and the rounds of the longest decode."""
    counts, rounds = [], []
    for new in (4, 8, 24):  # the first captures and warms up
        before = (device.host_reads, device.host_uploads)
        out = generator.generate(prompts, max_new_tokens=new, drafter=drafter, num_speculations=k,
                                 eos_token_id=[])
        counts.append((device.host_reads - before[0], device.host_uploads - before[1]))
        rounds.append(out.stats.rounds)
    added = rounds[2] - rounds[1]
    return ((counts[2][0] - counts[1][0]) / added, (counts[2][1] - counts[1][1]) / added, rounds[2])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--static", default="none,graph", help="backends: none (the engine's), eager, graph")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    import torch
    from helpers import low_alpha_model
    from virtual_cuda import VirtualCuda

    torch.set_num_threads(1)  # tiny passes: a second thread only waits for the first (counts are alike)

    from selfspec.decoding import SelfSpecGenerator
    print("| backend | drafter | reads / round | uploads / round | rounds |")
    print("|---|---|---|---|---|")
    for static in args.static.split(","):
        model = low_alpha_model(args.family)
        with VirtualCuda() as device:
            device.module(model)
            generator = SelfSpecGenerator(model, exit_layer=2,
                                          static_passes=None if static == "none" else static)
            for name, (drafter, k) in CASES.items():
                reads, uploads, rounds = per_round(device, generator, [PROMPT] * args.batch, drafter, k)
                print(f"| {static} | {name} | {reads:.2f} | {uploads:.2f} | {rounds} |")


if __name__ == "__main__":
    main()
