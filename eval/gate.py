"""The perplexity gate: the tuned model's perplexity against its base's, on the test split.

    python eval/gate.py --tuned runs/demo/model --base runs/base/model

The same as `selfspec eval gate` (`selfspec eval gate --help`), run from a checkout.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "gate", *sys.argv[1:]]))
