"""The state of a decode's running rows between rounds (`Batch`), and the token-list helpers of a round.

State between rounds, per row: the cache holds n positions (the prompt and the tokens emitted so far,
except the last), and the last emitted token is *pending* at position n. A round writes the pending token
and the drafts at positions n .. n + k and keeps n + (tokens emitted) of them. The host arrays are the
truth; the device copies are refreshed once per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..sampling import RowSampling, SamplingParams
from .cache import KVCache
from .draft_head import DraftHead
from .grammar import GrammarBatch
from .profile import no_lap


@dataclass
class Batch:
    """Decoding state of the rows still running (see the module docstring); B shrinks as rows finish.

    The host arrays are the truth; the device copies are refreshed once per round (`upload`).
    """

    cache: KVCache
    params: list[SamplingParams]  # each row's sampling settings, on the host
    sampling: RowSampling  # the same as device tensors (`RowSampling.of(params)`), remade when rows change
    exit_layer: int  # E of this call's early exit
    head: DraftHead  # its draft head (trimmed to V', behind an MLP exit adapter, or the model's own)
    exit_block: object  # the attending exit adapter the drafts read (`ExitBlock`, KV at layers N..), or None
    loop_head: tuple | None  # the head as a backend's draft loop reads it (`DraftHead.tensors`), or None
    step_head: tuple | None  # the same for the compiled draft step (early-exit drafts), or None
    stop_below: float  # η: stop a round's early-exit drafts when no row's top draft probability reaches it
    overlap: bool  # a compiled call's rounds verify while the next round drafts (`DecodeSettings.overlap`)
    grammar: GrammarBatch | None  # the rows' grammars (structured output), or None
    forced: bool  # the call may draft a grammar's forced tokens (every drafter but plain decoding)
    steps: torch.Tensor  # arange(capacity) on the device, to build positions
    rows: np.ndarray  # (B,) the caller's row index of each batch slot
    lengths: np.ndarray  # (B,) positions the cache holds = position of the pending token
    pending_host: np.ndarray  # (B,) the last emitted token, not yet run through the model
    seeds_host: np.ndarray  # (B,) per-row random streams (on the device in `sampling.seeds`)
    lengths_dev: torch.Tensor = None  # (B,) device copies of `lengths` and `pending_host`
    pending_dev: torch.Tensor = None
    _shared: np.ndarray = None  # (2, B): the host's lengths and pending tokens (pinned off the CPU)
    _host: torch.Tensor = None  # the same memory as a tensor (on CPU the device copies are views of it)
    _device: torch.Tensor = None  # (2, B) on the device: `lengths_dev`, `pending_dev` are its rows
    _copied: object = None  # a `torch.cuda.Event` after the last copy from pinned memory, or None
    lap: object = no_lap  # `RoundProfile.lap` of a profiled call: charges the time since the last lap

    @property
    def greedy_head(self) -> tuple | None:
        """`step_head` where every row is greedy (the compiled draft step and choice take the argmax)."""
        return self.step_head if self.sampling.all_greedy else None

    @property
    def forces(self) -> bool:
        """Whether this round drafts the grammars' forced tokens: a call that may, rows under a grammar,
        and every row greedy. A sampled row's drafts must depend on that row alone, so that it draws what
        it draws alone (its seed's tokens), and a row without forced tokens would fill their columns
        with drafts of its own; greedy rows keep their tokens whatever their drafts."""
        return self.forced and self.grammar is not None and self.sampling.all_greedy

    @property
    def loop_drafts(self) -> bool:
        """Whether a round's early-exit drafts may run in one backend call: a head it reads, no grammar
        (whose masks come from the host between drafts)."""
        return self.loop_head is not None and self.grammar is None

    def keep_rows(self, keep: np.ndarray) -> None:
        """Only the slots `keep` (B,) bool stay: every per-row array, the cache's rows and the grammars'."""
        index = np.nonzero(keep)[0]
        self.rows, self.lengths, self.pending_host, self.seeds_host = (
            self.rows[keep], self.lengths[keep], self.pending_host[keep], self.seeds_host[keep])
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
        self.pending_host = np.concatenate([self.pending_host, new.pending_host])
        self.seeds_host = np.concatenate([self.seeds_host, new.seeds_host])
        self.params = self.params + new.params
        self.sampling = RowSampling.of(self.params, self.steps.device, self.seeds_host)

    def upload(self, device) -> None:
        """Refresh the device copies (one host-to-device copy a round at most). On CPU they are views of
        one host array, written in place. On CUDA the host array is pinned and copied without blocking
        into device buffers kept while the batch keeps its size (the same addresses for captured
        passes); the host waits for the last copy before it writes the array again, which costs
        nothing after a round's read of the device (it follows the copy) and keeps a second upload
        with no read between (the prefill's) from overwriting what the first still copies."""
        rows = len(self.lengths)
        if self._shared is None or self._shared.shape[1] != rows:
            pinned = device.type == "cuda"
            host = torch.empty((2, rows), dtype=torch.int64, pin_memory=pinned)
            self._shared = host.numpy()
            both = host if device.type == "cpu" else torch.empty((2, rows), dtype=torch.int64, device=device)
            self._host, self._device, self.lengths_dev, self.pending_dev = host, both, both[0], both[1]
            self._copied = torch.cuda.Event() if pinned else None
        elif self._copied is not None:
            self._copied.synchronize()
        self._shared[0], self._shared[1] = self.lengths, self.pending_host
        if self._device is not self._host:
            self._device.copy_(self._host, non_blocking=True)
            if self._copied is not None:
                self._copied.record()


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


__all__ = ["Batch", "decided", "joined", "width"]
