"""`KVCache`: a preallocated key/value cache with per-row lengths and rollback.

It speaks Hugging Face's cache protocol (`update(key_states, value_states, layer_idx, ...) ->
(keys, values)`), so the model's own attention blocks write into it through `DecoderView`, and it
keeps `DecoderView`'s layout: each row's keys sit at *slot index == position*, rows of different
lengths are right-padded, and the attention mask built from positions hides stale slots beyond a
row's length. Rolling back is therefore pure bookkeeping: lowering a row's length; the stale keys
left behind are invisible and get overwritten by the next tokens written at those positions.

Protocol, per call of `DecoderView.run_layers`:

1. ``kv_length = cache.set_positions(positions, starts)`` names where the T new tokens go: row b at
   positions starts[b] .. starts[b] + T - 1 (`positions` is that (B, T) tensor on the device,
   `starts` the same numbers on the host, so that no device value is ever read back).
2. every block's attention calls `update`, which writes its new keys/values at those slots (one
   slice when all rows start at the same position, a scatter otherwise) and returns slots
   0..kv_length-1 with kv_length = max(starts) + T.
3. after a draft/verify round, `rollback(lengths)` sets every layer's length per row to the accepted
   length, and `check(lengths)` asserts that every layer holds exactly the sequence (see
   `CacheLengthError`).

Lengths are tracked on the host (a NumPy array), since the engine knows every position it writes.
"""

from __future__ import annotations

import numpy as np
import torch


class CacheLengthError(AssertionError):
    """A layer's cache length differs from the sequence length of a row after a round.

    The classic symptom of a rollback that keeps one position too many or too few: output that
    looks right for a while, then repeats or drifts. Raised by `KVCache.check`.
    """


