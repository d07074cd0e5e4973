"""One decode loop for every request: jobs wait in a bounded queue and decode together, joining the
batch at round boundaries (continuous batching).

A wave is one engine (`SelfSpecGenerator.engine`: greedy rows at the checkpoint's settings, sampled rows
at its sampled pick, in lanes of their own) that this loop steps: it starts with the waiting jobs, as many
as `max_batch` whose prompts and token limits fit the model's positions together, whatever each asks
(every request brings its own sampling settings, seed and JSON schema or none: `NewRow`). Before every
step jobs that arrived since join it, prefilled apart, up to `max_batch` running rows. Rows accept
different numbers of drafts each round, and a row's tokens do not depend on the other rows nor on when
it joined (greedy; sampled rows each draw from their own seed where their rounds depend on them alone:
the early exit at a fixed k, as the sampled picks draft, whatever greedy rows share the wave). After every
step each job takes its row's new tokens (`RoundOutput`), streams the text the engine says it can
already show (`Engine.text`), and when it is done (the engine ended its row: its own `max_tokens`, an
eos, a stop string; or a client that went away, whose row is cancelled) its row leaves before the next
round. The wave ends when no row runs and no job can join; the next waiting job starts the next.

A row that fails its wave fails only itself: when a step raises, the wave's unfinished jobs decode
again in two halves without it being known which row failed (`Scheduler._isolate`), until a job that
fails alone gets the error (a 500 that names its request id, the traceback in the log; a 400 with the
message when the request itself caused it, a grammar past the grammar engine's limits). The others
get what they would have got: a greedy row's tokens do not depend on its batch, a sampled row keeps its
seed, and a stream's text already sent is not sent again.

Jobs are created and awaited on the server's event loop; the loop runs on its own thread and hands
each job its events through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..decoding import Constraint, NewRow, RoundOutput, SamplingParams
from ..decoding.engine import ADAPT_ROUNDS
from ..errors import UserError

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds `max_queue` jobs: the caller answers 429."""


INT64 = (-2**63, 2**63 - 1)
GREEDY_BELOW = 1e-5  # a temperature under this decodes greedily (as vLLM's does): logits divided by a
#                      much smaller one overflow float32


def internal_error_message(request_id: str) -> str:
    """What a client is told of a failure inside the server: nothing of the exception, only where the
    log has it."""
    return (f"the server had an error while processing your request (request id {request_id}); its log has "
            "the details")


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


