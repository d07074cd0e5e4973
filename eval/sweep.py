"""The drafter grid (E, k, V', copies) timed against plain decoding; the fastest into selfspec.json.

    python eval/sweep.py --model runs/demo/model --drafters early_exit,hybrid --write-back

The same as `selfspec eval sweep` (`selfspec eval sweep --help`), run from a checkout.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "sweep", *sys.argv[1:]]))
