"""Pretrain the embedded default from a checkout: the same as `selfspec pretrain` (`--help`).

    accelerate launch train/pretrain.py --config embedded_base
    python train/pretrain.py optim.max_steps=50 --output-dir runs/base-smoke   # a quick try
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["pretrain", *sys.argv[1:]]))