class _Outbox:
    """Events from the decode thread to one event loop, delivered together: a round ends many jobs'
    events at once, and each `call_soon_threadsafe` writes to the loop's self-pipe and wakes its thread,
    which then contends with the decode thread for the interpreter. Only the first event sent while
    the loop has not yet run the last delivery wakes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.items = loop, threading.Lock(), []

    def put(self, events: asyncio.Queue, event: tuple) -> None:
        with self.lock:
            wake = not self.items
            self.items.append((events, event))
        if wake:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for events, event in items:
            events.put_nowait(event)


_outboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its _Outbox
_outboxes_lock = threading.Lock()


def _outbox(loop: asyncio.AbstractEventLoop) -> _Outbox:
    with _outboxes_lock:
        if loop not in _outboxes:
            _outboxes[loop] = _Outbox(loop)
        return _outboxes[loop]


@dataclass
class Job:
    """One request's decode: its inputs, and the state the decode thread writes (`take`, `end`)."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    schema: dict | None = None  # the JSON schema the output follows, or None
    request_id: str = field(default_factory=new_request_id)  # in the log and in a failure's message
    draw: int = field(default_factory=lambda: secrets.randbits(31))  # the seed when `seed` is None:
    #                                                                  drawn once, so a retry repeats it
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None  # ("text", str), then ("done", reason) or ("error", message, status)
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the output's text (ending before a stop string), as far as it was shown
    sent: int = 0  # characters of `text` already sent as events
    shown_at: float = 0.0  # when text was last sent
    finish_reason: str | None = None  # "stop" or "length" once done
    cancelled: bool = False  # set by the server when the client goes away
    rounds: int = 0  # rounds (one full-model pass each) this row took part in
    drafted: int = 0  # drafts verified for this row, and how many were accepted
    accepted: int = 0
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None

    def check(self, limit: int | None = None, vocab: int | None = None) -> None:
        """A ValueError when this job could fail a wave by its values (the server refuses such requests
        before they become jobs; this guards the scheduler's other callers): `limit` the positions a
        row may use, `vocab` the model's token ids."""
        if not self.prompt or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                      for t in self.prompt):
            raise ValueError("a job's prompt is one or more token ids")
        if vocab is not None and not 0 <= min(self.prompt) <= max(self.prompt) < vocab:
            raise ValueError(f"a job's prompt holds token ids outside the model's {vocab}")
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be 1 or more, got {self.max_tokens!r}")
        if limit is not None and len(self.prompt) + self.max_tokens > limit:
            raise ValueError(f"the prompt's {len(self.prompt)} tokens plus max_tokens = {self.max_tokens} "
                             f"exceed the model's {limit} positions")
        if self.seed is not None and (type(self.seed) is not int or not INT64[0] <= self.seed <= INT64[1]):
            raise ValueError(f"seed must be an int64, got {self.seed!r}")
        if not (0 <= self.temperature < float("inf")) or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"bad sampling parameters: temperature {self.temperature}, top_k {self.top_k}, "
                             f"top_p {self.top_p}")

    @property
    def sampling(self) -> SamplingParams:
        """The sampling parameters as the engine takes them (greedy: one setting)."""
        if self.temperature < GREEDY_BELOW:
            return SamplingParams()
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def row(self) -> NewRow:
        """This job as a request to the wave's engine (`Engine.add`): its prompt, limit, seed, schema,
        sampling settings and stop strings, its own whatever its batch-mates ask."""
        return NewRow(self.prompt, self.max_tokens, self.draw if self.seed is None else self.seed,
                      None if self.schema is None else Constraint.of(json_schema=self.schema),
                      sampling=self.sampling, stop_strings=tuple(self.stops))

    def _send(self, *event) -> None:
        if self.loop is not None:
            _outbox(self.loop).put(self.events, event)

    def take(self, out: RoundOutput, text: Callable[[], str]) -> bool:
        """The row's latest step (decode thread): its `RoundOutput` (the new tokens, the rounds, drafts and
        acceptances behind them, why the row finished if it did: the engine cuts a row at its limit, an
        eos, a complete grammar or a stop string) and `text`, which gives the row's text so far
        (`Engine.text`: ending before a stop string; while the row runs, only what later tokens cannot
        change). True when the row is done. The text goes out at once when it starts, then at most every
        `STREAM_SECONDS` until the row ends (see there)."""
        if self.finish_reason is not None:
            return True
        if self.cancelled:
            return self.end("cancelled")
        now = time.perf_counter()
        if self.first_token is None and out.tokens:
            self.first_token = now
        self.rounds += out.rounds
        self.drafted += out.drafted
        self.accepted += out.accepted
        self.tokens += out.tokens
        if not out.finished and self.sent and now - self.shown_at < STREAM_SECONDS:
            return False  # not due: the text is decoded only when it goes out
        self.text = text()
        if out.finished:
            return self.end(out.finish_reason)
        if len(self.text) > self.sent:
            self._send("text", self.text[self.sent:])
            self.sent, self.shown_at = len(self.text), now
        return False

    def end(self, reason: str) -> bool:
        """End the row for `reason` ("stop", "length", "cancelled"); the client gets the rest of the
        text and the reason unless it left. Returns True (the row is done)."""
        self.finish_reason, self.finished = reason, time.perf_counter()
        if reason != "cancelled":
            if len(self.text) > self.sent:
                self._send("text", self.text[self.sent:])
                self.sent = len(self.text)
            self._send("done", reason)
        return True

    def fail(self, message: str | None = None, status: int = 500) -> None:
        """End the job with an error event: `message`, or the generic one that names the request id, and
        the HTTP status it answers with (a 400 for what the request itself asked, e.g. a grammar)."""
        self.finish_reason, self.finished = "error", time.perf_counter()
        self._send("error", message or internal_error_message(self.request_id), status)

    def restart(self) -> bool:
        """Make the job ready to decode again from its prompt (its wave failed, maybe for another row).
        False when it cannot be resumed exactly: a sampled row that has streamed text (its retry draws
        the same numbers, but a batch of other rows may place its rounds elsewhere, and so its tokens).
        A greedy row's tokens are the same in any batch: the text already sent is not sent again."""
        if not self.sampling.greedy and self.sent:
            return False
        self.tokens, self.rounds, self.drafted, self.accepted = [], 0, 0, 0
        return True

    def stats(self, drafter: str) -> dict:
        """The `selfspec` field of a response: this row's acceptance and tokens per full pass."""
        return {"drafter": drafter, "tokens_per_pass": len(self.tokens) / max(1, self.rounds),
                "alpha": self.accepted / self.drafted if self.drafted else None}


