"""Benchmark self-speculative decoding against plain decoding and Hugging Face's generators.

Run (one process; warm-up, interleaved repeats, medians; writes benchmark.json and benchmark.md):

    python eval/benchmark_speedup.py --model runs/demo/model --exit-layer 6 --num-speculations auto \
        --max-new-tokens 128 --repeats 5 --out runs/demo/benchmark

--exit-layer and --num-speculations default to the checkpoint's selfspec.json when it has one.
Prompts: by default 64 tokens from the middle of each of the first 8 documents of the test split of --corpus
(default: the embedded stdlib corpus); or --prompts: a JSON list of token lists or of strings, or a
text file with one prompt per line. This script is `selfspec eval speedup` (the same flags, the same
function: `selfspec.evaluation.benchmark.speedup`).
"""

from __future__ import annotations

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "speedup", *sys.argv[1:]]))
