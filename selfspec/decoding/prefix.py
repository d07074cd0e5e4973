"""`PrefixCache`: the keys and values of prompt prefixes that earlier calls prefilled, reused by
later calls whose prompts start with the same tokens (a chat template's system turn, an instruction
that every request of a task shares). Serving engines call it automatic prefix caching.

A prompt's positions fall into chunks at fixed boundaries (`spans`): chunks of C positions up to
position 4C, then chunks of the largest power of two up to their start (they double: 128, 256, ...
for C = 32), so that a shared system turn is caught at a fine grain and a long prompt still runs in
few wide passes. With a prefix cache set, the engine prefills every prompt a chunk per pass, one row
at a time, whether the cache holds some of its chunks or not. A chunk's keys and values are then a
function of the tokens up to its end alone: the same pass (the chunk's positions, one row, the same
keys before them) computes them on a hit and on a miss, so a prompt decodes to the same bits either
way, alone or in a batch. Without the fixed boundaries a cached prefix would be followed by a pass
of another shape than the one a miss runs, and a product's rounding depends on its shape
(`model.fast.fixed_width` says why).

The chunks form a tree: a chunk's key is its parent chunk and its own tokens, so a lookup walks
a prompt chunk by chunk and shares the common prefix of many prompts. Each holds (H_kv, length,
head_dim) keys and values per cache layer; one tree per cache layout (the model's layers, plus an exit
block's own layers when the call drafts with one). The cache keeps at most `max_bytes`, dropping
the least recently used chunk first; a chunk is touched after every chunk below it, so the least
recently used one never has a child left.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..errors import UserError

# positions per chunk at the start of a prompt (doubling from position 4C on). Why 32: a chat
# template's system turn plus an instruction's opening is some 30-50 tokens, and a chunk is shared only
# whole, so larger chunks would share none of it, while a miss costs more passes the smaller the chunks
# (the prefill costs by chunk size are in docs/performance.md)
DEFAULT_CHUNK = 32
DEFAULT_MAX_BYTES = 256 << 20


@dataclass(eq=False)
class _Chunk:
    uid: int
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per cache layer: (H_kv, C, head_dim)
    values: list[torch.Tensor]
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    """Prefilled chunks of earlier prompts (see the module docstring), shared by every call of the
    generators that hold it. chunk: C, positions per chunk up to position 4C (doubling after); max_bytes:
    the most its keys and values take. Counts for reports: `hit_tokens` (positions loaded instead of
    computed), `prefilled_tokens` (positions computed)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, chunk: int = DEFAULT_CHUNK):
        if chunk < 1 or max_bytes < 0:
            raise ValueError(f"a prefix cache needs chunk >= 1 and max_bytes >= 0, got {chunk}, {max_bytes}")
        self.chunk, self.max_bytes = chunk, max_bytes
        self.bytes = 0
        self._chunks: OrderedDict[tuple, _Chunk] = OrderedDict()  # (parent key, tokens) -> chunk, LRU first
        self._uids = itertools.count()
        self._owners: dict[tuple, tuple] = {}  # layout -> (model, exit block): kept alive, so ids stay theirs
        self.hit_tokens = self.prefilled_tokens = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def clear(self) -> None:
        """Drop every chunk (the counts stay)."""
        self._chunks.clear()
        self.bytes = 0

    def layout(self, model, exit_block, layers: int) -> tuple:
        """The tree of a call's chunks: its model (and dtype), the exit block whose layers its cache
        holds (None: the model's own layers only), and the cache's layer count."""
        key = (id(model), id(exit_block), layers, str(getattr(model, "dtype", None)))
        self._owners[key] = (model, exit_block)
        return key

    def _size(self, start: int) -> int:
        """The length of the chunk that starts at `start`: C up to position 4C, then the largest power
        of two up to its start (the chunks double: 128, 256, 512, ... for C = 32)."""
        return self.chunk if start < 4 * self.chunk else 1 << (start.bit_length() - 1)

    def spans(self, length: int) -> list[tuple[int, int]]:
        """The chunks (start, end) of a prefill of `length` positions, in order; the last one may be
        cut short by the prompt's end (a whole chunk only when it ends at its boundary)."""
        out, start = [], 0
        while start < length:
            out.append((start, min(start + self._size(start), length)))
            start += self._size(start)
        return out

    def _whole(self, length: int) -> list[tuple[int, int]]:
        """The whole chunks of a prefill of `length` positions."""
        return [(start, end) for start, end in self.spans(length) if end - start == self._size(start)]

    def _keys(self, layout: tuple, tokens) -> list[tuple]:
        """The dictionary keys of `tokens`' chunks that exist, from the first on."""
        keys, parent = [], ("root", layout)
        for start, end in self._whole(len(tokens)):
            key = (parent, tuple(tokens[start:end]))
            node = self._chunks.get(key)
            if node is None:
                break
            keys.append(key)
            parent = node.uid
        return keys

    def _touch(self, keys: list[tuple]) -> None:
        for key in reversed(keys):  # deepest first: a parent is always more recent than its children
            self._chunks.move_to_end(key)

    def match(self, layout: tuple, tokens) -> list[_Chunk]:
        """The cached chunks that `tokens` (the positions a prefill computes) starts with, in order."""
        keys = self._keys(layout, tokens)
        self._touch(keys)
        chunks = [self._chunks[key] for key in keys]
        self.hit_tokens += sum(len(chunk.tokens) for chunk in chunks)
        return chunks

    def store(self, layout: tuple, tokens, read) -> None:
        """Keep the whole chunks of `tokens` that are not cached yet; `read(start, end)` gives their
        keys and values, two lists over the cache layers of (H_kv, end - start, head_dim), copied
        from the row's cache. Then drop least recently used chunks down to `max_bytes`."""
        keys = self._keys(layout, tokens)
        parent = ("root", layout) if not keys else self._chunks[keys[-1]].uid
        for start, end in self._whole(len(tokens))[len(keys):]:
            chunk_keys, chunk_values = read(start, end)
            node = _Chunk(next(self._uids), tuple(tokens[start:end]), chunk_keys, chunk_values)
            key = (parent, node.tokens)
            self._chunks[key] = node
            self.bytes += node.nbytes
            keys.append(key)
            parent = node.uid
        self._touch(keys)
        while self.bytes > self.max_bytes and self._chunks:
            _, node = self._chunks.popitem(last=False)
            self.bytes -= node.nbytes


def prefix_cache_of(mib: int) -> PrefixCache | None:
    """A `--prefix-cache-mb` value as a cache: `mib` MiB, None for 0, a UserError below 0."""
    if mib < 0:
        raise UserError(f"--prefix-cache-mb must be 0 (no prefix cache) or more, got {mib}")
    return PrefixCache(mib << 20) if mib else None


__all__ = ["DEFAULT_CHUNK", "DEFAULT_MAX_BYTES", "PrefixCache", "prefix_cache_of"]
