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

from . import sampling
from .batch import Batch, decided, joined
from .grammar import apply_mask
from .passes import RoundPasses
from .proposers import Draft
from .sampling import ACCEPT, TARGET, accept_greedy, accept_sampled, uniforms


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
        if b.sampling.greedy:  # the verification may run in one compiled call
            out = self._in_one_call(b, draft, done, allowed)
            if out is not None:
                b.lap("verification pass")
                return out
        if not draft.hiddens:  # no early-exit draft: every block at once
            hidden = self.passes.run(b, draft.tail, 0, num_layers)  # (B, k+1, D)
        else:
            tail = [self.passes.run(b, draft.tail, done, b.exit_layer)] if draft.tail.shape[1] else []
            hidden = torch.cat([*draft.hiddens, *tail], 1)  # (B, k+1, D)
            if b.exit_layer < num_layers:
                hidden = view.run_layers(hidden, b.exit_layer, num_layers, **self.passes.place(b, 0, k + 1))
        p_logits = view.exit_logits(hidden)  # (B, k+1, V)
        if allowed is not None:  # the target at each drafted prefix, masked by the grammar there
            p_logits = apply_mask(p_logits, allowed)
        b.lap("verification pass")
        if b.sampling.greedy:
            return decided(*accept_greedy(draft.tokens, p_logits))
        # q: one-hot for copied and forced drafts (deterministic given the context), the early exit's
        # processed (and masked) distribution for its own drafts.
        vocab = p_logits.shape[-1]
        q = torch.cat([p_logits[:, :0], *(sampling.copied_probs(part, vocab) if source == "copy"
                                          else b.sampling.probs(part)[:, None]
                                          for source, part in draft.q)], 1)  # (B, k, V)
        positions = b.lengths_dev[:, None] + b.steps[1:k + 2]  # (B, k+1): positions n+1 .. n+k+1
        return decided(*accept_sampled(draft.tokens, q, b.sampling.probs(p_logits),
                                       uniforms(b.seeds_dev, positions[:, :k], ACCEPT),
                                       uniforms(b.seeds_dev, positions, TARGET)))

    def _in_one_call(self, b: Batch, draft: Draft, done: int, allowed: torch.Tensor | None):
        """`verify` of a greedy round in one compiled call (`Backend.verify_greedy`): the draft's
        tail through blocks [0, E) first when it has one (from Python), then the target's pass, its head,
        the grammar's masks `allowed` (B, k + 1, V) when given, the argmax and the accepted prefix; a
        round without early-exit drafts (a plain step, a copy, forced tokens) as one whole-model call,
        unless an exit block must see its positions (then blocks [0, E) run from Python first).
        decided (B, k+2) as `verify`'s, or None with nothing run but the tail."""
        num_layers = self.view.num_layers
        if not draft.hiddens and b.exit_block is None:  # a whole-model call
            positions = self.passes.place(b, 0, draft.k + 1)["positions"]
            return self.passes.backend.verify_greedy(0, num_layers, b.cache, positions, draft.tokens,
                                                     tokens=draft.tail, allowed=allowed)
        if draft.tail.shape[1]:  # through blocks [0, E) from Python: an exit block writes its cache there
            draft.hiddens.append(self.passes.run(b, draft.tail, done, b.exit_layer))
            draft.tail = draft.tail[:, :0]
        hidden = joined(draft.hiddens)  # (B, k+1, D)
        positions = self.passes.place(b, 0, draft.k + 1)["positions"]
        return self.passes.backend.verify_greedy(b.exit_layer, num_layers, b.cache, positions, draft.tokens,
                                                 hidden=hidden, allowed=allowed)


__all__ = ["Verifier"]
