"""The methods on the question suites (MT-bench, HumanEval, ...), per category.

    python eval/suite.py --model runs/demo/model --suite mt-bench

The same as `selfspec eval suite` (`selfspec eval suite --help`), run from a checkout.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "suite", *sys.argv[1:]]))
