"""Names every part of `selfspec.data` shares."""

from __future__ import annotations

EOS_TOKEN = "<|endoftext|>"
SPLITS = ("train", "validation", "test")
