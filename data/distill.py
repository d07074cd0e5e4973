"""The model's own replies to chat prompts, in this process or through an OpenAI-compatible server.

    python data/distill.py runs/smollm2/base --prompts sharegpt --out runs/smollm2/distill --limit 256

The same as `selfspec distill-data` (`selfspec distill-data --help`), run from a checkout.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["distill-data", *sys.argv[1:]]))
