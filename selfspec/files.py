"""Where selfspec's files go, and how they are written.

`cache_dir()`: where selfspec keeps what it builds once and reuses (corpora, the embedded tokenizer,
packed data sets, cached exit features), so every command works from any directory:
`$SELFSPEC_CACHE_DIR` when set, else `$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`. A recipe's
`data.cache_dir` overrides it for one run. Outputs (models, reports) go elsewhere: `./runs` or the
command's `--output-dir`.

Atomic writes: a reader (or a process killed halfway) never sees half a file or half a directory.

- `atomic_file`, `write_text_atomic` / `write_json_atomic`: a temp file beside the target, then a rename;
- `atomic_directory`: build a directory in a temp sibling, then move it into place, replacing the
  previous one (used for checkpoints, corpora, tokenizers and packed data sets);
- `fault_point`: the kill-anywhere tests' one hook, which SIGKILLs the process at a named point.

Pure standard library; imports nothing from the rest of the project.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "SELFSPEC_CACHE_DIR"


def cache_dir() -> Path:
    """The user's cache directory, read from the environment at each call (so a test or a launcher can
    set it)."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "selfspec"


FAULT_ENV = "SELFSPEC_FAULT"  # test hook: the point where `fault_point` kills the process


def fault_point(point: str) -> None:
    """The one fault-injection hook, for the kill-anywhere tests: the process SIGKILLs itself where
    `SELFSPEC_FAULT` names `point` (the training loop's `mid_step:N`, `saving:N`, `saved:N`; a
    distillation's `distill_written:N`, its Nth reply of the run written)."""
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path` to write; on success it replaces `path` by rename.

    For writers that take a file name (safetensors, matplotlib). On any error the temp file is removed
    and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would stay on the final file
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write text via a temp file + rename, so readers never see half a file."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write JSON atomically (see `write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield an empty temp dir beside ``final``; on success it replaces ``final`` by rename.

    The temp dir lives in the same parent so the rename stays on one filesystem (atomic). On any
    error the temp dir is removed and ``final`` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0o700 mode would stay on the final dir; mkdir() honours the umask.
    tmp_dir = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp_dir.mkdir()
    try:
        yield tmp_dir
        replace_directory(tmp_dir, final)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # a no-op once renamed into place


def replace_directory(new: Path, final: Path) -> None:
    """Move ``new`` to ``final``, replacing a previous ``final`` if there is one.

    A crash between the two renames leaves the previous directory aside as ``.<name>.old-*`` and no
    ``final``: never a mixture of old and new files.
    """
    old = None
    if final.exists():
        # rename() cannot replace a non-empty directory: move the old one aside first.
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:12]}")
        final.rename(old)
    try:
        new.rename(final)
    except OSError:
        if not final.exists():
            raise
        # Another process finished the same build first; its result is as good as ours.
        logger.info("%s was written concurrently; keeping that copy", final)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
