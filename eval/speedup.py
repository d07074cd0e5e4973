"""Decoding speed against plain decoding and Hugging Face's methods, side by side.

    python eval/speedup.py --model runs/demo/model --prompt-tokens 1024

The same as `selfspec eval speedup` (`selfspec eval speedup --help`), run from a checkout.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "speedup", *sys.argv[1:]]))
