"""Sweep exit layers E and draft lengths k: measured speedup over plain decoding per (E, k).

Run (one process; warm-up, interleaved repeats, medians; writes sweep.json, sweep.md, sweep.png):

    python eval/sweep.py --model runs/demo/model --exit-layers 4:9 --ks 2,3,4,6 --out runs/demo/sweep
    python eval/sweep.py --model runs/demo/model --write-back   # record the fastest (E, k) in selfspec.json

This script is `selfspec eval sweep` (the same flags, the same function: `selfspec.evaluation.sweep.sweep`).
"""

from __future__ import annotations

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "sweep", *sys.argv[1:]]))
