"""Names every part of `selfspec.data` shares."""

from __future__ import annotations

import os
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
SPLITS = ("train", "validation", "test")

# Where load_text_corpus caches what it builds ("stdlib"). Relative on purpose: the recipes run
# from the repository root, and data/generated/ is git-ignored there.
DEFAULT_CACHE_DIR = Path(os.environ.get("SELFSPEC_DATA_DIR", "data/generated"))
