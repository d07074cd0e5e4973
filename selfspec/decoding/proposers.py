"""Proposers: where a round's drafts come from, each behind one method, and the round's `Draft`.

Every proposer implements `Proposer.propose(state, k_left) -> int`: up to `k_left` drafts at the next draft
positions, appended to the round's `RoundState` (its `Draft`, and the tokens not yet through blocks
[0, E)) with the rows' grammars told; how many it added (0: none).

- `EarlyExitProposer`: the model's first E blocks, final norm and draft head (trimmed or behind an exit
  adapter): the round's drafts as one loop at its start (`selfspec.draft_loop`: the backend's call for it,
  or the loop in torch through the model's passes), else (a grammar, an exit block) one draft a step;
- `CopyProposer`: a copy from the row's context (at the round's start the plan's, after drafts the
  policy's, `DraftPolicy.copy_after`), within the round's copy length, under a grammar cut where the
  grammar refuses and closed where the context's clause ends;
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
from typing import Protocol

import numpy as np
import torch

from ..draft_loop import draft_loop, pick
from ..sampling import apply_mask
from .batch import Batch, joined, width
from .ngram import TokenText
from .passes import RoundPasses
from .policy import DraftPlan, DraftPolicy, Segment


@dataclass
class Draft:
    """One round's draft, read by its verification (`Verifier.verify`).

    parts: the drafted tokens in position order, (B, r) each; q: how each was drafted, per part
    ("copy", tokens (B, r)), per early-exit token ("early_exit", its draft logits (B, V)), or for a
    backend's sampled draft loop ("q", the drafts' distributions (B, r, V));
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


@dataclass
class RoundState:
    """One round's drafting as the proposers see it: what each reads, and the draft each extends.

    b: the running rows; policy: the call's `DraftPolicy` (the copies and their length come from it);
    plan: its `DraftPlan` of the round; k_max: the most drafts the round holds; draft: the drafts so far;
    unrun: tokens (B, r) each, in position order, not yet through blocks [0, E) (the pending token first):
    the early exit runs them before its next draft, the verification those left (`Draft.tail`).
    """

    b: Batch
    policy: DraftPolicy
    plan: DraftPlan
    k_max: int
    draft: Draft = field(default_factory=Draft)
    unrun: list = field(default_factory=list)

    @property
    def k_left(self) -> int:
        """The drafts the round may still add."""
        return self.k_max - self.draft.k

    def add(self, source: str, tokens: torch.Tensor) -> None:
        """Drafts (B, r) from `source` at the next positions, not yet through blocks [0, E)."""
        self.draft.add(source, tokens)
        self.unrun.append(tokens)


class Proposer(Protocol):
    """A source of drafts (the module docstring)."""

    def propose(self, state: RoundState, k_left: int) -> int:
        """Up to `k_left` drafts at the next draft positions, appended to `state` with the rows' grammars
        told; how many (0: none here; from the early exit, η stopped the round: `Draft.stopped`)."""
        ...


