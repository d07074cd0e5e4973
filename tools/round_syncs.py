"""Syncs and launches a decoding round costs on a GPU, counted on the emulated CUDA device
(tests/virtual_cuda.py).

    python tools/round_syncs.py                         # early exit, copies, hybrid; eager and graphs
    python tools/round_syncs.py --static eager,graph --family llama --batch 1

A sync is a wait of the host for the device: a host read of a device value (`host_reads`) or a copy
to the device that waits for the work queued before it (`host_uploads`: from pageable memory, or
blocking). Launches: kernel launches (every operation outside a captured pass, a replay's input copies)
and graph launches. Each setting decodes one prompt (or `--batch` copies of it, each row its own) three times
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

CASES = {"early exit k=4": ("early_exit", 4, {}), "plain (k=0)": ("early_exit", 0, {}),
         "copies": ("ngram", 3, {}), "hybrid k=2": ("hybrid", 2, {}),
         "early exit k=4, sampled": ("early_exit", 4, {"temperature": 0.9, "seed": 3})}
PROMPT = [5, 17, 33, 2, 71, 8, 5, 17, 33]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--static", default="none,graph", help="backends: none (the engine's), eager, graph")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    import torch
    from helpers import low_alpha_model
    from virtual_cuda import COUNTS, VirtualCuda, counts_per_round

    torch.set_num_threads(1)  # tiny passes: a second thread only waits for the first (counts are alike)

    from selfspec.decoding import SelfSpecGenerator
    print("| backend | drafter | reads / round | uploads / round | kernel launches / round "
          "| graph launches / round | rounds |")
    print("|---|---|---|---|---|---|---|")
    for static in args.static.split(","):
        model = low_alpha_model(args.family)
        with VirtualCuda() as device:
            device.module(model)
            generator = SelfSpecGenerator(model, exit_layer=2,
                                          static_passes=None if static == "none" else static)
            for name, (drafter, k, sampling) in CASES.items():
                counts, rounds = counts_per_round(device, generator, [PROMPT] * args.batch, drafter, k,
                                                  **sampling)
                print(f"| {static} | {name} | {' | '.join(f'{counts[c]:.2f}' for c in COUNTS)} | {rounds} |")


if __name__ == "__main__":
    main()
