"""`python -m selfspec ...` is the `selfspec` command; `accelerate launch -m selfspec train ...` runs it
on every process of a multi-GPU or multi-machine launch."""

import sys

from .cli import main

sys.exit(main())