class EarlyExitProposer:
    """Drafts of the early exit: blocks [0, E), the final norm and the draft head, each draft the next
    one's input; greedy drafts through the backend's calls where it has them, so that every path
    chooses alike."""

    def __init__(self, passes: RoundPasses):
        self.passes = passes

    def propose(self, state: RoundState, k_left: int) -> int:
        """At the round's start, where the drafts may run as one loop (no grammar, no exit block:
        `Batch.loop_drafts`), all `k_left` drafts in it (`_loop`: the backend's call, or the loop in torch);
        else, or where the backend chooses greedy drafts itself step by step, one draft (`_one`), after
        which the caller adds the free drafts it makes possible and asks again. 0: η stopped the round."""
        if not state.draft.k and state.b.loop_drafts:
            drafted = self._loop(state, k_left)
            if drafted is not None:
                return drafted
        return self._one(state)

    def _loop(self, state: RoundState, k: int) -> int | None:
        """The round's k drafts in one go, the same drafts and cache as k calls of `_one` without the Python
        between the steps: the backend's call (`Backend.draft_loop`: compiled, or the static backend's
        capture of `draft_loop`), else `selfspec.draft_loop` itself through the model's passes. Its last
        pass through blocks [0, E) runs the last draft (which the verification would run first), so the
        draft time holds it. The drafts made (fewer than k: η stopped the round), or None: nothing run
        (the backend declined, and chooses greedy drafts itself step by step: `Backend.chooses_drafts`)."""
        b, draft, passes = state.b, state.draft, self.passes
        d, backend, out = b.drafting, passes.backend, None
        if backend.round_calls:
            positions = passes.place(b, 0, k + 1)["positions"]
            out = backend.draft_loop(d.exit_layer, b.pending_dev, b.cache, positions, d.tensors, k,
                                     d.stop_below, b.sampling)
        if out is None:
            if b.sampling.all_greedy and backend.chooses_drafts:
                return None
            out = self._torch_loop(b, k)
        drafts, q, hidden = out  # (B, s), (B, s, V) or None, (B, s + 1, D)
        if drafts.shape[1]:
            draft.add("early_exit", drafts)
            if q is not None:  # drawn by the rows' numbers from q, which the verification accepts against
                draft.q.append(("q", q))
        draft.hiddens.append(hidden)
        draft.stopped = drafts.shape[1] < k
        state.unrun.clear()  # the pending token and every draft ran through blocks [0, E)
        b.lap("draft passes")
        return drafts.shape[1]

    def _torch_loop(self, b: Batch, k: int) -> tuple:
        """`draft_loop.draft_loop` through the model's passes (`RoundPasses.forward`, one position a step)
        and the draft head, stopping where η stops it: (drafts (B, s), q or None, exit states (B, s + 1, D)),
        the cache's blocks [0, E) holding those s + 1 inputs."""
        passes, d = self.passes, b.drafting

        def step(token, i):  # the input at position n + i through blocks [0, E): its exit state (B, D)
            return passes.forward(b, token[:, None], i, d.exit_layer)[1][:, -1]

        positions = b.lengths_dev[:, None] + b.steps[:k + 1]
        drafts, q, _, states = draft_loop(step, d.head.logits, b.pending_dev, positions, k, b.sampling,
                                          stop_below=d.stop_below)
        return drafts, q, states

    def _one(self, state: RoundState) -> int:
        """One draft at the next draft position, among what the rows' grammars allow (their mask applies
        to q too), told to the grammars; 1, or 0 when η stopped the round."""
        b = state.b
        allowed = None
        if b.grammar is not None:
            allowed = b.grammar.mask()  # (B, V)
            b.lap("grammar")
        token = self._choose(b, state.draft, state.unrun, allowed)
        if token is None:
            return 0
        state.add("early_exit", token[:, None])
        b.lap("draft choice")
        if b.grammar is not None:
            b.grammar.admit(token[:, None].cpu().numpy())
            b.lap("grammar")
        return 1

    def _choose(self, b: Batch, draft: Draft, unrun: list, allowed: torch.Tensor | None):
        """One draft (B,) at the next draft position: the tokens `unrun` (B, r) each, not yet through
        blocks [0, E), run first (`unrun` emptied, their exit states kept in `draft.hiddens`), then the
        head on the last one's exit state, masked by a grammar's `allowed` (B, V) where given. None when
        η stopped the round (no row's draft reaches it; `draft.stopped` set)."""
        step = self._step(b, draft, unrun, allowed) if unrun and b.greedy_tensors is not None else None
        if step is not None:  # one backend call: pass, exit block, head, mask, argmax, η
            token, sure = step
            unrun.clear()
            return self._stopped(draft) if not sure else token
        passes = self.passes
        # this step's input: the tokens since the last pass through blocks [0, E)
        hidden, features = passes.forward(b, joined(unrun), draft.k + 1 - width(unrun), b.drafting.exit_layer)
        draft.hiddens.append(hidden)  # (B, r, D), as features
        unrun.clear()
        # greedy: the backend's own choice where it has one, so every path drafts alike
        greedy = b.greedy_tensors
        chosen = (passes.backend.draft_choice(features[:, -1], greedy, allowed, b.drafting.stop_below)
                  if greedy is not None else None)
        if chosen is not None:
            token, sure = chosen
            b.lap("draft passes")
            return self._stopped(draft) if not sure else token
        logits = b.drafting.head.logits(features[:, -1])  # (B, V)
        b.lap("draft passes")
        if allowed is not None:
            logits = apply_mask(logits, allowed)
            b.lap("grammar")
        if b.drafting.stop_below and passes.unsure(b, logits):
            b.lap("draft choice")
            return self._stopped(draft)
        token = pick(logits, b.sampling, b.lengths_dev[:, None] + (draft.k + 1))[0]  # at n + k + 1
        draft.q.append(("early_exit", logits))
        return token

    @staticmethod
    def _stopped(draft: Draft) -> None:
        """η: no row trusts this draft; the round verifies what it has."""
        draft.stopped = True
        return None

    def _step(self, b: Batch, draft: Draft, unrun: list, allowed: torch.Tensor | None):
        """`_choose`'s greedy step in one backend call (`Backend.draft_step`): the tokens `unrun` through
        blocks [0, E) and the exit block, the draft head, the mask `allowed` and the argmax, as the step
        from Python does them. (draft (B,), sure: some row's draft reaches η), the exit states appended
        to `draft`; or None, nothing run."""
        tokens = joined(unrun)  # (B, r)
        place = self.passes.place(b, draft.k + 1 - tokens.shape[1], tokens.shape[1])
        d = b.drafting
        out = self.passes.backend.draft_step(d.exit_layer, tokens, b.cache, place["positions"],
                                             b.greedy_tensors, d.exit_block, allowed, d.stop_below)
        if out is None:
            return None
        token, hidden, sure = out
        draft.hiddens.append(hidden)
        b.lap("draft passes")
        return token, sure