# Greedy rounds of more rows than this take plain steps on a CPU (`Scheduler`'s draft_max_rows): there
# a pass costs about in proportion to its positions past a few (SmolLM2's bound by the FMAs from about
# 8; the embedded default's kernels spend several times one row's pass on 8), so a rejected draft costs
# what a kept token does: from 3 rows on, plain steps decode faster (docs/performance.md, "A batch of rows
# on a CPU").
# A GPU's pass stays bound by reading the weights to far more positions: none (every round drafts).
CPU_DRAFT_MAX_ROWS = 2


def default_draft_max_rows(generator) -> int | None:
    """The server's draft_max_rows for `generator`'s device when none is given."""
    return CPU_DRAFT_MAX_ROWS if generator.view.device.type == "cpu" else None


# A streamed row's text goes out at most this often after its first: each chunk costs the server's
# event loop and the client their own work (an event, a JSON line, a write, a read), on CPUs the
# decoding needs; a batch's rounds come every few ms, and a chunk per row per round costs many clients a
# large share of their throughput on a small CPU (docs/performance.md, "Figures behind the code's
# choices"). 50 updates a second still read as a continuous stream.
STREAM_SECONDS = 0.02
CALL_SECONDS = 0.04  # a lone row's compiled call when the scheduler sizes it (`Scheduler.call_rounds`)
MAX_CALL_ROUNDS = 256
# How long the queue stays empty before the memory freed since the last wave or grammar goes back to the
# kernel: not between two waves of a busy server, where the next wave would fault the pages in again.
IDLE_RELEASE_SECONDS = 0.5


