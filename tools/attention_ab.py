"""The attention kernel of another revision against this one's, per layer, side by side: one query (a
decode step) and three (a verification of k = 2), over 12 layers' caches so that the keys come from L3 as
decoding reads them, at a few context lengths and two head shapes (the embedded default's, SmolLM2's).

    git archive ab3efe8 | tar -x -C /tmp/old
    python tools/attention_ab.py --against /tmp/old

Prints the medians of interleaved rounds (the order alternating) in µs per layer. Run it with the
machine to itself.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from selfspec.model import kernels

SHAPES = [(32, 4, 2), (64, 9, 3)]  # (head dim, query heads, kv heads)


def per_layer(attend, q, caches, mask, calls: int = 20) -> float:
    """Seconds per layer of `calls` passes over every cache."""
    start = time.perf_counter()
    for _ in range(calls):
        for k, v in caches:
            attend(q, k, v, mask, 0.1)
    return (time.perf_counter() - start) / calls / len(caches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="a folder holding another revision's selfspec/")
    parser.add_argument("--lengths", default="32,512,1800")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    new = kernels.few_queries_attention()
    old = kernels.build(kernels.sources(Path(args.against) / "selfspec"), "selfspec_kernels_ab_old")
    torch.manual_seed(0)
    for hd, heads, kv_heads in SHAPES:
        for length in map(int, args.lengths.split(",")):
            caches = [(torch.randn(1, kv_heads, length, hd), torch.randn(1, kv_heads, length, hd))
                      for _ in range(12)]
            row = []
            for m in (1, 3):
                q, mask = torch.randn(1, heads, m, hd), torch.zeros(1, m, length)
                times = {"old": [], "new": []}
                for r in range(args.rounds):
                    arms = [("old", old.few_queries_attention), ("new", new)]
                    for name, attend in arms if r % 2 else arms[::-1]:
                        seconds = per_layer(attend, q, caches, mask)
                        if r >= 2:  # the first two rounds warm up
                            times[name].append(seconds * 1e6)
                a, b = statistics.median(times["old"]), statistics.median(times["new"])
                row.append(f"m={m}: {a:.1f} -> {b:.1f} µs ({a / b:.2f}x)")
            print(f"head dim {hd}, heads {heads}/{kv_heads}, S = {length}: " + "; ".join(row))


if __name__ == "__main__":
    main()
