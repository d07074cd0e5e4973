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

import json
import os
from pathlib import Path

from ..files import fault_point, write_json_atomic, write_text_atomic
from .chat import ChatDataError

RESPONSES = "responses.jsonl"
MANIFEST = "manifest.json"

# What a manifest written before a field existed is read as: such a directory continues as it was made.
ABSENT_MEANS = {"top_p": 1.0, "replies_from": "in-process"}
# Fields that describe a run without deciding its replies: a continuation may differ in them.
INFORMATIVE = ("endpoint", "token_ids", "probe_match")


class ReplyFile:
    """`out_dir`'s replies: the manifest checked against (or written as) `manifest`, the ids already
    answered (`done`), `append` for finished replies and `finish` to put them in prompt order.

    force: start the directory again (its replies are deleted)."""

    def __init__(self, out_dir: str | Path, manifest: dict, force: bool = False):
        self.dir = Path(out_dir)
        self.path, manifest_path = self.dir / RESPONSES, self.dir / MANIFEST
        if manifest_path.is_file() and not force:
            _check_same_making(self.dir, json.loads(manifest_path.read_text()), manifest)
        elif force and self.path.exists():
            self.path.unlink()
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(manifest_path, manifest)
        self.done = _read_done(self.path)
        self.written = 0  # replies appended by this run

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
