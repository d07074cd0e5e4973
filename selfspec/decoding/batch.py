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

from .cache import KVCache
from .draft_head import DraftHead
from .grammar import GrammarBatch
from .profile import no_lap
from .sampling import SamplingParams


@dataclass
class Batch:
    """Decoding state of the rows still running (see the module docstring); B shrinks as rows finish.

    The host arrays are the truth; the device copies are refreshed once per round (`upload`).
    """

    cache: KVCache
    sampling: SamplingParams
    exit_layer: int  # E of this call's early exit
    head: DraftHead  # its draft head (trimmed to V', behind an MLP exit adapter, or the model's own)
    exit_block: object  # the attending exit adapter the drafts read (`ExitBlock`, KV at layers N..), or None
    loop_head: tuple | None  # the head as a backend's draft loop reads it (`DraftHead.tensors`), or None
    step_head: tuple | None  # the same for the compiled draft step (greedy early-exit drafts), or None
    stop_below: float  # η: stop a round's early-exit drafts when no row's top draft probability reaches it
    overlap: bool  # a compiled call's rounds verify while the next round drafts (`DecodeSettings.overlap`)
    grammar: GrammarBatch | None  # the rows' grammars (structured output), or None
    forced: bool  # draft the grammar's forced tokens (every drafter but plain decoding)
    steps: torch.Tensor  # arange(capacity) on the device, to build positions
    rows: np.ndarray  # (B,) the caller's row index of each batch slot
    lengths: np.ndarray  # (B,) positions the cache holds = position of the pending token
    pending_host: np.ndarray  # (B,) the last emitted token, not yet run through the model
    seeds_host: np.ndarray  # (B,) per-row random streams
    lengths_dev: torch.Tensor = None  # (B,) device copies of the three arrays above
    pending_dev: torch.Tensor = None
    seeds_dev: torch.Tensor = None
    _shared: np.ndarray = None  # on CPU: (3, B), the memory the three device tensors are views of
    lap: object = no_lap  # `RoundProfile.lap` of a profiled call: charges the time since the last lap

    def upload(self, device) -> None:
        """Refresh the device copies. On CPU they are views of one host array, written in place: no
        tensor is made per round (a round reads them before the next upload)."""
        rows = len(self.lengths)
        if device.type != "cpu" or self._shared is None or self._shared.shape[1] != rows:
            both = torch.from_numpy(np.stack([self.lengths, self.pending_host, self.seeds_host])).to(device)
            self._shared = both.numpy() if device.type == "cpu" else None
            self.lengths_dev, self.pending_dev, self.seeds_dev = both[0], both[1], both[2]
            return
        self._shared[0], self._shared[1], self._shared[2] = self.lengths, self.pending_host, self.seeds_host


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