class Scheduler:
    """The decode loop (a daemon thread) over a `SelfSpecGenerator`; `submit` queues a job.

    max_batch: rows per wave; max_queue: jobs waiting at most (beyond: `QueueFull`); rounds_per_call: the
    rounds a lone row decodes in one compiled call between two looks at the queue (a step's rounds,
    `SelfSpecGenerator.engine`'s `rounds_per_step`), or None: about `CALL_SECONDS` of rounds
    (`call_rounds`); draft_max_rows: greedy rounds of more rows than this take plain steps (`generate`'s;
    None: every round drafts); on_wave:
    called with each finished wave's jobs and `GenerationStats` (the server's metrics)."""

    def __init__(self, generator, max_batch: int = 8, max_queue: int = 64,
                 rounds_per_call: int | None = None, draft_max_rows: int | None = None, on_wave=None):
        self.generator, self.on_wave = generator, on_wave
        self.max_batch, self.max_queue, self.rounds_per_call = max_batch, max_queue, rounds_per_call
        self.draft_max_rows = draft_max_rows
        self.round_seconds: float | None = None  # a lone row's round, call to call, as measured
        self.queue: deque[Job] = deque()
        self.ready = threading.Condition()
        self.closing = False
        self.thread: threading.Thread | None = None
        self.limit = generator.view.max_positions
        self.vocab = getattr(generator.view, "vocab_size", None)
        self.largest_wave = 0
        self.failed_rows = 0  # jobs that failed (alone, after their wave was split)
        self.retried_waves = 0  # waves that failed and were decoded again in parts
        self.active: list[Job] = []  # the wave being decoded
        self.cancelled_rows = 0  # requests whose client went away (or shutdown ended them), queued or not
        self.joined = 0  # jobs that joined a wave already decoding
        self.freed = False  # memory was freed (a wave, a grammar compiled) since the last release
        self.releases = 0  # idle releases of memory (`_release_when_idle`)

    def start(self) -> None:
        # in a copy of the starter's context: it decodes with the kernel settings in force here
        # (`model.kernels.using`, `fast.kernels_up_to`), not a new thread's defaults
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,),
                                       name="selfspec-decode", daemon=True)
        self.thread.start()

    def stop(self, grace: float = 30.0) -> None:
        """Take no more jobs, let the wave in flight finish for up to `grace` seconds, then end its
        rows at the next round; waiting jobs end at once (their clients get an error)."""
        with self.ready:
            self.closing = True
            waiting, self.queue = list(self.queue), deque()
            self.ready.notify()
        for job in waiting:
            job.fail("the server is shutting down")
        if self.thread is None:
            return
        self.thread.join(timeout=grace)
        for job in list(self.active):
            job.cancelled = True
        self.thread.join(timeout=60)

    def submit(self, job: Job) -> None:
        """Queue `job`: a ValueError when its values could fail a wave (`Job.check`), `QueueFull` when
        the queue is full or the scheduler stops."""
        job.check(self.limit, self.vocab)
        with self.ready:
            if self.closing or len(self.queue) >= self.max_queue:
                raise QueueFull
            self.queue.append(job)
            self.ready.notify()

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def call_rounds(self) -> int:
        """The rounds a lone row decodes per compiled call: `rounds_per_call` when set, else about
        `CALL_SECONDS` of them at the measured pace of a lone row's rounds (ADAPT_ROUNDS until one was
        measured). Why: every call costs its own (the Python between calls, the first round's draft
        that overlapped rounds could not make ahead), dear for a model with cheap rounds, while a model
        with dear rounds loses little by short calls and would hold a request that arrives for the whole
        of a long one (figures: docs/performance.md, "The fused loop against Python rounds"). A request
        that arrives joins, and a stream gets its text, within about a call. A call's length changes no
        token (greedy rows only decode several rounds a call)."""
        if self.rounds_per_call is not None:
            return self.rounds_per_call
        if self.round_seconds is None:
            return ADAPT_ROUNDS
        return int(min(MAX_CALL_ROUNDS, max(1, CALL_SECONDS // self.round_seconds)))

    def _pace(self, seconds: float, rounds: int) -> None:
        """A lone row's `rounds` took `seconds` from the call before to this one's end: the running
        estimate of a round's time."""
        per_round = seconds / max(1, rounds)
        old = self.round_seconds
        self.round_seconds = per_round if old is None else 0.7 * old + 0.3 * per_round

    def _next_wave(self) -> list[Job] | None:
        """The oldest waiting jobs that fit the model's positions together (None when closing)."""
        with self.ready:
            while not self.queue and not self.closing:
                if not self.freed:
                    self.ready.wait()
                elif not self.ready.wait(IDLE_RELEASE_SECONDS) and not self.queue and not self.closing:
                    self._release_when_idle()
            if self.closing:
                return None
            wave = []
            for job in list(self.queue):
                fits = self.limit is None or (max(len(j.prompt) for j in [*wave, job])
                                              + max(j.max_tokens for j in [*wave, job]) <= self.limit)
                joins = len(wave) < self.max_batch and fits
                if job.cancelled:
                    self._drop(job)
                elif joins:
                    wave.append(job)
                    self.queue.remove(job)
            return wave

    def memory_freed(self) -> None:
        """Note that memory was freed off the decoding thread (a request's grammar compiled, or refused,
        on the worker pool): the scheduler releases it once it has been idle `IDLE_RELEASE_SECONDS`."""
        with self.ready:
            self.freed = True
            self.ready.notify()

    def _release_when_idle(self) -> None:
        """Idle for `IDLE_RELEASE_SECONDS` (the lock held): the kept compiled grammars and the freed
        memory of the last waves (a huge grammar's matchers, say) go back to the kernel, which
        `cpu.keep_freed_memory` would keep for the process's next peak; the lock is let go meanwhile, so
        that requests are taken as it runs."""
        self.freed = False
        self.ready.release()
        try:
            self.generator.release_memory()
        finally:
            self.ready.acquire()
        self.releases += 1

    def _drop(self, job: Job) -> None:
        """A waiting job whose client went away leaves the queue (the lock held)."""
        self.queue.remove(job)
        job.end("cancelled")
        self.cancelled_rows += 1

    def _loop(self) -> None:
        while (wave := self._next_wave()) is not None:
            if wave:
                try:
                    self._decode(wave)
                except Exception:  # noqa: BLE001 - a bug outside the engine: its jobs fail, the loop goes on
                    logger.exception("the decode loop failed on requests %s", _ids(wave))
                    for job in wave:
                        if job.finish_reason is None:
                            job.fail()
                self.freed = True

    def _decode(self, wave: list[Job], admitting: bool = True) -> None:
        """Decode `wave` on one engine (`decoding.Lanes`), stepped here: waiting jobs join it at round
        boundaries while `admitting`, a job whose client went away is cancelled; when a step fails,
        `_isolate` finds the failing row."""
        self.largest_wave = max(self.largest_wave, len(wave))
        self.active = wave
        failure, out = None, None
        try:
            engine = self.generator.engine(rounds_per_step=self.call_rounds(),
                                           draft_max_rows=self.draft_max_rows)
            jobs = {engine.add(job.row()): job for job in wave}  # the engine's row -> its job
            last = None  # when the previous step returned, while one row decodes alone
            while True:
                if admitting:
                    for job in self._admitted(wave):
                        jobs[engine.add(job.row())] = job
                if engine.done:
                    break
                outputs = engine.step()
                if len(outputs) == 1 and last is not None:
                    self._pace(time.perf_counter() - last, outputs[0].rounds)
                for o in outputs:
                    ended = jobs[o.row].take(o, lambda row=o.row: engine.text(row))
                    if ended and not o.finished:  # its client left
                        engine.cancel(o.row)
                last = time.perf_counter() if len(outputs) == 1 else None
            out = engine.output()
        except Exception as exc:  # noqa: BLE001 - the failing row's client gets an error, the others theirs
            failure = exc
        finally:
            self.active = []
        if failure is not None:
            # the failed engine goes now, and its cache buffers back to the generator's pool for the
            # halves' engines: the traceback's frames hold it (their locals), the log keeps their lines
            engine = None
            traceback.clear_frames(failure.__traceback__)
            self._isolate(wave, failure)
            return
        self.cancelled_rows += sum(job.finish_reason == "cancelled" for job in wave)
        for job in wave:  # a row the engine never reported (cancelled before its first round)
            if job.finish_reason is None:
                job.end("length" if len(job.tokens) >= job.max_tokens else "stop")
        if self.on_wave is not None:
            self.on_wave(wave, out.stats)

    def _admitted(self, wave: list[Job]) -> list[Job]:
        """The waiting jobs that join the wave now (appended to it), oldest first, while fewer than
        max_batch rows run: up to the first that does not fit the model's positions (it starts the next
        wave: nothing overtakes it for long)."""
        running = sum(job.finish_reason is None for job in wave)
        joining = []
        with self.ready:
            for job in list(self.queue):
                if job.cancelled:
                    self._drop(job)
                    continue
                if (running + len(joining) >= self.max_batch or self.closing
                        or (self.limit is not None and len(job.prompt) + job.max_tokens > self.limit)):
                    break
                self.queue.remove(job)
                joining.append(job)
        wave.extend(joining)
        self.joined += len(joining)
        self.largest_wave = max(self.largest_wave, running + len(joining))
        return joining

    def _isolate(self, wave: list[Job], failure: Exception) -> None:
        """`wave`'s engine raised `failure`. Its jobs already answered keep their answers; a job whose
        client left ends cancelled; the rest decode again, in two halves (none joins them), and so on
        down to the job that fails alone: that one gets the error. Jobs that cannot be resumed exactly
        (`Job.restart`) fail too. Every split is logged with the request ids; the row that fails alone
        with its traceback."""
        left = []
        self.cancelled_rows += sum(job.finish_reason == "cancelled" for job in wave)  # left before it failed
        for job in wave:
            if job.finish_reason is not None:
                continue
            if job.cancelled:
                job.end("cancelled")
                self.cancelled_rows += 1
            else:
                left.append(job)
        if len(left) == 1:
            if isinstance(failure, UserError):  # the request's own doing (a grammar no token can follow)
                logger.warning("request %s refused while decoding: %s", left[0].request_id, failure)
                self.failed_rows += 1
                left[0].fail(" ".join(str(failure).split())[:1000], status=400)
                return
            logger.error("request %s failed while decoding", left[0].request_id, exc_info=failure)
            self._fail(left[0])
            return
        if not left:
            logger.error("a wave of requests %s failed after they ended", _ids(wave), exc_info=failure)
            return
        self.retried_waves += 1
        logger.warning("a wave of %d requests (%s) failed; decoding them again in halves to find the failing "
                       "one", len(left), _ids(left), exc_info=failure)
        resumable = []
        for job in left:
            if job.restart():
                resumable.append(job)
            else:
                logger.error("request %s cannot be resumed after its wave failed (a sampled stream)",
                             job.request_id)
                self._fail(job)
        half = (len(resumable) + 1) // 2
        for part in (resumable[:half], resumable[half:]):
            if part and not self.closing:
                self._decode(part, admitting=False)
            for job in part:
                if job.finish_reason is None:  # the server stopped before the part could decode
                    job.fail("the server is shutting down")

    def _fail(self, job: Job) -> None:
        self.failed_rows += 1
        job.fail()


def _ids(jobs: list[Job]) -> str:
    return ", ".join(job.request_id for job in jobs)
