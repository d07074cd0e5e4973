"""The state of a decode's running rows between rounds (`Batch`), and the token-list helpers of a round.

State between rounds, per row: the cache holds n positions (the prompt and the tokens emitted so far,
except the last), and the last emitted token is *pending* at position n. A round writes the pending token
and the drafts at positions n .. n + k and keeps n + (tokens emitted) of them. The host arrays are the
truth; the device copies are refreshed once per round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..sampling import RowSampling, SamplingParams
from .cache import KVCache
from .draft_head import DraftHead
from .grammar import GrammarBatch


def no_lap(part: str) -> None:
    """A `Batch`'s lap where its call is not profiled: nothing (so that an unprofiled round calls nothing of
    `profile.py`)."""


@dataclass(frozen=True)
class Drafting:
    """How a decode call's rounds draft, fixed for the call (from its `DecodeSettings`).

    exit_layer: E; head: the draft head (trimmed to V', behind an MLP exit adapter, or the model's own);
    exit_block: the attending exit adapter the drafts read (`ExitBlock`, keys and values at layers N..),
    or None; tensors: the head as the backends' compiled draft passes read it (`DraftHead.tensors`),
    None for a call that never drafts with the early exit or a head they cannot read; stop_below: η,
    a round's early-exit drafts stop when no row's top draft probability reaches it; overlap: a compiled
    call's rounds verify while the next round drafts (`DecodeSettings.overlap`); fused: a lone row's
    rounds may run many in one compiled call (`DecodeSettings.fused`); forced: the call may draft a
    grammar's forced tokens (every drafter but plain decoding).
    """

    exit_layer: int
    head: DraftHead
    exit_block: object
    tensors: tuple | None
    stop_below: float
    overlap: bool
    fused: bool
    forced: bool


class DeviceRows:
    """The device's copies of a batch's per-row lengths and pending tokens, `lengths` and `pending` (B,)
    int64, refreshed by `upload` once per round at most. On CPU they are views of one host array, written
    in place. On CUDA the host array is pinned and copied without blocking into device buffers kept while
    the batch keeps its size (the same addresses for captured passes); the host waits for the last copy
    before it writes the array again, which costs nothing after a round's read of the device (it follows
    the copy) and keeps a second upload with no read between (the prefill's) from overwriting what the
    first still copies."""

    def __init__(self):
        self.lengths: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self._shared: np.ndarray | None = None  # (2, B): the host's lengths and pending tokens
        self._host: torch.Tensor | None = None  # the same memory as a tensor (pinned off the CPU)
        self._device: torch.Tensor | None = None  # (2, B) on the device: `lengths` and `pending` its rows
        self._copied = None  # a `torch.cuda.Event` after the last copy from pinned memory, or None

    def upload(self, lengths: np.ndarray, pending: np.ndarray, device) -> None:
        rows = len(lengths)
        if self._shared is None or self._shared.shape[1] != rows:
            pinned = device.type == "cuda"
            host = torch.empty((2, rows), dtype=torch.int64, pin_memory=pinned)
            self._shared = host.numpy()
            both = host if device.type == "cpu" else torch.empty((2, rows), dtype=torch.int64, device=device)
            self._host, self._device, self.lengths, self.pending = host, both, both[0], both[1]
            self._copied = torch.cuda.Event() if pinned else None
        elif self._copied is not None:
            self._copied.synchronize()
        self._shared[0], self._shared[1] = lengths, pending
        if self._device is not self._host:
            self._device.copy_(self._host, non_blocking=True)
            if self._copied is not None:
                self._copied.record()


@dataclass
class Batch:
    """Decoding state of the rows still running (see the module docstring); B shrinks as rows finish.

    The host arrays are the truth; the device copies (`on_device`) are refreshed once per round (`upload`).
    """

    cache: KVCache
    params: list[SamplingParams]  # each row's sampling settings, on the host
    sampling: RowSampling  # the same as device tensors (`RowSampling.of(params)`), remade when rows change
    drafting: Drafting  # how the call drafts
    grammar: GrammarBatch | None  # the rows' grammars (structured output), or None
    steps: torch.Tensor  # arange(capacity) on the device, to build positions
    rows: np.ndarray  # (B,) the caller's row index of each batch slot
    lengths: np.ndarray  # (B,) positions the cache holds = position of the pending token
    pending: np.ndarray  # (B,) the last emitted token, not yet run through the model
    seeds: np.ndarray  # (B,) per-row random streams (on the device in `sampling.seeds`)
    on_device: DeviceRows = field(default_factory=DeviceRows)  # `lengths` and `pending` on the device
    lap: object = no_lap  # `RoundProfile.lap` of a profiled call: charges the time since the last lap

    @property
    def lengths_dev(self) -> torch.Tensor:
        """(B,) `lengths` on the device, as of the last `upload`."""
        return self.on_device.lengths

    @property
    def pending_dev(self) -> torch.Tensor:
        """(B,) `pending` on the device, as of the last `upload`."""
        return self.on_device.pending

    @property
    def greedy_tensors(self) -> tuple | None:
        """The draft head's tensors where every row is greedy (the compiled draft step and choice take the
        argmax), else None."""
        return self.drafting.tensors if self.sampling.all_greedy else None

    @property
    def forces(self) -> bool:
        """Whether this round drafts the grammars' forced tokens: a call that may, rows under a grammar,
        and every row greedy. A sampled row's drafts must depend on that row alone, so that it draws what
        it draws alone (its seed's tokens), and a row without forced tokens would fill their columns
        with drafts of its own; greedy rows keep their tokens whatever their drafts."""
        return self.drafting.forced and self.grammar is not None and self.sampling.all_greedy

    @property
    def loop_drafts(self) -> bool:
        """Whether a round's early-exit drafts may run as one loop (`selfspec.draft_loop`, or a backend's call
        for it): a head it reads, no exit block (which the loop does not run), no grammar (whose masks come
        from the host between drafts)."""
        d = self.drafting
        return d.tensors is not None and d.exit_block is None and self.grammar is None

    def keep_rows(self, keep: np.ndarray) -> None:
        """Only the slots `keep` (B,) bool stay: every per-row array, the cache's rows and the grammars'."""
        index = np.nonzero(keep)[0]
        self.rows, self.lengths, self.pending, self.seeds = (
            self.rows[keep], self.lengths[keep], self.pending[keep], self.seeds[keep])
        self.params = [self.params[i] for i in index]
        if index.size:  # an empty batch samples nothing
            self.sampling = self.sampling.select(index.tolist(), self.params)
        self.cache.select_rows(index)
        if self.grammar is not None:
            self.grammar.select_rows(index)

    def add_rows(self, new: Batch) -> None:
        """`new`'s rows after these (rows joining a running batch): every per-row array and the cache's
        rows (the caller grows the grammars, whose rows may come without one)."""
        self.cache.add_rows(new.cache)
        self.rows = np.concatenate([self.rows, new.rows])
        self.lengths = np.concatenate([self.lengths, new.lengths])
        self.pending = np.concatenate([self.pending, new.pending])
        self.seeds = np.concatenate([self.seeds, new.seeds])
        self.params = self.params + new.params
        self.sampling = RowSampling.of(self.params, self.steps.device, self.seeds)

    def upload(self, device) -> None:
        """Refresh the device copies (`DeviceRows.upload`: one host-to-device copy a round at most)."""
        self.on_device.upload(self.lengths, self.pending, device)


def decided(tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """A round's outcome as one tensor (B, k+2): the tokens (B, k+1), then the accepted count (B,)."""
    return torch.cat([tokens, accepted[:, None].to(tokens.dtype)], 1)


def joined(parts: list) -> torch.Tensor:
    """(B, r) tensors side by side along dimension 1; a single part is returned as it is (no copy:
    one tensor operation fewer in most rounds)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def width(parts: list) -> int:
    """Positions in a list of (B, r) token tensors."""
    return sum(part.shape[1] for part in parts)


__all__ = ["Batch", "DeviceRows", "Drafting", "decided", "joined", "no_lap", "width"]
