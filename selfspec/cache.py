"""Where selfspec keeps what it builds once and reuses: corpora, the embedded tokenizer, packed data
sets and cached exit features.

The user's cache directory, so every command works from any directory: `$SELFSPEC_CACHE_DIR` when
set, else `$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`. A recipe's `data.cache_dir` overrides
it for one run. Outputs (models, reports) go elsewhere: `./runs` or the command's `--output-dir`.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "SELFSPEC_CACHE_DIR"


def cache_dir() -> Path:
    """The cache directory, read from the environment at each call (so a test or a launcher can set it)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "selfspec"