class ForcedProposer:
    """A grammar's forced tokens: the tokens every continuation the grammar allows begins with."""

    def propose(self, state: RoundState, k_left: int) -> int:
        """Up to `k_left` forced tokens of the rows' grammars after the drafts so far (consumed by them);
        none where the round drafts no forced tokens (`Batch.forces`)."""
        b = state.b
        if not b.forces:
            return 0
        forced = b.grammar.forced(k_left)  # (B, r)
        b.lap("grammar")
        if forced is None or not forced.shape[1]:
            return 0
        state.add("forced", torch.as_tensor(forced, device=b.steps.device))
        b.lap("draft choice")
        return forced.shape[1]


class CopyProposer:
    """Copies from the row's context (the policy's, `DraftPolicy.copy_after`); `token_text()` gives the
    tokenizer's `TokenText` (or None), which under a grammar cuts a copy where the context's clause ends."""

    def __init__(self, token_text: Callable[[], TokenText | None]):
        self.token_text = token_text

    def propose(self, state: RoundState, k_left: int) -> int:
        """A copy of up to `k_left` drafts, within what the round may still copy (`DraftPolicy.copy_limit`
        less its copies so far): at the round's first position the plan's (`DraftPlan.copied`, looked up
        as the round was planned), after drafts the policy's copy after them (asked only of a policy that
        can copy there: it reads the drafts on the host); under a grammar `closed`."""
        b, draft, policy = state.b, state.draft, state.policy
        limit = policy.copy_limit()
        if limit is not None:
            k_left = min(k_left, limit - sum(s.length for s in draft.segments if s.source == "copy"))
        if not draft.k:
            copy = state.plan.copied
        elif policy.copies if b.grammar is not None else policy.copies_after_early_exit:
            copy = policy.copy_after(b.rows, draft.host_tokens())
            b.lap("policy")
        else:
            return 0
        copy = copy[:, :k_left]
        if copy.shape[1] and b.grammar is not None:
            copy = self.closed(b, copy)
        if not copy.shape[1]:
            return 0
        state.add("copy", torch.as_tensor(copy, device=b.steps.device))
        b.lap("draft choice")
        return copy.shape[1]

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
    """A round's drafts as the policy plans them, from the three proposers (module docstring), each asked
    through `Proposer.propose` alone."""

    def __init__(self, passes: RoundPasses, token_text: Callable[[], TokenText | None]):
        self.early_exit = EarlyExitProposer(passes)
        self.copies = CopyProposer(token_text)
        self.forced = ForcedProposer()

    def draft(self, b: Batch, plan: DraftPlan, policy: DraftPolicy, k_max: int) -> Draft:
        """The round's drafts, at most `k_max`: first the free ones (a grammar's forced tokens, then the
        plan's copy, see `free_drafts`), then up to `plan.early_exit` early-exit drafts, each followed by the
        free drafts it makes possible: under a grammar its forced tokens (the early exit then goes on
        after them); when the policy turns the rest of the round into a copy (`DraftPolicy.copy_after`),
        the copy ends it. A policy that copies after early-exit drafts looks once, after the last of
        them (one host read of the drafts), whether the backend drafts the round in one call or step by
        step. Tokens without an exit hidden state yet (the pending token, copied and
        forced drafts) run through blocks [0, E) together, in one parallel pass, when the early exit next
        needs their state; an early-exit draft keeps its own step's."""
        state = RoundState(b, policy, plan, k_max, unrun=[b.pending_dev[:, None]])
        copied = self.free_drafts(state)
        left = 0 if copied and not plan.num_copied else plan.early_exit  # a copy found on the way ends it
        while left and state.k_left > 0:
            drafted = self.early_exit.propose(state, min(left, state.k_left))
            if not drafted or state.draft.stopped:  # η stopped the round
                break
            left -= drafted
            # Under a grammar the free drafts follow each early-exit draft (its forced tokens are certain);
            # a copy after early-exit drafts is looked up once, after the last: one host read of the
            # drafts a round, and a backend that drafts the round in one call drafts alike.
            looks = b.forces or (policy.copies_after_early_exit and not left)
            if state.k_left > 0 and looks and self.free_drafts(state):
                break  # a copy ends the round
        # The drafts after the last pass through blocks [0, E) are the verification's first part; when
        # η stopped the round every token already had that pass (B, 0), even with no early-exit draft.
        draft = state.draft
        draft.tail = joined(state.unrun) if state.unrun else b.pending_dev[:, None][:, :0]
        b.lap("draft choice")
        return draft

    def free_drafts(self, state: RoundState) -> bool:
        """Drafts that take no model call, appended to `state`: a grammar's forced tokens, then a copy
        (`CopyProposer.propose`); under a grammar, forced tokens and copies alternate while copies are
        found, the round's copies `policy.copy_limit()` tokens in all: each copied draft is verified at a
        cost, and a chain of copies is rarely accepted to its end (a forced token is certain once the
        drafts before it are accepted). Whether a copy was added."""
        copied = False
        while state.k_left > 0:
            self.forced.propose(state, state.k_left)
            if not self.copies.propose(state, state.k_left):
                break
            copied = True
            if state.b.grammar is None:  # unconstrained, one copy ends the free drafts
                break
        return copied


__all__ = ["CopyProposer", "Draft", "EarlyExitProposer", "ForcedProposer", "Proposer", "RoundDrafter",
           "RoundState"]
