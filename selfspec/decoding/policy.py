"""Which drafter drafts the next round, and how many tokens: early exit, copying, or both.

A round's draft is planned as a `DraftPlan`: m tokens copied from the context (per row), then up
to `extend` tokens drafted by the early exit (the model's first E blocks + final norm + head). m = 0
is plain self-speculation, extend = 0 a pure copy, k = m + extend = 0 a plain decoding step. While
the early exit drafts, the policy may turn a draft into a copy (`copy_after`): once the drafted
tokens make the context's suffix match again, the copy takes over for the rest of the round. One
verify path serves all of them (`Engine._round` -> `Runner.round` -> `Verifier.verify`); a round
reports its draft as `Segment`s, runs of positions from one source.

Drafters (`SelfSpecGenerator(drafter=...)`):

- ``early_exit``: every round drafts `controller.next_k()` tokens with the early exit (the
  controllers of `controller.py`: fixed k, the window rule, the cost model).
- ``ngram``: copy when the context has a match of at least `min_ngram` tokens, else a plain step;
  no early exit at all (Hugging Face's prompt lookup, on selfspec's engine).
- ``hybrid``: copy when a long enough match exists, early-exit drafting otherwise, and switch
  from early-exit drafting to copying within the round as soon as the drafted tokens produce a
  match. Each source's draft length adapts to its own acceptance: the early exit's by
  its controller, the copy length by a `WindowRule` over the copies' own α (up to `max_copy`;
  proposing a copy costs nothing, so only acceptance decides how long to copy). The rule reads
  only accepted counts, never clocks, so the same prompts decode in the same rounds on any
  machine.

A policy sees the emitted tokens of every row (`observe`) and the outcome of every round
(`update`); `start` resets it for a new `generate` call. With a `CostGate` (`gate`, from the
checkpoint's measured `RoundCosts`), each source's k is cut to what pays at the batch's longest
context (`costs.py`): down to a plain step where drafting costs more than it returns. It cuts rounds
of greedy rows only: a sampled row's draws follow its drafts, so they must not depend on the batch it
shares (its lengths and acceptance) nor on where a compiled call ends (`gated`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends import FusedDrafts
from ..errors import UserError
from .controller import Controller, FixedK, WindowRule, make_controller
from .costs import CostGate
from .ngram import NGramConfig, RowIndexes

DRAFTERS = ("early_exit", "ngram", "hybrid")
COPY_WINDOW = 16  # copy rounds the copy length's α is taken over: copying comes and goes with the text
# rounds a compiled call runs under an adaptive k or copy length (`controller.WindowRule`, `CostModelRule`:
# the controller sees every round's counts after the call and sets the next call's): `ADAPT_ROUNDS`, then
# twice the last call's, up to `ADAPT_MOST`, while the controller keeps its drafts (`Engine._span`). Each
# call costs its setup around its rounds (the Python between calls, caches the passes flushed), dear where
# rounds are cheap; long calls make a model with dear rounds adapt its copy length late. Growing only while
# nothing changes serves both (figures: docs/performance.md, "Calls of adaptive rounds")
ADAPT_ROUNDS = 8
ADAPT_MOST = 64
GATED_ROUNDS = 32  # the most rounds a call runs where a cost gate cuts the row's drafts (it decides between)
LEARN_ROUNDS = 8  # a gated row's first call: the gate's first α, so its first cut, come from these rounds


@dataclass(frozen=True)
class Segment:
    """Draft positions start .. start + length − 1 of a round came from `source` ("copy", "forced": a
    grammar's forced tokens, "early_exit")."""

    source: str
    start: int
    length: int

    def accepted(self, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows whose verifier tested this segment, their accepted drafts within it) from the
        round's accepted counts (B,): a segment is tested only when every earlier draft was accepted."""
        reached = accepted >= self.start
        return reached, np.minimum(accepted[reached] - self.start, self.length)  # ≥ 0 where reached


@dataclass
class DraftPlan:
    """The next round's draft: `copied` (B, m) tokens per row, then `early_exit` early-exit drafts."""

    copied: np.ndarray  # (B, m) int64
    early_exit: int = 0

    @property
    def num_copied(self) -> int:
        return self.copied.shape[1]

    @property
    def k(self) -> int:
        return self.num_copied + self.early_exit

    def truncate(self, k: int) -> DraftPlan:
        """At most k drafts (copied ones first): for a draft that would pass the model's last position."""
        k = max(k, 0)
        copied = self.copied[:, :k]
        return DraftPlan(copied, min(self.early_exit, k - copied.shape[1]))


class DraftPolicy:
    """Base class: plans rounds; `k_max` bounds a round's draft length (it sizes the KV cache's headroom).
    It keeps every row's context length (`lengths`, by caller row) for its `gate`."""

    k_max: int = 0
    copies = False  # whether `copy_after` can return a copy at all (after forced tokens, say)
    copies_after_early_exit = False  # whether it can after early-exit drafts (the engine then asks)
    gate: CostGate | None = None
    sources: tuple[str, ...] = ()  # where its drafts come from ("early_exit", "copy"), for the gate
    lengths: np.ndarray = np.zeros(0, dtype=np.int64)  # set per call by `start`
    sampled: np.ndarray = np.zeros(0, dtype=bool)  # by caller row: whether it draws its tokens
    _gating = True  # whether the gate cut the rows of the round last planned (`gated`)

    def start(self, prompts: list[list[int]]) -> None:
        """A new `generate` call with these prompts (row i = prompts[i])."""
        self.lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        self.sampled = np.zeros(len(prompts), dtype=bool)

    def sample_rows(self, sampled) -> None:
        """Which rows draw their tokens, by caller row (every row so far; the engine tells after `start`
        and after rows join): the gate leaves their drafts alone (`gates`)."""
        self.sampled = np.asarray(sampled, dtype=bool)

    def match_text(self, text) -> None:
        """From the next `start` on, copies may also match the context's text where its tokens differ
        (`ngram.TokenText`), or not (None)."""

    def add(self, prompts: list[list[int]]) -> None:
        """More rows join the call (`Engine.add` after the first step): their ids follow the rows so far,
        in order."""
        self.lengths = np.concatenate([self.lengths, [len(p) for p in prompts]]).astype(np.int64)
        self.sampled = np.concatenate([self.sampled, np.zeros(len(prompts), dtype=bool)])

    def plan(self, rows: np.ndarray) -> DraftPlan:
        """The draft of the next round for the running rows `rows` (caller row indices, batch order)."""
        raise NotImplementedError

    def copy_after(self, rows: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        """A copy (B, r) to follow the early-exit drafts `drafted` (B, j) of this round; r = 0: none."""
        return np.zeros((len(rows), 0), dtype=np.int64)

    def copy_limit(self) -> int | None:
        """The most tokens a round copies in all (under a grammar, copies and forced runs alternate);
        None: no limit beyond the round's own."""
        return None

    def observe(self, rows: np.ndarray, tokens: np.ndarray, emit: np.ndarray) -> None:
        """Row rows[s] emitted tokens[s, :emit[s]] this round."""
        self.lengths[rows] += emit

    def gates(self, rows) -> bool:
        """Whether the gate cuts the drafts of `rows`: a gate, and no row among them sampled. A sampled
        row's draws depend on its drafts, so a seeded row keeps its text alone, in any batch and in
        compiled calls or rounds from Python only at the k it was given: the gate's cuts follow the batch's
        longest context, its pooled acceptance and the calls' boundaries (a greedy row's output is the
        same at any k)."""
        return self.gate is not None and not self.sampled[rows].any()

    def gated(self, source: str, k: int, rows) -> int:
        """k drafts from `source` cut to what pays at the longest of `rows`' contexts (`CostGate.k`);
        k itself where the gate does not cut these rows (`gates`). The gate then learns these rows'
        rounds only where it cuts them: a sampled row's acceptance is not a greedy one's."""
        self._gating = self.gates(rows)
        if not self._gating:
            return k
        # asked at k <= 0 too: the gate's cut (`rounds_cap`) must be this call's
        return self.gate.k(source, k, int(self.lengths[rows].max()))

    def rounds_cap(self, rows) -> int | None:
        """The most rounds the next compiled call for `rows` may run for the gate's sake: 1 for a probe
        (`CostGate.probing`), `LEARN_ROUNDS` while it learns a source's α (`CostGate.learning`: its first
        rounds tell the gate), else `GATED_ROUNDS` (the gate decides between calls), and no further than
        the next probe of a source this call's drafts (`fused_drafts`, asked first) were cut off from
        (`CostGate.rounds_to_probe`); None where the gate does not cut these rows (`gates`)."""
        if not self.gates(rows):
            return None
        gate = self.gate
        if gate.probing:
            return 1
        cap = LEARN_ROUNDS if gate.learning(self.sources) else GATED_ROUNDS
        due = gate.rounds_to_probe()
        return cap if due is None else min(cap, due)

    def overlaps(self, rows) -> bool:
        """Whether rounds may overlap at the longest of `rows`' contexts (`RoundCosts.overlap_pays`; True
        without a gate, or with costs measured for another exit: how much overlapping gains depends on how
        the exit splits the blocks between the two threads, so another exit's gain says nothing)."""
        gate = self.gate
        if gate is None or not gate.gates_early_exit:
            return True
        return gate.costs.overlap_pays(int(self.lengths[rows].max()))

    def gate_record(self, drafts: dict) -> None:
        """The gate learns a round's drafts, {source: (k, accepted counts of the rows that tested them)},
        where it cut the round's rows (`gated`)."""
        if self.gate is not None and self._gating:
            self.gate.record(drafts)

    def update(self, segments: list[Segment], accepted: np.ndarray, draft_time: float,
               verify_time: float) -> None:
        """The round drafted `segments` and accepted `accepted` (B,) drafts; its draft and verify seconds."""

    # -- fused rounds (a backend's `greedy_rounds`: many rounds of one row in one call) ----------------
    @property
    def drafts_early_exit(self) -> bool:
        """Whether some round may draft with the early exit (else plain steps and copies only)."""
        return False

    @property
    def fixed(self) -> bool:
        """Whether every round drafts alike (a fixed k, no copies), a gate's cuts aside: a fused call may
        then run to the end, where a gate cuts `rounds_cap` rounds."""
        return False

    def fuses(self, rounds_per_call: int) -> bool:
        """Whether this policy's rounds may run fused, `rounds_per_call` in one call."""
        return False

    def fused_drafts(self, row: int) -> FusedDrafts:
        """How the next fused call drafts for `row` (its k, its copies), as a backend takes it; the
        caller adds the early exit's E, head and η."""
        raise NotImplementedError


class EarlyExitPolicy(DraftPolicy):
    """Every round drafts with the early exit, `controller.next_k()` tokens (0: a plain step)."""

    def __init__(self, controller: Controller):
        self.controller = controller
        self.k_max = controller.k_max
        self.sources = ("early_exit",)

    def plan(self, rows):
        return DraftPlan(np.zeros((len(rows), 0), dtype=np.int64),
                         self.gated("early_exit", self.controller.next_k(), rows))

    def update(self, segments, accepted, draft_time, verify_time):
        # the early exit's own drafts and what it kept of them: a grammar's forced tokens cost no draft
        # step and test nothing of the exit (counted as its own, they made α exceed 1)
        own = [s for s in segments if s.source == "early_exit"]
        if own and (len(segments) > 1 or own[0].start):  # else every draft is the exit's: counts as they are
            reached = accepted >= own[0].start  # rows whose verifier tested the exit's first draft
            accepted = sum(np.clip(accepted[reached] - s.start, 0, s.length) for s in own)
        k = sum(s.length for s in own)
        self.controller.update(k, accepted, draft_time, verify_time)
        self.gate_record({"early_exit": (k, accepted)})

    @property
    def drafts_early_exit(self):
        return self.controller.k_max > 0

    @property
    def fixed(self):
        return type(self.controller) is FixedK

    def fuses(self, rounds_per_call):
        return True

    def fused_drafts(self, row):
        return FusedDrafts(k=self.gated("early_exit", self.controller.next_k(), [row]))


class CopyPolicy(DraftPolicy):
    """Copy when a match of >= `min_ngram` tokens exists; otherwise the early exit's plan.

    early_exit: the controller of the early-exit drafts (FixedK(0) = plain steps: the `ngram`
    drafter). copy_controller: the copy length's; default the window rule on the copies' α, from
    `max_copy` down to 1.
    """

    def __init__(self, ngram: NGramConfig, early_exit: Controller, copy_controller: Controller | None = None):
        self.ngram = ngram
        self.early_exit = early_exit
        self.copy_controller = copy_controller or WindowRule(
            k=ngram.max_copy, k_min=1, k_max=ngram.max_copy, window=COPY_WINDOW)
        # the longest round: early-exit drafts that turn into a copy (a plan copies or drafts, never both)
        self.k_max = early_exit.k_max + self.copy_controller.k_max
        self.copies = True
        self.copies_after_early_exit = early_exit.k_max > 0
        self.sources = ("copy", "early_exit") if early_exit.k_max > 0 else ("copy",)
        self.text = None
        self.context = RowIndexes(ngram)  # every row's n-gram index, from `start` on

    def match_text(self, text):
        self.text = text

    def start(self, prompts):
        super().start(prompts)
        self.context = RowIndexes(self.ngram, self.text)
        self.context.add(prompts)

    def add(self, prompts):
        super().add(prompts)
        self.context.add(prompts)

    def observe(self, rows, tokens, emit):
        super().observe(rows, tokens, emit)
        self.context.extend(rows, tokens, emit)

    def plan(self, rows):
        copied = self.context.copies(rows, self.gated("copy", self.copy_controller.next_k(), rows))
        early_exit = 0 if copied.shape[1] else self.gated("early_exit", self.early_exit.next_k(), rows)
        return DraftPlan(copied, early_exit)

    def copy_after(self, rows, drafted):
        return self.context.copies(rows, self.gated("copy", self.copy_controller.next_k(), rows), drafted)

    def copy_limit(self):
        return self.copy_controller.next_k()

    def update(self, segments, accepted, draft_time, verify_time):
        if not segments:  # a plain step: the cost the early exit's drafts must beat
            self.early_exit.update(0, accepted, draft_time, verify_time)
        drafts = {}
        for segment in segments:  # each source's controller learns from its own drafts
            reached, kept = segment.accepted(accepted)
            if not reached.any():
                continue
            if segment.source == "copy":  # proposing a copy took no draft time
                self.copy_controller.update(segment.length, kept, 0.0, verify_time)
            elif segment.source == "early_exit":  # a grammar's forced tokens teach neither
                self.early_exit.update(segment.length, kept, draft_time, verify_time)
            if segment.source != "forced":
                drafts[segment.source] = (segment.length, kept)
        self.gate_record(drafts)

    @property
    def drafts_early_exit(self):
        return self.early_exit.k_max > 0

    def fuses(self, rounds_per_call):
        # a call of one round gains nothing from fusing: the copies' search (`NGramSearch`) starts again
        # from the row's end each call, where the policy's own index grows by each round's tokens
        return rounds_per_call > 1

    def fused_drafts(self, row):
        copy_length = self.gated("copy", self.copy_controller.next_k(), [row])
        k = self.gated("early_exit", self.early_exit.next_k(), [row])
        if not copy_length:  # the gate cut the copies: the early exit's drafts, or plain steps
            return FusedDrafts(k=k)
        return FusedDrafts(k=k, history=self.context.history(row),
                           min_ngram=self.ngram.min_ngram, max_ngram=self.ngram.max_ngram,
                           copy_length=copy_length)


def make_policy(drafter: str, num_speculations, ngram: NGramConfig | None = None,
                gate: CostGate | None = None) -> DraftPolicy:
    """The policy of `drafter` ("early_exit", "ngram", "hybrid"); `num_speculations` is the early
    exit's k (int, "auto", "window" or a `Controller`, see `controller.make_controller`); `gate`: the
    cost gate its rounds' k pass through (None: none)."""
    if drafter not in DRAFTERS:
        raise UserError(f"drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
    ngram = ngram or NGramConfig()
    if drafter == "ngram":
        policy = CopyPolicy(ngram, FixedK(0))
    else:
        controller = make_controller(num_speculations)
        policy = EarlyExitPolicy(controller) if drafter == "early_exit" else CopyPolicy(ngram, controller)
    policy.gate = gate if policy.k_max > 0 else None
    return policy


__all__ = ["DRAFTERS", "CopyPolicy", "DraftPlan", "DraftPolicy", "EarlyExitPolicy", "Segment", "make_policy"]
