"""Why a model does or does not decode faster: the practitioners' checklist from a short probe.

    python eval/doctor.py runs/demo/model

The same as `selfspec doctor` (`selfspec doctor --help`), run from a checkout.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["doctor", *sys.argv[1:]]))
