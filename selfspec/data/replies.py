"""The directory a distillation writes, and how a killed run continues it.

``responses.jsonl`` holds one reply a line, ``manifest.json`` what made them. Replies are appended as
they finish (one write of whole lines, flushed and synced), so a run killed at any moment leaves whole
lines and at worst a torn last one, which the next run cuts off before it continues; the prompts
already answered are skipped, so no reply is written twice. Replies that finished out of their prompts'
order (requests in flight together) are put back in prompt order once a run has answered every prompt,
by one atomic rewrite: a run killed and continued leaves the same file as one that never stopped. A
directory whose manifest names another model, tokenizer, decoding or source of replies is refused
rather than mixed.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ..files import fault_point, write_json_atomic, write_text_atomic
from .chat import ChatDataError

RESPONSES = "responses.jsonl"
MANIFEST = "manifest.json"
LOCK = ".lock"
ERRORS = "errors.jsonl"  # the prompts a server refused: {"id", "status", "error"} a line

# What a manifest written before a field existed is read as: such a directory continues as it was made.
ABSENT_MEANS = {"top_p": 1.0, "replies_from": "in-process"}
# Fields that describe a run without deciding its replies: a continuation may differ in them.
INFORMATIVE = ("endpoint", "token_ids", "probe_match")


class ReplyFile:
    """`out_dir`'s replies: the manifest checked against (or written as) `manifest`, the ids already
    answered (`done`), `append` for finished replies and `finish` to put them in prompt order.

    force: start the directory again (its replies are deleted). The directory is locked while it is open
    (`close`, or a `with` block): a second run on it is refused in one line."""

    def __init__(self, out_dir: str | Path, manifest: dict, force: bool = False):
        self.dir = Path(out_dir)
        self.path, manifest_path = self.dir / RESPONSES, self.dir / MANIFEST
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.dir)  # held while this object lives: one run writes a directory
        if manifest_path.is_file() and not force:
            _check_same_making(self.dir, json.loads(manifest_path.read_text()), manifest)
        elif force and self.path.exists():
            self.path.unlink()
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(manifest_path, manifest)
        self.done = _read_done(self.path)
        self.written = 0  # replies appended by this run
        self.errors = self.dir / ERRORS
        if force and self.errors.exists():
            self.errors.unlink()
        self.refused = _read_done(self.errors)  # prompts a server refused, in this run or an earlier one

    def close(self) -> None:
        """Release `out_dir` for another run (the lock the OS would release when the process ends)."""
        self._lock.close()

    def __enter__(self) -> ReplyFile:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def refuse(self, prompt_id: str, status: int | None, error: str) -> None:
        """Record that the server refused prompt `prompt_id` (errors.jsonl, one whole line, synced)."""
        with self.errors.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"id": prompt_id, "status": status, "error": error}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.refused.add(prompt_id)

    def forget_refused(self) -> None:
        """Ask again for the prompts refused before: errors.jsonl starts empty (this run's refusals only)."""
        if self.errors.exists():
            self.errors.unlink()
        self.refused = set()

    def append(self, rows: list[dict]) -> None:
        """Append `rows` (each with its "id") as whole lines in one write, flushed and synced."""
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps(row) + "\n" for row in rows))
            handle.flush()
            os.fsync(handle.fileno())
        self.done.update(row["id"] for row in rows)
        self.written += len(rows)
        fault_point(f"distill_written:{self.written}")

    def finish(self, order: list[str]) -> None:
        """Rewrite the file in the order of the ids in `order` (ids it does not name keep their place
        after them), atomically, when its lines are out of that order."""
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        rank = {prompt_id: index for index, prompt_id in enumerate(order)}
        keys = [rank.get(json.loads(line)["id"], len(rank) + n) for n, line in enumerate(lines)]
        if keys != sorted(keys):
            write_text_atomic(self.path, "".join(line for _, line in sorted(zip(keys, lines))))


def _lock(out_dir: Path):
    """An exclusive lock on `out_dir` (`.lock` in it, released by the OS when the process ends), or a
    one-line error where another run holds it: two runs appending to one file would answer prompts twice
    and interleave their lines."""
    handle = (out_dir / LOCK).open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ChatDataError(f"another distill-data run is writing {out_dir}; wait for it to end or choose "
                            f"another --out") from None
    return handle


def _check_same_making(out_dir: Path, previous: dict, manifest: dict) -> None:
    """A one-line ChatDataError naming what `previous` (the directory's manifest) set otherwise."""
    before = {key: previous.get(key, ABSENT_MEANS.get(key)) for key in manifest if key not in INFORMATIVE}
    changed = [key for key, value in before.items() if value != manifest[key]]
    if changed:
        was = "".join(f", {key} {before[key]}" for key in changed if key != "model")
        raise ChatDataError(f"{out_dir} was made with another {', '.join(changed)} (model "
                            f"{previous.get('model')}{was}); pass another --out, or --force to start again")


def _read_done(path: Path) -> set[str]:
    """Ids already answered in `path`; a torn last line (a killed write) is cut off first."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(whole))
    return {json.loads(line)["id"] for line in whole.decode("utf-8").splitlines() if line.strip()}
