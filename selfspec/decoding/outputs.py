"""What a decode returns: `GenerationOutput` and its `GenerationStats`, a step's `RoundOutput` per row, a
request (`NewRow`) and the counts behind a step's tokens (`RoundCounts`). Types only: the engine
(`engine.py`) and the generator (`speculative.py`) both speak them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..metrics import AcceptanceStats
from ..sampling import SamplingParams
from .grammar import Constraint

SOURCES = ("copy", "forced", "early_exit")  # where a draft comes from (`GenerationStats`' "by_source")


@dataclass
class GenerationStats(AcceptanceStats):
    """Acceptance statistics (see `selfspec.metrics.AcceptanceStats`) plus where the time went.

    Times are seconds: `draft_time` over all draft steps, `verify_time` over the verifications of
    speculative rounds, `plain_time` over rounds with k = 0 (plain steps), `prefill_time` and the
    wall-clock `total_time` of the call. On CUDA the phases are timed with CUDA events.
    """

    exit_layer: int = 0
    num_layers: int = 0
    draft_steps: int = 0  # draft forward passes (Σ k over rounds; a step serves the whole batch)
    plain_steps: int = 0  # rounds with k = 0
    stopped_below_eta: int = 0  # rounds whose early-exit drafts stopped because no draft reached η
    drafted_ahead: int = 0  # rounds whose drafts ran during the round before's verification (overlap)
    grammar_time: float = 0.0  # seconds in the grammar engine (masks, forced tokens), constrained calls
    draft_time: float = 0.0
    verify_time: float = 0.0
    plain_time: float = 0.0
    prefill_time: float = 0.0
    total_time: float = 0.0
    generated_tokens: int = 0
    profile: dict | None = None  # generate(profile=True): seconds per part of the rounds (`profile.PARTS`)
    # Where the drafts came from: copied from the context, forced by a grammar, or drafted by the
    # early exit. Each run of a round's positions from one source (a `Segment`) counts under its
    # source, in the rows whose verifier tested it (every earlier draft accepted).
    copy: AcceptanceStats = field(default_factory=AcceptanceStats)
    forced: AcceptanceStats = field(default_factory=AcceptanceStats)
    early_exit: AcceptanceStats = field(default_factory=AcceptanceStats)
    # (segments, accepted (B,), k) per round, folded into the counts above at the end of the call
    # (`fold_rounds`): a round only appends, and the counting runs once, in bulk, off the rounds' path
    _rounds: list = field(default_factory=list, repr=False)

    def log_round(self, segments: list, accepted: np.ndarray, k: int) -> None:
        """A round's drafts (its `Segment`s, k in all) and each row's accepted count, for `fold_rounds`."""
        self._rounds.append((segments, accepted, k))

    def fold_rounds(self) -> None:
        """Count the logged rounds into the acceptance statistics, overall and per source: rounds of
        one k (of one segment) at once, the same counts as `update` round by round."""
        by_k, by_segment = {}, {}
        for segments, accepted, k in self._rounds:
            by_k.setdefault(k, []).append(accepted)
            for segment in segments:
                by_segment.setdefault(segment, []).append(accepted)
        for k, rows in by_k.items():
            self.update(np.concatenate(rows), k, rounds=len(rows))
        for segment, rows in by_segment.items():
            reached = [a[a >= segment.start] for a in rows]  # rows whose verifier tested the segment
            rounds = sum(1 for a in reached if a.size)
            if rounds:
                kept = np.clip(np.concatenate(reached) - segment.start, 0, segment.length)
                getattr(self, segment.source).update(kept, segment.length, rounds=rounds)
        self._rounds.clear()

    def merge(self, other: GenerationStats) -> None:
        """Add another decode's counts and times to these, per source too (the lanes of one call,
        `lanes.Lanes`); its profile's seconds part by part."""
        other.fold_rounds()
        self.fold_rounds()
        super().merge(other)
        for name in ("draft_steps", "plain_steps", "stopped_below_eta", "drafted_ahead", "grammar_time",
                     "draft_time", "verify_time", "plain_time", "prefill_time", "total_time",
                     "generated_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for source in SOURCES:
            getattr(self, source).merge(getattr(other, source))
        self.num_layers = self.num_layers or other.num_layers
        self.exit_layer = self.exit_layer or other.exit_layer
        if other.profile is not None:
            mine = self.profile or {}
            self.profile = {part: mine.get(part, 0.0) + other.profile.get(part, 0.0)
                            for part in {**mine, **other.profile}}

    @property
    def draft_cost(self) -> float:
        """c = draft time per step ÷ time of one full forward step.

        The full step is a plain round's when the run had any; otherwise a verification round's,
        which for a memory-bound model costs about one full forward (c + (1 − c) for k + 1 positions).
        `selfspec.evaluation.benchmark` measures c against a separate plain run instead.
        """
        if not self.draft_steps:
            return float("nan")
        if self.plain_steps:
            full = self.plain_time / self.plain_steps
        else:
            full = self.verify_time / (self.rounds - self.plain_steps)
        return self.draft_time / self.draft_steps / full

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_time if self.total_time else float("nan")

    def as_dict(self) -> dict:
        times = {name: getattr(self, name) for name in (
            "exit_layer", "num_layers", "draft_steps", "plain_steps", "stopped_below_eta", "drafted_ahead",
            "draft_time", "verify_time", "grammar_time",
            "plain_time", "prefill_time", "total_time", "generated_tokens")}
        return {**super().as_dict(), **times, "draft_cost": self.draft_cost,
                "tokens_per_second": self.tokens_per_second,
                "by_source": {source: getattr(self, source).as_dict() for source in SOURCES},
                **({"profile": self.profile} if self.profile is not None else {})}


@dataclass
class GenerationOutput:
    sequences: list  # generated token ids per row, prompt excluded, an eos included
    stats: GenerationStats
    # decoded `sequences` when the generator has a tokenizer: special tokens left out, each ending before
    # the stop string that ended its row (`text.RowText`)
    texts: list | None = None
    # per row under a grammar: whether the output is complete (it parses); False for a row that
    # max_new_tokens cut first, True for an unconstrained row. None when no row was constrained.
    complete: list | None = None
    # per row, why it ended, as OpenAI's API says: "stop" (an eos, a stop string, a complete grammar),
    # "length" (max_new_tokens), "cancelled" (`Engine.cancel`)
    finish_reasons: list | None = None


class RoundCounts(NamedTuple):
    """What the rounds behind one `Engine.step` did, per running row (B,) each: the rounds (one full
    pass each), the drafts they verified, and how many of those were accepted."""

    rounds: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray


@dataclass(frozen=True)
class NewRow:
    """A request: a prompt for `Engine.add` (before the first step, or joining the running rows at the
    next step's round boundary): its token ids, its own token limit, its seed (None: the call's
    seeds for its first rows, 0 for a greedy row joining later, one drawn for a sampled one), its
    output constraint (a `grammar.Constraint`, or None), its sampling (`SamplingParams`: temperature,
    top-k, top-p; None: the call's) and its stop strings (None: the call's). Rows of one batch may
    each ask for other settings (vLLM's per-request `SamplingParams`): each gets what it gets alone."""

    prompt: list[int]
    max_new_tokens: int
    seed: int | None = None
    constraint: Constraint | None = None
    sampling: SamplingParams | None = None
    stop_strings: tuple[str, ...] | None = None


@dataclass(frozen=True)
class RoundOutput:
    """What one `Engine.step` did for one row: the tokens it emitted (its accepted drafts then the
    target's own token, per round; cut at an eos, a stop string or its limit), why it finished if it did,
    and the rounds (one full pass each), drafts verified and drafts accepted behind them."""

    row: int  # the request's row: the order of `Engine.add`
    tokens: list[int]
    finish_reason: str | None  # None while the row runs, else as `GenerationOutput.finish_reasons`
    rounds: int
    drafted: int
    accepted: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
