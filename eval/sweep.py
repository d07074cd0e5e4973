"""Sweep exit layers E and draft lengths k: measured speedup over plain decoding per (E, k).

Run (one process; warm-up, interleaved repeats, medians; writes sweep.json, sweep.md, sweep.png):

    python eval/sweep.py --model runs/demo/model --exit-layers 4:9 --ks 2,3,4,6 --out runs/demo/sweep
    python eval/sweep.py --model runs/demo/model --write-back   # record the fastest (E, k) in selfspec.json

The logic lives in selfspec.evaluation.sweep; `selfspec eval sweep` takes the same flags.
"""

from __future__ import annotations

from selfspec.evaluation.sweep import main

if __name__ == "__main__":
    main()
