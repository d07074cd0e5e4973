"""Proposers: where a round's drafts come from, each behind `propose`, and the round's `Draft`.

- `EarlyExitProposer`: the model's first E blocks, final norm and draft head (trimmed or behind an exit
  adapter), one draft at a time (`propose`) or the round's k in one backend call (`propose_all`);
- `CopyProposer`: a copy from the row's context (the policy's n-gram index, `DraftPolicy.copy_after`),
  under a grammar cut where the grammar refuses and closed where the context's clause ends;
- `ForcedProposer`: a grammar's forced tokens (certain once the drafts before them are accepted).

`RoundDrafter` composes them into one round as the policy plans it (`DraftPlan`): the free drafts first
(forced tokens, the plan's copy), then early-exit drafts, each followed by the free drafts it makes
possible; the hybrid drafter is this composition with copies and the early exit both on. The round's
`Draft` (the drafted parts, how each was drafted, their `Segment`s, the exit states already computed)
goes to the verification (`verification.py`), which is the same for every proposer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .batch import Batch, joined, width
from .grammar import apply_mask
from .ngram import TokenText
from .passes import RoundPasses
from .policy import DraftPlan, DraftPolicy, Segment


@dataclass
class Draft:
    """One round's draft, read by its verification (`Verifier.verify`).

    parts: the drafted tokens in position order, (B, r) each; q: how each was drafted, per part
    ("copy", tokens (B, r)) or per early-exit token ("early_exit", its draft logits (B, V));
    segments: the runs of positions per source; hiddens: exit hidden states (B, t, D) of the
    positions n .. that already ran through blocks [0, E); tail: the tokens (B, t) at positions
    n + len(hiddens' positions) .. n + k that still need that pass (the verification runs them
    first, so a round's last draft step is timed as verification, as it is its first part).
    """

    parts: list = field(default_factory=list)
    q: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    hiddens: list = field(default_factory=list)
    tail: torch.Tensor = None
    stopped: bool = False  # the early exit stopped below η before the plan's last draft

    def add(self, source: str, tokens: torch.Tensor) -> None:
        """Drafts (B, r) from `source` at the next r draft positions. Consecutive drafts of one
        source make one `Segment`. Copied and forced drafts are deterministic: one-hot q."""
        start = self.k
        self.parts.append(tokens)
        last = self.segments[-1] if self.segments else None
        if last is not None and last.source == source:
            self.segments[-1] = Segment(source, last.start, last.length + tokens.shape[1])
        else:
            self.segments.append(Segment(source, start, tokens.shape[1]))
        if source != "early_exit":
            self.q.append(("copy", tokens))

    def host_tokens(self) -> np.ndarray:
        """(B, k) every draft of the round, on the host."""
        return self.tokens.cpu().numpy()

    @property
    def tokens(self) -> torch.Tensor:
        """(B, k) every draft of the round."""
        return joined(self.parts) if self.parts else self.tail[:, :0]

    @property
    def k(self) -> int:
        return sum(part.shape[1] for part in self.parts)


class EarlyExitProposer:
    """Drafts of the early exit: blocks [0, E), the final norm and the draft head, each draft the next
    one's input; greedy drafts through the backend's calls where it has them, so that every path
    chooses alike."""

    def __init__(self, passes: RoundPasses):
        self.passes = passes

    def propose_all(self, b: Batch, draft: Draft, k: int) -> bool:
        """The round's k greedy drafts in one backend call (`Backend.draft_loop`), the same drafts and
        cache as k calls of `propose`, without the Python between the steps. Its last pass through
        blocks [0, E) runs the last draft (which the verification would run first), so the draft time
        holds it. Whether it ran (else nothing was run)."""
        place = self.passes.place(b, 0, k + 1)
        out = self.passes.backend.draft_loop(b.exit_layer, b.pending_dev, b.cache, place["positions"],
                                             b.loop_head, k, b.stop_below)
        if out is None:
            return False
        drafts, hidden = out  # (B, s), (B, s + 1, D)
        if drafts.shape[1]:
            draft.add("early_exit", drafts)
        draft.hiddens.append(hidden)
        draft.stopped = drafts.shape[1] < k
        draft.tail = drafts[:, :0]
        b.lap("draft passes")
        return True

    def propose(self, b: Batch, draft: Draft, unrun: list, allowed: torch.Tensor | None):
        """One draft (B,) at the next draft position: the tokens `unrun` (B, r) each, not yet through
        blocks [0, E), run first (`unrun` emptied, their exit states kept in `draft.hiddens`), then the
        head on the last one's exit state, masked by a grammar's `allowed` (B, V) where given. None when
        η stopped the round (no row's draft reaches it; `draft.stopped` set)."""
        step = self._step(b, draft, unrun, allowed) if unrun and b.step_head is not None else None
        if step is not None:  # one backend call: pass, exit block, head, mask, argmax, η
            token, sure = step
            unrun.clear()
            return self._stopped(draft) if not sure else token
        passes = self.passes
        # this step's input: the tokens since the last pass through blocks [0, E)
        hidden, features = passes.forward(b, joined(unrun), draft.k + 1 - width(unrun), b.exit_layer)
        draft.hiddens.append(hidden)  # (B, r, D), as features
        unrun.clear()
        # greedy: the backend's own choice where it has one, so every path drafts alike
        chosen = (passes.backend.draft_choice(features[:, -1], b.step_head, allowed, b.stop_below)
                  if b.step_head is not None else None)
        if chosen is not None:
            token, sure = chosen
            b.lap("draft passes")
            return self._stopped(draft) if not sure else token
        logits = b.head.logits(features[:, -1])  # (B, V)
        b.lap("draft passes")
        if allowed is not None:
            logits = apply_mask(logits, allowed)
            b.lap("grammar")
        if b.stop_below and passes.unsure(b, logits):
            b.lap("draft choice")
            return self._stopped(draft)
        token = passes.pick(b, logits, b.lengths_dev[:, None] + (draft.k + 1))  # at n + k + 1
        draft.q.append(("early_exit", logits))
        return token

    @staticmethod
    def _stopped(draft: Draft) -> None:
        """η: no row trusts this draft; the round verifies what it has."""
        draft.stopped = True
        return None

    def _step(self, b: Batch, draft: Draft, unrun: list, allowed: torch.Tensor | None):
        """`propose`'s greedy step in one backend call (`Backend.draft_step`): the tokens `unrun` through
        blocks [0, E) and the exit block, the draft head, the mask `allowed` and the argmax, as the step
        from Python does them. (draft (B,), sure: some row's draft reaches η), the exit states appended
        to `draft`; or None, nothing run."""
        tokens = joined(unrun)  # (B, r)
        place = self.passes.place(b, draft.k + 1 - tokens.shape[1], tokens.shape[1])
        out = self.passes.backend.draft_step(b.exit_layer, tokens, b.cache, place["positions"], b.step_head,
                                             b.exit_block, allowed, b.stop_below)
        if out is None:
            return None
        token, hidden, sure = out
        draft.hiddens.append(hidden)
        b.lap("draft passes")
        return token, sure


class ForcedProposer:
    """A grammar's forced tokens: the tokens every continuation the grammar allows begins with."""

    @staticmethod
    def propose(b: Batch, room: int) -> np.ndarray | None:
        """Up to `room` forced tokens (B, r) of the rows' grammars at the drafts so far, or None."""
        forced = b.grammar.forced(room)
        b.lap("grammar")
        return forced


class CopyProposer:
    """Copies from the row's context (the policy's n-gram index); `token_text()` gives the tokenizer's
    `TokenText` (or None), which under a grammar cuts a copy where the context's clause ends."""

    def __init__(self, token_text: Callable[[], TokenText | None]):
        self.token_text = token_text

    def propose(self, b: Batch, draft: Draft, policy: DraftPolicy, room: int) -> np.ndarray:
        """A copy (B, r <= room) to follow the drafts so far (`DraftPolicy.copy_after`); under a grammar
        `closed` (cut where it refuses, closed where the clause ends). r = 0: none."""
        copy = policy.copy_after(b.rows, draft.host_tokens())
        b.lap("policy")
        return self.fit(b, copy, room)

    def fit(self, b: Batch, copy: np.ndarray, room: int) -> np.ndarray:
        """A copy (B, r) cut to `room` drafts and, under a grammar, `closed`."""
        copy = copy[:, :room]
        return self.closed(b, copy) if copy.shape[1] and b.grammar is not None else copy

    def closed(self, b: Batch, copy: np.ndarray) -> np.ndarray:
        """A copy (B, r) under a grammar, consumed by the rows' drafting matchers, cut at the first token
        every row refuses; and where the context's clause ends inside it (`TokenText.clause_end`: `,`, `.`
        or `;` before a space) and the grammar can close the value there, cut there and closed with a
        closer (`TokenText.closers`: `",`, `"}`, `"`, `,`, `}`, the first each row allows). A value
        copied from the prompt ends where its clause does (`Charles Dixon, 89` -> `Charles Dixon",`),
        and the forced key after it follows in the same round. (B, r') the drafts to add."""
        text = self.token_text()
        end = text.clause_end(copy) if text is not None else None
        if end is None:
            copy = copy[:, :b.grammar.admit(copy)]
        else:
            kept = b.grammar.admit(copy[:, :end])
            if kept < end:
                copy = copy[:, :kept]
            else:
                closers = b.grammar.first_allowed(text.closers)  # (B,) or None: no row may close here
                if closers is None:
                    copy = copy[:, :end + b.grammar.admit(copy[:, end:])]
                else:
                    b.grammar.admit(closers[:, None])
                    copy = np.concatenate([copy[:, :end], closers[:, None]], 1)
        b.lap("grammar")
        return copy


class RoundDrafter:
    """A round's drafts as the policy plans them, from the three proposers (module docstring)."""

    def __init__(self, passes: RoundPasses, token_text: Callable[[], TokenText | None]):
        self.early_exit = EarlyExitProposer(passes)
        self.copies = CopyProposer(token_text)
        self.forced = ForcedProposer()

    def draft(self, b: Batch, plan: DraftPlan, policy: DraftPolicy, cap: int) -> Draft:
        """The round's drafts, at most `cap`: first the free ones (a grammar's forced tokens, then
        `plan.copied` (B, m) copied tokens, see `free_drafts`), then up to `plan.extend` early-exit
        drafts, one at a time, each followed by the free drafts it makes possible: under a grammar its
        forced tokens (the early exit then goes on after them); when the policy turns the rest of the
        round into a copy (`policy.copy_after`), the copy ends it. Tokens without an exit hidden state
        yet (the pending token, copied and forced drafts) run through blocks [0, E) together, in one
        parallel pass, when the early exit next needs their state; an early-exit draft keeps its own
        step's."""
        draft = Draft()
        unrun = [b.pending_dev[:, None]]  # (B, r) each: tokens not yet through blocks [0, E), in order
        copied = self.free_drafts(b, draft, unrun, policy, cap, plan.copied)
        extend = 0 if copied and not plan.num_copied else plan.extend  # a copy found on the way ends it
        if extend and not draft.k and b.loop_head is not None and self.early_exit.propose_all(
                b, draft, min(extend, cap)):
            # a policy that copies after early-exit drafts looks once, after them all (the step-by-step
            # loop looks after each): other drafts, the same output
            if policy.copies_after_early_exit and not draft.stopped and draft.k < cap:
                unrun = []
                self.free_drafts(b, draft, unrun, policy, cap)
                if unrun:
                    draft.tail = joined(unrun)
            return draft
        for _ in range(extend):
            if draft.k >= cap:
                break
            allowed = None
            if b.grammar is not None:  # the draft picks among what the grammar allows: q is masked too
                allowed = b.grammar.mask()  # (B, V)
                b.lap("grammar")
            token = self.early_exit.propose(b, draft, unrun, allowed)
            if token is None:  # η stopped the round
                break
            draft.add("early_exit", token[:, None])
            unrun.append(token[:, None])
            b.lap("draft choice")
            if b.grammar is not None:
                b.grammar.admit(token[:, None].cpu().numpy())
                b.lap("grammar")
            if draft.k < cap and (b.forced or policy.copies_after_early_exit):
                if self.free_drafts(b, draft, unrun, policy, cap):  # a copy ends the round
                    break
        # The drafts after the last pass through blocks [0, E) are the verification's first part; when
        # η stopped the round every token already had that pass (B, 0), even with no early-exit draft.
        draft.tail = joined(unrun) if unrun else b.pending_dev[:, None][:, :0]
        b.lap("draft choice")
        return draft

    def free_drafts(self, b: Batch, draft: Draft, unrun: list, policy: DraftPolicy, cap: int,
                    copy: np.ndarray | None = None) -> bool:
        """Drafts that take no model call, appended to `draft` and `unrun`: a grammar's forced tokens,
        then a copy (`copy` (B, r), or the copy proposer's after the drafts so far), cut at the first
        token every row's grammar refuses; under a grammar, forced tokens and copies alternate while
        either finds something, the round's copies `policy.copy_limit()` tokens in all: each copied
        draft is verified at a cost, and a chain of copies is rarely accepted to its end (a forced
        token is certain once the drafts before it are accepted). Whether a copy was added."""
        copied = False
        limit = policy.copy_limit()
        room = cap if limit is None else limit - sum(s.length for s in draft.segments if s.source == "copy")
        device = b.steps.device
        while draft.k < cap:
            forced = self.forced.propose(b, cap - draft.k) if b.forced else None
            if forced is not None and forced.shape[1]:
                draft.add("forced", torch.as_tensor(forced, device=device))
                unrun.append(draft.parts[-1])
                copy = None  # the copy was looked up before the forced tokens
                b.lap("draft choice")
            if copy is None:  # the proposer reads the drafts on the host: ask only a policy that can copy
                if not draft.k or not (policy.copies if b.grammar is not None
                                       else policy.copies_after_early_exit):
                    break
                copy = self.copies.propose(b, draft, policy, min(cap - draft.k, room))
            else:
                copy = self.copies.fit(b, copy, min(cap - draft.k, room))
            if not copy.shape[1]:
                break
            draft.add("copy", torch.as_tensor(copy, device=device))
            unrun.append(draft.parts[-1])
            b.lap("draft choice")
            copied, copy, room = True, None, room - copy.shape[1]
            if b.grammar is None:  # unconstrained, one copy ends the free drafts
                break
        return copied


__all__ = ["CopyProposer", "Draft", "EarlyExitProposer", "ForcedProposer", "RoundDrafter"]
