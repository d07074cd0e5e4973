"""The verification: one pass of the target over a round's drafts, and the accepted prefix.

Every proposer's drafts take this one path: the target's pass over the k + 1 positions (blocks [E, N) on
the exit states the early exit already computed, or every block where the round has no early-exit
draft), its head, a grammar's masks, and the acceptance (`sampling.accept_greedy`, or
`sampling.accept_sampled`'s rejection sampling with q one-hot for copied and forced drafts and the early
exit's distribution for its own). A greedy round goes to the backend's one call where it has one
(`Backend.verify_greedy`, tested against this torch path by `tests/test_backends.py`).
"""

from __future__ import annotations

import torch

from .. import sampling
from ..sampling import ACCEPT, TARGET, accept_greedy, accept_sampled, apply_mask
from .batch import Batch, decided, joined
from .passes import RoundPasses
from .proposers import Draft


class Verifier:
    """The verification of a round's `Draft` (module docstring), on `passes`' model and backend."""

    def __init__(self, passes: RoundPasses):
        self.passes = passes
        self.view = passes.view

    def verify(self, b: Batch, draft: Draft) -> torch.Tensor:
        """Run the target on the k + 1 positions n .. n + k, then accept the longest prefix of the
        drafts it agrees with: decided (B, k+2), the tokens (B, k+1) then the accepted count of each
        row, one tensor for the round's one host read. Blocks [0, E) wrote their KV cache
        while drafting and are not run again on the drafts; only the draft's tail runs them."""
        view, num_layers, k = self.view, self.view.num_layers, draft.k
        done = sum(h.shape[1] for h in draft.hiddens)  # positions that already ran through [0, E)
        allowed = None
        if b.grammar is not None:  # (B, k+1, V): the grammar's masks at each drafted prefix
            allowed = b.grammar.verification_masks(draft.host_tokens())
            b.lap("grammar")
        # the verification may run in one call of the backend (its pass, head, masks and acceptance)
        out = self._in_one_call(b, draft, done, allowed)
        if out is not None:
            b.lap("verification pass")
            return out
        if not draft.hiddens:  # no early-exit draft: every block at once
            hidden = self.passes.run(b, draft.tail, 0, num_layers)  # (B, k+1, D)
        else:
            exit_layer = b.drafting.exit_layer
            tail = [self.passes.run(b, draft.tail, done, exit_layer)] if draft.tail.shape[1] else []
            hidden = torch.cat([*draft.hiddens, *tail], 1)  # (B, k+1, D)
            if exit_layer < num_layers:
                hidden = view.run_layers(hidden, exit_layer, num_layers, **self.passes.place(b, 0, k + 1))
        p_logits = view.exit_logits(hidden)  # (B, k+1, V)
        if allowed is not None:  # the target at each drafted prefix, masked by the grammar there
            p_logits = apply_mask(p_logits, allowed)
        b.lap("verification pass")
        if b.sampling.all_greedy:
            return decided(*accept_greedy(draft.tokens, p_logits))
        positions = b.lengths_dev[:, None] + b.steps[1:k + 2]  # (B, k+1): positions n+1 .. n+k+1
        return decided(*accept_sampled(draft.tokens, self._q(b, draft), b.sampling.probs(p_logits),
                                       b.sampling.uniforms(positions[:, :k], ACCEPT),
                                       b.sampling.uniforms(positions, TARGET),
                                       on_host=not b.sampling.in_capture))

    def _q(self, b: Batch, draft: Draft) -> torch.Tensor:
        """The drafts' distributions (B, k, V): one-hot for copied and forced drafts (deterministic given
        the context), the early exit's processed (and masked) distribution for its own drafts (given as
        "q" by a backend's draft loop)."""
        vocab = self.view.vocab_size
        parts = [sampling.copied_probs(part, vocab) if source == "copy" else part if source == "q"
                 else b.sampling.probs(part)[:, None] for source, part in draft.q]
        return joined(parts) if parts else torch.zeros((len(b.rows), 0, vocab), device=b.steps.device)

    def _in_one_call(self, b: Batch, draft: Draft, done: int, allowed: torch.Tensor | None):
        """`verify` in one call of the backend (`Backend.verify_greedy`, or `verify_sampled` with the
        drafts' q): the draft's tail through blocks [0, E) first when it has one (from Python), then the
        target's pass, its head, the grammar's masks `allowed` (B, k + 1, V) when given and the
        acceptance; a round without early-exit drafts (a plain step, a copy, forced tokens) as one
        whole-model call, unless an exit block must see its positions (then blocks [0, E) run from
        Python first). decided (B, k+2) as `verify`'s, or None with nothing run but the tail."""
        num_layers, backend = self.view.num_layers, self.passes.backend
        greedy = b.sampling.all_greedy
        if not backend.round_calls or not (greedy or backend.verifies_sampled):
            return None
        q = None if greedy else self._q(b, draft)

        def call(start: int, **source):
            positions = self.passes.place(b, 0, draft.k + 1)["positions"]
            if greedy:
                return backend.verify_greedy(start, num_layers, b.cache, positions, draft.tokens,
                                             allowed=allowed, **source)
            return backend.verify_sampled(start, num_layers, b.cache, positions, draft.tokens, q, b.sampling,
                                          allowed=allowed, **source)

        if not draft.hiddens and b.drafting.exit_block is None:  # a whole-model call
            return call(0, tokens=draft.tail)
        if draft.tail.shape[1]:  # through blocks [0, E) from Python: an exit block writes its cache there
            draft.hiddens.append(self.passes.run(b, draft.tail, done, b.drafting.exit_layer))
            draft.tail = draft.tail[:, :0]
        return call(b.drafting.exit_layer, hidden=joined(draft.hiddens))  # (B, k+1, D)


__all__ = ["Verifier"]