class KVCache:
    """Per-layer key/value buffers of shape (B, H_kv, capacity, head_dim), allocated on first write.

    Buffers take the dtype, device, head count and head size of the first keys written to them, so
    one class serves every family (GPT-2's full heads, grouped-query heads, explicit head_dim).
    `lengths[layer, row]` is the number of positions the layer holds for the row.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, buffers: tuple | None = None):
        """buffers: (keys, values), a buffer (or None) per layer of an earlier cache of the same shape to
        write into again (static passes reuse their addresses); their old slots are stale."""
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers if buffers is None else list(buffers[0])
        self.values: list[torch.Tensor | None] = [None] * num_layers if buffers is None else list(buffers[1])
        self.lengths = np.zeros((num_layers, batch_size), dtype=np.int64)
        self._positions: torch.Tensor | None = None  # (B, T) slots of the next writes
        self._start: int | None = None  # shared first slot when every row starts there, else None
        self._starts = np.zeros(batch_size, dtype=np.int64)  # each row's first slot of the announced writes
        self._ends = np.zeros(batch_size, dtype=np.int64)  # per-row length after the next writes
        self._length = 0  # positions per row of the next writes
        self._kv_length = 0

    def set_positions(self, positions: torch.Tensor, starts) -> int:
        """Announce the next writes: row b's T tokens go to slots starts[b] + 0..T-1. Returns kv_length."""
        starts = np.asarray(starts, dtype=np.int64)
        length = positions.shape[1]
        kv_length = int(starts.max()) + length
        if kv_length > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded: "
                             f"writing up to slot {kv_length - 1}")
        self._positions = positions
        self._start = int(starts[0]) if (starts == starts[0]).all() else None
        self._starts = starts
        self._ends = starts + length
        self._length = length
        self._kv_length = kv_length
        return kv_length

    @property
    def positions(self) -> torch.Tensor:
        """(B, T) on the device: the slots of the announced writes (`set_positions`)."""
        return self._positions

    @property
    def aligned(self) -> bool:
        """Whether every row's announced writes start at the same slot (always so at batch 1)."""
        return self._start is not None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write (B, H, T, Dh) keys/values at the announced slots; return slots 0..kv_length-1 of the
        layer."""
        if self.keys[layer_idx] is None:
            batch, heads, _, head_dim = key_states.shape
            shape = (batch, heads, self.capacity, head_dim)
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape[:3] + value_states.shape[3:])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._start is not None:  # every row writes the same slots: a plain slice
            end = self._start + key_states.shape[2]
            keys[:, :, self._start:end] = key_states
            values[:, :, self._start:end] = value_states
        else:  # rows at different positions: scatter along the slot dimension
            index = self._positions[:, None, :, None]  # (B, 1, T, 1)
            keys.scatter_(2, index.expand_as(key_states), key_states)
            values.scatter_(2, index.expand_as(value_states), value_states)
        self.lengths[layer_idx] = self._ends
        return keys[:, :, :self._kv_length], values[:, :, :self._kv_length]

    def allocate(self, layer: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Give `layer` its buffers now if it has none (zeros; `update` allocates them at the first write
        otherwise): static passes write into them in place from the first pass on."""
        if self.keys[layer] is None:
            shape = (self.batch_size, heads, self.capacity, head_dim)
            self.keys[layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.values[layer] = torch.zeros(shape, dtype=dtype, device=device)

    def read_slots(self, row: int, start: int, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row `row`'s slots [start, end) in every layer: keys and values, each a list over the
        layers of (H_kv, end - start, head_dim) (a prefix cache's chunk, `PrefixCache.store`)."""
        return ([k[row, :, start:end].clone() for k in self.keys],
                [v[row, :, start:end].clone() for v in self.values])

    def write_slots(self, row: int, start: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write (H_kv, T, head_dim) keys and values per layer at row `row`'s slots start .. start + T - 1,
        giving a layer its buffers first if it has none; the row's length becomes start + T in every
        layer (a cached prefix, loaded instead of prefilled)."""
        end = start + keys[0].shape[1]
        for layer, (k, v) in enumerate(zip(keys, values)):
            if self.keys[layer] is None:
                self.keys[layer] = k.new_zeros((self.batch_size, k.shape[0], self.capacity, k.shape[2]))
                self.values[layer] = v.new_zeros((self.batch_size, v.shape[0], self.capacity, v.shape[2]))
            self.keys[layer][row, :, start:end] = k
            self.values[layer][row, :, start:end] = v
        self.lengths[:, row] = end

    def add_rows(self, other: KVCache) -> None:
        """Append the rows of `other` (a cache of the same layers, filled apart: rows joining a running
        batch) after this cache's; both keep every slot, in the larger capacity of the two."""
        if other.num_layers != self.num_layers:
            raise ValueError(f"a cache of {other.num_layers} layers cannot join one of {self.num_layers}")
        capacity = max(self.capacity, other.capacity)
        for layer in range(self.num_layers):
            for buffers, theirs in ((self.keys, other.keys), (self.values, other.values)):
                mine, theirs = buffers[layer], theirs[layer]
                if mine is None and theirs is None:
                    continue
                template = mine if mine is not None else theirs
                buffers[layer] = torch.cat([_widened(mine, template, self.batch_size, capacity),
                                            _widened(theirs, template, other.batch_size, capacity)])
        self.lengths = np.concatenate([self.lengths, other.lengths], 1)
        self._ends = np.concatenate([self._ends, other._ends])
        self._starts = np.concatenate([self._starts, other._starts])
        self.batch_size += other.batch_size
        self.capacity = capacity

    def slot_buffers(self, start: int, end: int):
        """For a caller that writes layers [start, end) itself (`fast.FastLlamaBlocks.run_range`): their
        key and value buffers (B, H_kv, capacity, head_dim), the first slot of the announced writes,
        kv_length and, when the rows start at different slots, each row's first slot (B,) int64 on the
        CPU (else None; the first slot is then 0); None when some layer has no buffer yet. Call
        `written(start, end)` once they are written."""
        keys, values = self.keys[start:end], self.values[start:end]
        if any(k is None for k in keys):
            return None
        if self._start is not None:
            return keys, values, self._start, self._kv_length, None
        return keys, values, 0, self._kv_length, torch.from_numpy(self._starts)

    def written(self, start: int, end: int, count: int | None = None) -> None:
        """Layers [start, end) hold the announced writes (what `update` records for one layer), or only
        their first `count` positions (a draft loop that stopped early)."""
        self.lengths[start:end] = self._ends if count is None else self._ends - self._length + count

    def hold(self, lengths) -> None:
        """Every layer holds `lengths` (B,) positions per row: what a call that writes the cache and rolls
        it back itself leaves (`Backend.greedy_rounds`); the slots past them are stale."""
        self.lengths[:] = np.asarray(lengths, dtype=np.int64)[None, :]

    def rollback(self, lengths) -> None:
        """Set every layer's length per row to `lengths` (B,), dropping the rejected positions.

        Only shortens: a layer holding fewer positions than asked for is missing keys, never fixed
        by a rollback, so that raises `CacheLengthError`.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        short = self.lengths < lengths[None, :]
        if short.any():
            layer, row = map(int, np.argwhere(short)[0])
            raise CacheLengthError(f"cannot roll layer {layer} row {row} forward from "
                                   f"{self.lengths[layer, row]} to {lengths[row]} positions")
        self.lengths[:] = lengths[None, :]

    def check(self, sequence_lengths) -> None:
        """Assert that every layer holds exactly `sequence_lengths[row]` positions for every row."""
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64)
        wrong = self.lengths != sequence_lengths[None, :]
        if wrong.any():
            layer, row = map(int, np.argwhere(wrong)[0])
            raise CacheLengthError(
                f"KV cache of layer {layer} holds {self.lengths[layer, row]} positions for row {row}, "
                f"but the sequence has {sequence_lengths[row]} tokens before the pending one")

    def select_rows(self, rows) -> None:
        """Keep only the batch rows `rows` (host indices, in order), e.g. to drop finished ones.

        Copies every layer's buffers once (index_select along the batch dimension).
        """
        rows = np.asarray(rows, dtype=np.int64)
        index = None
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            if keys is None:
                continue
            if index is None:
                index = torch.as_tensor(rows, device=keys.device)
            self.keys[layer], self.values[layer] = keys.index_select(0, index), values.index_select(0, index)
        self.lengths = self.lengths[:, rows]
        self._ends, self._starts = self._ends[rows], self._starts[rows]
        self.batch_size = len(rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Longest row of a layer (Hugging Face's `Cache` method, for code that asks)."""
        return int(self.lengths[layer_idx].max())


def _widened(buffer: torch.Tensor | None, template: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    """`buffer` (B, H, S, hd) with its slots extended to `capacity` (the new ones zero), or zeros shaped
    like `template` for `rows` rows when the layer was never written (its slots are all stale)."""
    _, heads, _, head_dim = template.shape
    if buffer is not None and buffer.shape[2] == capacity:
        return buffer
    out = template.new_zeros((rows, heads, capacity, head_dim))
    if buffer is not None:
        out[:, :, :buffer.shape[2]] = buffer
    return out


class CachePool:
    """Key/value buffers kept from one decode call to the next, for a backend whose passes are captured
    (static passes, `Backend.pools_caches`): a captured pass is specific to the shapes and, under CUDA
    graphs, to the addresses of the buffers it writes.

    One set of buffers per role, layers and capacity, its rows a power of two; a cache of B rows gets the
    set's first B rows, views at the set's own address whatever B is. So a pass captured for B rows is
    replayed whenever a cache of that role has B rows again: the running batch ("batch") whether it
    started with them or rows left or joined it (`home`), rows prefilled before they join it
    ("joining"), a row prefilled alone through the prefix cache ("row"). A server's changing batch
    captures once per batch size and capacity, not once per composition. Each role's cache is in use
    by one call at a time; the slots left from earlier calls are stale, hidden by each cache's lengths.

    allocate: gives a `KVCache` its buffers (the backend's `allocate`: every layer the passes write).
    """

    def __init__(self, allocate):
        self._allocate = allocate
        self._sets: dict[tuple, tuple[list, list]] = {}  # (role, layers, capacity) -> (keys, values)

    def cache(self, layers: int, rows: int, capacity: int, role: str = "batch") -> KVCache:
        """An empty cache of `rows` rows on the pool's buffers of `role` (their first `rows` rows)."""
        keys, values = self._set(role, layers, rows, capacity)
        return KVCache(layers, rows, capacity,
                       buffers=([_rows(k, rows) for k in keys], [_rows(v, rows) for v in values]))

    def home(self, cache: KVCache) -> None:
        """Move the running batch's `cache` onto the pool's "batch" buffers of its layers and capacity
        (copied: a batch whose rows left or joined holds new tensors), so that its passes find the
        addresses they were captured on.
        A layer the set lacks (one written only through `update`, an exit block's) gets a buffer there."""
        keys, values = self._set("batch", cache.num_layers, cache.batch_size, cache.capacity)
        for mine, pooled in ((cache.keys, keys), (cache.values, values)):
            for layer, buffer in enumerate(mine):
                if buffer is None:
                    continue
                if pooled[layer] is None:
                    pooled[layer] = buffer.new_zeros((_set_rows(cache.batch_size, keys), *buffer.shape[1:]))
                view = _rows(pooled[layer], cache.batch_size)
                if view.data_ptr() != buffer.data_ptr():
                    view.copy_(buffer)
                    mine[layer] = view

    def _set(self, role: str, layers: int, rows: int, capacity: int) -> tuple[list, list]:
        """The set for (role, layers, capacity) with at least `rows` rows: made, or grown to the next
        power of two (the old one dropped: its captured passes keep it until they are dropped in turn)."""
        held = self._sets.get((role, layers, capacity))
        if held is not None and _set_rows(rows, held[0]) >= rows:
            return held
        empty = KVCache(layers, 1 << max(rows - 1, 0).bit_length(), capacity)
        self._allocate(empty)
        self._sets[(role, layers, capacity)] = held = (empty.keys, empty.values)
        return held


def _set_rows(rows: int, buffers: list) -> int:
    """How many rows a pooled set's buffers hold (a layer's, any that has one), else the bucket for `rows`."""
    held = next((b for b in buffers if b is not None), None)
    return held.shape[0] if held is not None else 1 << max(rows - 1, 0).bit_length()


def _rows(buffer: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    return None if buffer is None else buffer[:rows]
