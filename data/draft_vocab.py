"""Token frequencies of a corpus for a checkpoint's trimmed draft head (its V' most frequent ids).

    python data/draft_vocab.py runs/demo/model --data stdlib

The same as `selfspec draft-vocab` (`selfspec draft-vocab --help`), run from a checkout.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["draft-vocab", *sys.argv[1:]]))
