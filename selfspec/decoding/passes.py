"""`RoundPasses`: the model passes a round runs from Python, over a `Batch`'s rows at their positions.

The proposers (`proposers.py`) and the verification (`verification.py`) run their passes through these:
the positions announced to the cache, blocks [0, end) with the exit block behind block E when the call
has one (its cache layers written wherever blocks [0, E) run), and η's test (a draft's choice is
`draft_loop.pick`). Each pass goes to the backend
first where it has one call for it (`Backend.exit_pass`), else to `DecoderView`'s torch operations.
"""

from __future__ import annotations

import torch

from ..backends import Backend
from ..model import DecoderView
from ..sampling import sure_drafts
from .batch import Batch


class RoundPasses:
    """The passes of a round (module docstring) of one model (`view`) on one backend."""

    def __init__(self, view: DecoderView, backend: Backend):
        self.view, self.backend = view, backend

    def place(self, b: Batch, offset: int, length: int) -> dict:
        """Positions n + offset .. n + offset + length - 1 of every row (B, T), announced to the cache:
        the cache/position arguments of `DecoderView.run_layers`."""
        positions = b.lengths_dev[:, None] + b.steps[offset:offset + length]
        kv_length = b.cache.set_positions(positions, b.lengths + offset)
        return {"cache": b.cache, "positions": positions, "kv_length": kv_length, "aligned": b.cache.aligned}

    def run(self, b: Batch, tokens: torch.Tensor, offset: int, end: int) -> torch.Tensor:
        """Tokens (B, T) at positions n + offset .. through blocks [0, end): hidden states (B, T, D)."""
        return self.forward(b, tokens, offset, end)[0]

    def forward(self, b: Batch, tokens: torch.Tensor, offset: int, end: int):
        """`run`, and the draft head's input at those positions: the exit states (B, T, D) after the
        exit block when the call has one (else the states after block E, or None when end < E).

        An exit block keeps a KV cache of its own, so it runs wherever blocks [0, E) do (prefill,
        drafts, verification, plain steps): every layer then holds every position, and rollback and
        `check` treat it as one more layer."""
        place, d = self.place(b, offset, tokens.shape[1]), b.drafting
        if d.exit_block is not None and end == d.exit_layer and d.tensors is not None:
            out = self.backend.exit_pass(d.exit_layer, tokens, b.cache, place["positions"], d.tensors,
                                         d.exit_block)
            if out is not None:  # one compiled call: blocks [0, E), then the exit block
                return out
        hidden = self.view.embed(tokens, place["positions"])
        if d.exit_block is None or end < d.exit_layer:
            hidden = self.view.run_layers(hidden, 0, end, **place)
            return hidden, hidden if end == d.exit_layer else None
        context = self.view.context(hidden, place["positions"], place["kv_length"], cached=True,
                                    aligned=place["aligned"])
        hidden = self.view.run_layers(hidden, 0, d.exit_layer, b.cache, context=context)
        features = d.exit_block(hidden, self.view, context, b.cache)  # writes cache layers N, N + 1, ..
        return self.view.run_layers(hidden, d.exit_layer, end, b.cache, context=context), features

    @staticmethod
    def unsure(b: Batch, logits: torch.Tensor) -> bool:
        """Whether η stops the round at this draft: every row's draft distribution (B, V) puts less than η
        on its most likely token (`sampling.sure_drafts`, one small host read per draft step)."""
        return not sure_drafts(b.sampling.top_probability(logits)[None], b.drafting.stop_below)


__all__ = ["RoundPasses"]
