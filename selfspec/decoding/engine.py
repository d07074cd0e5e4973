"""The stepped engine: `Engine.add(request) -> row`, `Engine.step() -> [RoundOutput]`, `Engine.cancel(row)`.

One decode call's state (its `Batch`, policy, statistics and every row's tokens so far), advanced a
round at a time by the caller:

    engine = Engine(runner, policy, CallOptions(settings, sampling, eos))
    row = engine.add(NewRow(prompt, max_new_tokens=64))
    while not engine.done:
        for out in engine.step():          # per running row: its new tokens, finished, drafts, accepted
            print(out.row, out.tokens)
    result = engine.output()               # a `GenerationOutput`, as `generate` returns

Rows added before the first step (or `start()`) are prefilled together; rows added later join the
running batch at the next step's round boundary (prefilled apart, in a cache of their own), and a row's
tokens do not depend on when it joined (greedy; a sampled row draws from its own seed). `cancel` ends a
row before the next round (its tokens so far stay). A step is one round for every running row, or
for a lone greedy row that the CPU kernels run, one compiled call of several rounds.
`SelfSpecGenerator.generate` is a loop over these calls, its streamer and stop strings adapters around
them; `SelfSpecGenerator.engine` makes one for the greedy rows and one for the sampled rows of a decode to
step yourself (`lanes.Lanes`; the server's scheduler steps them). The engine
owns the decode's state and steps the model's `Runner` (`runner.py`: start, join, round, advance), the
one algorithm whichever caller steps it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..backends import FusedDrafts
from ..errors import UserError
from ..model.fast import fixed_width
from ..sampling import SamplingParams
from .grammar import GrammarBatch
from .outputs import GenerationOutput, GenerationStats, NewRow, RoundCounts, RoundOutput
from .policy import ADAPT_MOST, ADAPT_ROUNDS, DraftPolicy
from .profile import RoundProfile
from .runner import Runner
from .settings import DecodeSettings
from .text import RowText, text_of

# A grammar's forced tokens a round may draft beyond the policy's k: they cost no model call, and a
# pass of up to 16 + k positions stays in the compiled kernels' range of rows.
FORCED_PER_ROUND = 16


class _Clock:
    """Timestamps without host syncs: CUDA events on CUDA (read after the round's sync), else perf_counter."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass(frozen=True)
class ContextSwitch:
    """Settings a greedy decode switches to once its longest context reaches `from_tokens` tokens, and
    the policy its rounds then plan with (a checkpoint's long-context pick, `settings.CONTEXT`).

    A round's cost grows with the context faster than a plain step's (the verification's attention over
    k + 1 queries), and the exit's acceptance falls: an exit that pays most after short prompts may not
    after long ones. Switching is lossless for greedy rows (the cache holds every layer of every kept
    position, so any E drafts from it, and greedy rows keep the target's tokens at any settings). Only a
    batch of greedy rows switches: a sampled row's drafts, and so its draws, depend on its own settings
    alone, never on its batch-mates' lengths."""

    from_tokens: int
    settings: DecodeSettings
    policy: DraftPolicy


@dataclass(frozen=True)
class CallOptions:
    """What one decode fixes for all its rows.

    settings: how to draft (`DecodeSettings`); sampling: temperature, top-k, top-p of rows that bring
    none (`NewRow.sampling`); eos: the token ids (n,) that end a row; stops: strings that end a row that
    brings none (`text.RowText`: its tokens keep the one completing it, its text ends before it; needs
    the runner's tokenizer); seed: the first
    rows' seeds (an int: seed + row; a list; None: drawn, 0 for greedy rows), a request's own seed wins;
    grammar: whether the rows start under output constraints (a row that brings one later opens them);
    draft_max_rows: a greedy round of more rows drafts nothing (None: every round drafts);
    rounds_per_step: a caller that reads every step (a server) lets a lone row run this many rounds in
    one compiled call (its first round alone, so its first token comes at once), None: no such caller;
    watched: a caller that reads every round (a streamer, stop strings): one round per call;
    profile: time each part of every round (`GenerationStats.profile`); switches: the `ContextSwitch`es
    of a greedy decode, by ascending `from_tokens` (none: `settings` throughout).
    """

    settings: DecodeSettings
    sampling: SamplingParams
    eos: np.ndarray
    stops: tuple[str, ...] = ()
    seed: int | list | None = None
    grammar: bool = False
    draft_max_rows: int | None = None
    rounds_per_step: int | None = None
    watched: bool = False
    profile: bool = False
    switches: tuple[ContextSwitch, ...] = ()


class Engine:
    """A decode call that the caller steps (module docstring). runner: the model's `Runner`;
    policy: the call's `DraftPolicy` (`SelfSpecGenerator._resolve`); options: `CallOptions`."""

    def __init__(self, runner: Runner, policy: DraftPolicy, options: CallOptions):
        self.runner, self.policy, self.options = runner, policy, options
        self.stats = GenerationStats(exit_layer=options.settings.exit_layer,
                                     num_layers=runner.view.num_layers)
        self.requests: list[NewRow] = []  # every row's request, in the order of `add`
        self.joining: list[NewRow] = []  # added since the batch started, joining at the next step
        self.generated = np.zeros((0, 0), dtype=np.int64)  # (rows, most tokens) each row's tokens so far
        self.counts = np.zeros(0, dtype=np.int64)  # tokens generated per row
        self.limits = np.zeros(0, dtype=np.int64)  # each row's max_new_tokens
        self.prompt_lengths = np.zeros(0, dtype=np.int64)
        self.cancelled: set[int] = set()
        self.b = None  # the running rows (`batch.Batch`), once started
        self.laps = None  # the profile's laps (`profile`), from the first round on
        self.clock = _Clock(runner.view.device)
        # a grammar's forced tokens may join any round once a row brings a constraint: room for them
        self.switches = list(options.switches)  # those still ahead, nearest first
        self.k_max = max(p.k_max + (0 if settings.is_plain else FORCED_PER_ROUND) for settings, p in
                         [(options.settings, policy), *((s.settings, s.policy) for s in self.switches)])
        self.texts: list[RowText] = []  # each row's text and stop strings (none without a tokenizer)
        self.reasons: list[str | None] = []  # each row's finish reason: "stop", "length", "cancelled"
        self.wall = time.perf_counter()

    # -- the three calls ---------------------------------------------------------------------------
    def add(self, request: NewRow) -> int:
        """Queue a request; returns its row. It joins at the next step (or starts with the first)."""
        if not request.prompt or request.max_new_tokens < 1:
            raise UserError("a request needs a prompt and max_new_tokens >= 1")
        request = dataclasses.replace(  # the call's settings where the request brings none
            request, sampling=request.sampling or self.options.sampling,
            stop_strings=self.options.stops if request.stop_strings is None else tuple(request.stop_strings))
        if request.stop_strings and self.runner.tokenizer is None:
            raise UserError("stop strings need a tokenizer: SelfSpecGenerator(model, tokenizer, ...)")
        self.requests.append(request)
        if self.runner.tokenizer is not None:
            self.texts.append(RowText(text_of(self.runner.tokenizer), request.stop_strings))
        self.reasons.append(None)
        if self.b is not None:
            self.joining.append(request)
        return len(self.requests) - 1

    def cancel(self, row: int) -> None:
        """End `row` now: it leaves the batch before the next round runs; its tokens so far stay in the
        output (finish reason "cancelled" unless it had finished)."""
        self.cancelled.add(row)
        self.reasons[row] = self.reasons[row] or "cancelled"

    def text(self, row: int) -> str:
        """`row`'s text so far, special tokens left out, ending before the stop string that ended it; while
        it runs, only what no later token can change (`RowText.text`): what a stream may send. Needs the
        runner's tokenizer."""
        tokens = self.generated[row, :self.counts[row]].tolist()
        return self.texts[row].text(tokens, self.reasons[row] is not None)

    @property
    def done(self) -> bool:
        """No row runs and none waits to join."""
        return self.b is not None and not self.b.rows.size and not self.joining

    @torch.inference_mode()  # per thread: the server's decoding thread steps it directly
    def step(self) -> list[RoundOutput]:
        """One round for every running row (a compiled call of several for a lone greedy row on the CPU
        kernels): what each emitted. Starts the batch first, and lets the rows added since join."""
        # the backend's switches for this thread, a joining row's prefill included; a low-precision
        # model's rounds at one width
        with self.runner.backend.active():
            if self.b is None:
                self.start()
            if self.joining:
                self._join()
            if self.cancelled:
                self._drop_cancelled()
            if not self.b.rows.size:
                return []
            if self.switches:
                self._switch_for_context()
            return self._step()

    def _step(self) -> list[RoundOutput]:
        """`step`'s round over the running rows, under the backend's switches."""
        b = self.b
        with fixed_width(self.runner.fixed_width):
            rows = b.rows
            fused = self._fused_rounds(rows)
            tokens, emit, finished, done = fused if fused is not None else self._round(rows)
            slots, cols = np.nonzero(np.arange(tokens.shape[1]) < emit[:, None])
            self.generated[rows[slots], self.counts[rows[slots]] + cols] = tokens[slots, cols]
            stopped = self._cut_at_stop_strings(rows, emit)
            finished |= stopped
            self.counts[rows] += emit
            self._finish(rows, finished, stopped)
            b.lap("other")
            self.policy.observe(rows, tokens, emit)
            b.lap("policy")
            outputs = [RoundOutput(int(row), tokens[slot, :emit[slot]].tolist(), self.reasons[row],
                                   int(done.rounds[slot]), int(done.drafted[slot]), int(done.accepted[slot]))
                       for slot, row in enumerate(rows)]
            self.runner.advance(b, tokens, emit, keep=~finished)
            b.lap("rollback")
            if self.runner.check_cache:
                b.cache.check(self.prompt_lengths[b.rows] - 1 + self.counts[b.rows])
                b.lap("other")
        return outputs

    def _cut_at_stop_strings(self, rows: np.ndarray, emit: np.ndarray) -> np.ndarray:
        """Shorten `emit` (B,) in place to end at the token completing a row's stop string (`RowText.cut`);
        the slots (B,) that stop."""
        stopped = np.zeros(len(rows), dtype=bool)
        for slot, row in enumerate(rows):
            if self.texts and self.texts[row].stops:
                tokens = self.generated[row, :self.counts[row] + emit[slot]]
                kept = self.texts[row].cut(tokens, int(emit[slot]))
                if kept is not None:
                    emit[slot], stopped[slot] = kept, True
        return stopped

    def _finish(self, rows: np.ndarray, finished: np.ndarray, stopped: np.ndarray) -> None:
        """The finish reason of each row that ended this step, as OpenAI's API gives it: "stop" at a stop
        string, an eos or a complete grammar (the engine ended it short of its limit), else "length"."""
        for slot in np.nonzero(finished)[0]:
            row = rows[slot]
            count = self.counts[row]
            last = self.generated[row, count - 1]
            ended = stopped[slot] or count < self.limits[row] or last in self.options.eos
            self.reasons[row] = "stop" if ended else "length"

    def output(self) -> GenerationOutput:
        """Every row's tokens and the call's statistics, as `generate` returns them."""
        stats = self.stats
        stats.fold_rounds()
        stats.generated_tokens = int(self.counts.sum())
        stats.total_time = time.perf_counter() - self.wall
        stats.profile = None if self.laps is None else self.laps.seconds
        sequences = [self.generated[row, :self.counts[row]].tolist() for row in range(len(self.counts))]
        texts = [text.text(s, True) for text, s in zip(self.texts, sequences)] if self.texts else None
        grammars = None if self.b is None else self.b.grammar
        if grammars is None:
            return GenerationOutput(sequences, stats, texts, finish_reasons=list(self.reasons))
        stats.grammar_time = grammars.seconds
        return GenerationOutput(sequences, stats, texts, list(grammars.complete), list(self.reasons))

    # -- the pieces --------------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self) -> None:
        """Prefill the rows added so far, together: the batch the steps decode."""
        with self.runner.backend.active():
            self._start()

    def _start(self) -> None:
        runner, options, requests = self.runner, self.options, self.requests
        if not requests:
            raise UserError("an engine starts with at least one request: add one first")
        for request in requests:
            runner.check_positions(len(request.prompt), request.max_new_tokens)
        prompts = [list(r.prompt) for r in requests]
        params = [r.sampling for r in requests]
        self.policy.start(prompts)
        self.policy.sample_rows([not p.greedy for p in params])
        seed = options.seed
        if any(r.seed is not None for r in requests):
            drawn = runner.seeds(seed, len(requests), all(p.greedy for p in params))
            seed = [drawn[i] if r.seed is None else r.seed for i, r in enumerate(requests)]
        capacity = max(len(p) + r.max_new_tokens for p, r in zip(prompts, requests)) + self.k_max + 1
        self.b = runner.start(prompts, params, seed, options.settings, capacity=capacity)
        if options.grammar or any(r.constraint is not None for r in requests):
            self._open_grammars()
        self._grow(len(requests))
        self.stats.prefill_time = time.perf_counter() - self.wall
        if options.profile:
            self.laps = RoundProfile()
            self.b.lap = self.laps.lap
        self._plan_calls()

    def _plan_calls(self) -> None:
        """How many rounds a compiled call may run: one for a caller that reads every round, the
        rounds_per_step for one that steps the engine itself, a fixed k to the row's end (fewer where a
        cost gate cuts the row's drafts: `DraftPolicy.rounds_cap`), an adaptive one `ADAPT_ROUNDS` and
        more while its controller keeps its drafts (`_span`; it takes every round's counts between
        calls)."""
        options, policy = self.options, self.policy
        self.fixed = policy.fixed
        most = int(self.limits.max())
        # rounds between the controller's decisions; none for a fixed k
        every = ADAPT_ROUNDS if not self.fixed else None
        rounds = (1 if options.watched else max(1, options.rounds_per_step)
                  if options.rounds_per_step is not None else most if every is None else every)
        self.rounds_per_call = rounds if every is None else min(rounds, every)
        # calls sized by the controller alone grow while it keeps its drafts (`_span`); a caller's own size
        # (one round for a watcher, a stepped engine's rounds) stays
        self.grows = every is not None and not options.watched and options.rounds_per_step is None
        self._last_call = (None, self.rounds_per_call)  # the last compiled call's drafts and span
        self.one_call = self.runner.fuses(self.b, policy, self.rounds_per_call)

    def _grow(self, rows: int) -> None:
        """Room in the per-row arrays for `rows` more rows (the newest requests)."""
        new = self.requests[len(self.requests) - rows:]
        self.limits = np.concatenate([self.limits, [r.max_new_tokens for r in new]]).astype(np.int64)
        lengths = [len(r.prompt) for r in new]
        self.prompt_lengths = np.concatenate([self.prompt_lengths, lengths]).astype(np.int64)
        width = max(self.generated.shape[1], int(self.limits.max()))
        self.generated = np.pad(self.generated, ((0, rows), (0, width - self.generated.shape[1])))
        self.counts = np.concatenate([self.counts, np.zeros(rows, dtype=np.int64)])

    def _open_grammars(self) -> None:
        """The rows' grammars from now on (`GrammarBatch`: None for a row without a constraint), opened
        when the first row that brings one starts or joins: drafts then take the grammar's masks and
        forced tokens, and copies match on the text too (a reply spells what it copies with other tokens
        than the prompt: a value after a quote, not a space). Not without one: the compiled rounds copy
        on tokens, and every path must draft alike."""
        runner, b = self.runner, self.b
        started = len(self.requests) - len(self.joining)
        grammars = GrammarBatch(runner.grammar_tokenizer(), [r.constraint for r in self.requests[:started]])
        grammars.select_rows(b.rows)  # the running rows' slots (caller rows ascending)
        b.grammar = grammars
        self.policy.match_text(runner.token_text)

    def _drop_cancelled(self) -> None:
        """Cancelled rows leave the batch before the round (one cancelled while waiting to join has
        joined first: its prefill is the only work it costs)."""
        keep = ~np.isin(self.b.rows, list(self.cancelled))
        self.cancelled.clear()  # gone from the batch: a row never comes back
        if not keep.all():
            self.runner.keep_rows(self.b, keep)

    def _join(self) -> None:
        if self.b.grammar is None and any(r.constraint is not None for r in self.joining):
            self._open_grammars()
        joining, self.joining = self.joining, []
        first = len(self.requests) - len(joining)
        self.runner.join(self.b, joining, first, self.policy, self.options.settings, self.k_max)
        self.policy.sample_rows([not r.sampling.greedy for r in self.requests])
        self._grow(len(joining))
        self.b.lap("other")

    def _switch_for_context(self) -> None:
        """Take the settings of the last `ContextSwitch` the batch's longest context has reached: its
        drafting, and its policy, started on every row's context so far. Only while every row is greedy
        (`ContextSwitch`); not where either side drafts through an exit block (its cache layers)."""
        b = self.b
        longest = int(b.lengths.max())
        reached = [s for s in self.switches if longest >= s.from_tokens]
        if not reached or not b.sampling.all_greedy or self.policy.sampled.any():
            return
        switch = reached[-1]
        self.switches = self.switches[len(reached):]
        drafting = self.runner.drafting(switch.settings)
        if drafting.exit_block is not None or b.drafting.exit_block is not None:
            self.switches = []
            return
        policy = switch.policy
        if b.grammar is not None:
            policy.match_text(self.runner.token_text)
        policy.start([list(r.prompt) + self.generated[row, :self.counts[row]].tolist()
                      for row, r in enumerate(self.requests)])
        policy.sample_rows(self.policy.sampled)
        b.drafting, self.policy = drafting, policy
        self.stats.exit_layer = switch.settings.exit_layer
        self._plan_calls()

    def _plain(self, rows: np.ndarray) -> bool:
        """A greedy round of more rows than `draft_max_rows` drafts nothing (a plain step)."""
        most = self.options.draft_max_rows
        return most is not None and len(rows) > most and self.b.sampling.all_greedy

    def _fused_rounds(self, rows: np.ndarray):
        """A lone row's rounds in one compiled call (`Runner.fused_rounds`), or None. A sampled row's only
        where every round drafts alike (a fixed k, no copies): its drafts, and so its draws, are then those
        of the rounds from Python, which adapt k and copy lengths between rounds, not between calls."""
        b = self.b
        alike = b.sampling.all_greedy or self.fixed
        if not (self.one_call and len(rows) == 1 and alike and b.grammar is None):
            return None
        runner, row = self.runner, int(rows[0])
        drafts = self.policy.fused_drafts(row)
        if self._plain(rows):  # draft_max_rows = 0: plain steps, in the same compiled call
            drafts = FusedDrafts(k=0)
        remaining = int(self.limits[row] - self.counts[row])
        reach = drafts.k + drafts.copy_length  # the most drafts a round verifies
        # a row's first round alone: its first token reaches the caller without delay; no more than a cost
        # gate lets run between its decisions (`DraftPolicy.rounds_cap`)
        watched = self.options.rounds_per_step is not None
        key, span = self._span(row, drafts)
        cap = self.policy.rounds_cap(rows)
        most = 1 if watched and not self.counts[row] else span if cap is None else min(span, cap)
        ahead = self.switches[0].from_tokens - int(b.lengths[0]) if self.switches else remaining
        if 0 < ahead < remaining:  # stop short of the next switch: a round emits at most reach + 1 tokens
            most = min(most, max(1, ahead // (reach + 1)))
        limit = runner.view.max_positions
        if limit is not None and int(b.lengths[0]) + remaining + reach >= limit:
            return None
        fused = runner.fused_rounds(b, drafts, self.options.eos, remaining, most, self.stats, self.policy,
                                   self.laps)
        if fused is None:  # the kernels declined: rounds from Python from now on
            self.one_call = False
        else:
            self._last_call = (key, span)
        return fused

    def _span(self, row: int, drafts: FusedDrafts) -> tuple[tuple, int]:
        """(what the call drafts, the rounds it may run): `rounds_per_call`; under an adaptive k or copy
        length (`ADAPT_ROUNDS` rounds a call), twice the last call's span, up to `ADAPT_MOST`, when the
        last call ran for the same row with the same drafts, and `ADAPT_ROUNDS` again once they change: a
        call costs its setup around the rounds, and a controller that changes nothing needs no chance
        to. A call a gate cuts shorter (`DraftPolicy.rounds_cap`) keeps the span for the next."""
        key = (row, drafts.k, drafts.copy_length)
        if not self.grows:
            return key, self.rounds_per_call
        last, span = self._last_call
        return key, min(2 * span, ADAPT_MOST) if key == last else self.rounds_per_call

    def _round(self, rows: np.ndarray):
        """One round from Python: draft, verify, accept; (tokens, emit, finished, `RoundCounts`)."""
        runner, policy, b, stats = self.runner, self.policy, self.b, self.stats
        self._last_call = (None, self.rounds_per_call)  # a compiled call after it starts its span again
        plan = policy.plan(rows)
        k_max = policy.k_max + (FORCED_PER_ROUND if b.forces else 0)
        if runner.backend.max_pass_positions is not None:  # a round's k + 1 positions in one pass
            k_max = min(k_max, runner.backend.max_pass_positions - 1)
        limit = runner.view.max_positions
        if limit is not None:  # no draft beyond the last position the model has (GPT-2's table)
            k_max = min(k_max, limit - 1 - int(b.lengths.max()))
        if self._plain(rows):
            k_max = 0  # a plain step: see draft_max_rows
        plan = plan.truncate(k_max)
        b.lap("policy")
        decided, (start, drafted, verified), draft = runner.round(b, plan, policy, self.clock, k_max)
        stats.stopped_below_eta += draft.stopped
        host = decided.cpu().numpy()  # the round's one host sync
        tokens, accepted = host[:, :-1], host[:, -1]
        b.lap("acceptance")
        clock = self.clock
        draft_time, verify_time = clock.seconds(start, drafted), clock.seconds(drafted, verified)
        if not draft.segments:  # a plain step, also one whose E blocks ran before η stopped the draft
            draft_time, verify_time = 0.0, draft_time + verify_time
        runner.record(stats, draft.segments, accepted, draft_time, verify_time, draft.parts)
        b.lap("statistics")
        policy.update(draft.segments, accepted, draft_time, verify_time)
        b.lap("policy")
        emit, finished = runner.emit_counts(tokens, accepted, self.counts[rows], self.limits[rows],
                                          self.options.eos)
        done = RoundCounts(np.ones(len(rows), dtype=np.int64),
                           np.full(len(rows), tokens.shape[1] - 1, dtype=np.int64), accepted)
        if b.grammar is not None:  # the matchers take what their rows emitted
            b.lap("other")
            emit, finished = b.grammar.commit(tokens, emit, finished)
            b.lap("grammar")
        return tokens, emit, finished, done


__all__ = ["ADAPT_ROUNDS", "FORCED_PER_ROUND", "CallOptions", "ContextSwitch", "Engine"]
