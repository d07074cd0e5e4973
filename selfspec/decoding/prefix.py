"""`PrefixCache`: the keys and values of prompt prefixes that earlier calls prefilled, reused by
later calls whose prompts start with the same tokens (a chat template's system turn, an instruction
that every request of a task shares). Serving engines call it automatic prefix caching.

A prompt's positions fall into chunks at fixed boundaries, [0, C), [C, 2C), ...: with a prefix
cache set, the engine prefills every prompt a chunk per pass, one row at a time, whether the cache
holds some of its chunks or not. A chunk's keys and values are then a function of the tokens up to
its end alone: the same pass (C positions, one row, the same keys before them) computes them on a
hit and on a miss, so a prompt decodes to the same bits either way, alone or in a batch. Without the
fixed boundaries a cached prefix would be followed by a pass of another shape than the one a miss
runs, and a product's rounding depends on its shape (`model.fast.fixed_width` says why).

The chunks form a tree: a chunk's key is its parent chunk and its own C tokens, so a lookup walks
a prompt chunk by chunk and shares the common prefix of many prompts. Each holds (H_kv, C, head_dim)
keys and values per cache layer; one tree per cache layout (the model's layers, plus an exit
block's own layers when the call drafts with one). The cache keeps at most `max_bytes`, dropping
the least recently used chunk first; a chunk is touched after every chunk below it, so the least
recently used one never has a child left.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

DEFAULT_CHUNK = 32  # positions per chunk: a pass of this many rows still runs near a CPU's peak
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
    generators that hold it. chunk: C, positions per chunk; max_bytes: the most its keys and values
    take. Counts for reports: `lookups` (rows prefilled), `hit_tokens` (positions loaded instead of
    computed), `prefilled_tokens` (positions computed)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, chunk: int = DEFAULT_CHUNK):
        if chunk < 1 or max_bytes < 0:
            raise ValueError(f"a prefix cache needs chunk >= 1 and max_bytes >= 0, got {chunk}, {max_bytes}")
        self.chunk, self.max_bytes = chunk, max_bytes
        self.bytes = 0
        self._chunks: OrderedDict[tuple, _Chunk] = OrderedDict()  # (parent key, tokens) -> chunk, LRU first
        self._uids = itertools.count()
        self._owners: dict[tuple, tuple] = {}  # layout -> (model, exit block): kept alive, so ids stay theirs
        self.lookups = self.hit_tokens = self.prefilled_tokens = 0

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

    def _keys(self, layout: tuple, tokens) -> list[tuple]:
        """The dictionary keys of `tokens`' chunks that exist, from the first on."""
        keys, parent = [], ("root", layout)
        for start in range(0, len(tokens) - self.chunk + 1, self.chunk):
            key = (parent, tuple(tokens[start:start + self.chunk]))
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
        self.lookups += 1
        self.hit_tokens += len(keys) * self.chunk
        return [self._chunks[key] for key in keys]

    def store(self, layout: tuple, tokens, read) -> None:
        """Keep the whole chunks of `tokens` that are not cached yet; `read(start, end)` gives their
        keys and values, two lists over the cache layers of (H_kv, end - start, head_dim), copied
        from the row's cache. Then drop least recently used chunks down to `max_bytes`."""
        keys = self._keys(layout, tokens)
        parent = ("root", layout) if not keys else self._chunks[keys[-1]].uid
        for start in range(len(keys) * self.chunk, len(tokens) - self.chunk + 1, self.chunk):
            chunk_keys, chunk_values = read(start, start + self.chunk)
            node = _Chunk(next(self._uids), tuple(tokens[start:start + self.chunk]), chunk_keys, chunk_values)
            key = (parent, node.tokens)
            self._chunks[key] = node
            self.bytes += node.nbytes
            keys.append(key)
            parent = node.uid
        self._touch(keys)
        while self.bytes > self.max_bytes and self._chunks:
            _, node = self._chunks.popitem(last=False)
            self.bytes -= node.nbytes


__all__ = ["DEFAULT_CHUNK", "DEFAULT_MAX_BYTES", "PrefixCache"]
