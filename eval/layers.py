"""Acceptance per exit layer: how often each early exit's top token is the full model's.

    python eval/layers.py --model runs/demo/model

The same as `selfspec layers` (`selfspec layers --help`), run from a checkout.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["layers", *sys.argv[1:]]))
