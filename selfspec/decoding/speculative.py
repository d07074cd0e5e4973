"""`SelfSpecGenerator`: self-speculative decoding with a shared KV cache, lossless, any batch size.

The draft model is the model's own first E blocks + its final norm + LM head. One round:

1. draft k tokens, one at a time, through blocks [0, E), keeping each step's exit hidden state;
2. verify: run the last draft through blocks [0, E), then blocks [E, N) once on the k + 1 kept
   hidden states. Blocks [0, E) wrote their KV cache while drafting and are never run again on
   those tokens;
3. accept the longest prefix the target agrees with (`sampling.accept_greedy`/`accept_sampled`),
   emit it plus the target's own next token, and roll every layer's cache back to what was kept.

The output is exactly the full model's (greedy: token for token; sampling: in distribution), and
k = 0 runs the very same code as plain decoding: one full forward per token on the same cache.

State between rounds, per row: the cache holds n positions (the prompt and the tokens emitted so
far, except the last), and the last emitted token is *pending* at position n. A round writes the
pending token and the drafts at positions n .. n + k and keeps n + (tokens emitted) of them. The
prefill runs every prompt token but the last, which is the first round's pending token, so the
very first generated token is already drafted and verified.

Batches run in lockstep rounds with one k; each row has its own positions, accepted length and
cache length (`cache.KVCache`), and a finished row leaves the batch at the end of its round. The
host reads the device once per round (the round's tokens and accepted counts); everything else the
loop needs (positions, kv_length, cache lengths) is known on the host already.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..metrics import AcceptanceStats
from ..model import DecoderView
from . import sampling
from .cache import KVCache
from .draft_head import DraftHead
from .ngram import NGramConfig
from .policy import DraftPlan, DraftPolicy, Segment, make_policy
from .sampling import ACCEPT, DRAFT, TARGET, SamplingParams, accept_greedy, accept_sampled, sample, uniforms


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
    draft_time: float = 0.0
    verify_time: float = 0.0
    plain_time: float = 0.0
    prefill_time: float = 0.0
    total_time: float = 0.0
    generated_tokens: int = 0
    # Where the drafts came from: copied from the context vs drafted by the early exit. Each run of
    # a round's positions from one source (a `Segment`) counts under its source, in the rows whose
    # verifier tested it (every earlier draft accepted).
    copy: AcceptanceStats = field(default_factory=AcceptanceStats)
    early_exit: AcceptanceStats = field(default_factory=AcceptanceStats)

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
            "exit_layer", "num_layers", "draft_steps", "plain_steps", "draft_time", "verify_time",
            "plain_time", "prefill_time", "total_time", "generated_tokens")}
        return {**super().as_dict(), **times, "draft_cost": self.draft_cost,
                "tokens_per_second": self.tokens_per_second,
                "by_source": {"copy": self.copy.as_dict(), "early_exit": self.early_exit.as_dict()}}


@dataclass
class GenerationOutput:
    sequences: list  # generated token ids per row, prompt excluded, an eos included
    stats: GenerationStats
    texts: list | None = None  # decoded `sequences` when the generator has a tokenizer


@dataclass
class _Batch:
    """Decoding state of the rows still running (see the module docstring); B shrinks as rows finish.

    The host arrays are the truth; the device copies are refreshed once per round (`_upload`).
    """

    cache: KVCache
    sampling: SamplingParams
    steps: torch.Tensor  # arange(capacity) on the device, to build positions
    rows: np.ndarray  # (B,) the caller's row index of each batch slot
    lengths: np.ndarray  # (B,) positions the cache holds = position of the pending token
    pending_host: np.ndarray  # (B,) the last emitted token, not yet run through the model
    seeds_host: np.ndarray  # (B,) per-row random streams
    lengths_dev: torch.Tensor = None  # (B,) device copies of the three arrays above
    pending: torch.Tensor = None
    seeds: torch.Tensor = None

    def upload(self, device) -> None:
        both = torch.from_numpy(np.stack([self.lengths, self.pending_host, self.seeds_host])).to(device)
        self.lengths_dev, self.pending, self.seeds = both[0], both[1], both[2]


class _Clock:
    """Timestamps without host syncs: CUDA events on CUDA (read after the round's sync), else perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class _RowOrderStream:
    """Feeds a Hugging Face-style streamer (`put`, `end`) with a batch's tokens, one row after another.

    Hugging Face's streamers take one sequence; a batch's rows would interleave. Row 0 streams live;
    a later row's tokens are buffered until every row before it has finished, then flushed.
    """

    def __init__(self, streamer, prompts: list[list[int]]):
        self.streamer = streamer
        self.buffers: list[list[int]] = [[] for _ in prompts]
        self.done = np.zeros(len(prompts), dtype=bool)
        self.current = 0  # the row that streams live
        streamer.put(torch.tensor(prompts[0]))

    def feed(self, rows: np.ndarray, tokens: np.ndarray, emit: np.ndarray, finished: np.ndarray) -> None:
        """This round's emitted tokens: `tokens[slot, :emit[slot]]` for the row `rows[slot]`."""
        for slot, row in enumerate(rows):
            self.buffers[row] += tokens[slot, :emit[slot]].tolist()
            self.done[row] |= finished[slot]
        while self.current < len(self.done):
            if self.buffers[self.current]:
                self.streamer.put(torch.tensor(self.buffers[self.current]))
                self.buffers[self.current] = []
            if not self.done[self.current]:
                break
            self.current += 1

    def end(self) -> None:
        self.streamer.end()


class SelfSpecGenerator:
    """Self-speculative decoding over a Hugging Face causal LM (llama, mistral, qwen2, qwen3, gpt2).

    model: the (tuned) causal LM, in eval mode; tokenizer: optional, needed for string prompts and
        stop strings; exit_layer: E, the number of blocks the draft runs (1..N; E = N drafts with the
        whole model, every draft is accepted, useful as a check); num_speculations: the default k
        of the early-exit drafts (int, "auto" or "window", see `controller.make_controller`);
        drafter: the default drafter, "early_exit", "ngram" (copies from the context) or "hybrid"
        (copies when the context has a match, the early exit otherwise; see `policy.py`); ngram:
        the copy settings (`NGramConfig`); draft_vocab: token ids the early-exit draft may propose
        (its head restricted to them, see `draft_head.py`), None for the whole vocabulary;
        check_cache: assert after every round that each layer's cache length equals the sequence
        length; exit_adapter: an `ExitAdapter` trained for this E, applied to the exit's hidden states
        before the draft head (verification never reads it).
    """

    def __init__(self, model, tokenizer=None, *, exit_layer: int, num_speculations="auto",
                 drafter: str = "early_exit", ngram: NGramConfig | None = None, draft_vocab=None,
                 check_cache: bool = True, exit_adapter=None):
        self.view = DecoderView(model)
        self.tokenizer = tokenizer
        if not isinstance(exit_layer, int) or not 1 <= exit_layer <= self.view.num_layers:
            raise ValueError(f"exit_layer must be an int in 1..{self.view.num_layers} (the number of "
                             f"blocks the draft runs), got {exit_layer!r}")
        self.exit_layer = exit_layer
        make_policy(drafter, num_speculations, ngram)  # validate early
        self.num_speculations = num_speculations
        self.drafter = drafter
        self.ngram = ngram or NGramConfig()
        self.draft_head = DraftHead(self.view, draft_vocab, exit_adapter)
        self.check_cache = check_cache

    @property
    def model(self):
        return self.view.model

    # -- the round -----------------------------------------------------------------------------------
    def _place(self, b: _Batch, offset: int, length: int) -> dict:
        """Positions n + offset .. n + offset + length - 1 of every row (B, T), announced to the cache:
        the cache/position arguments of `DecoderView.run_layers`."""
        positions = b.lengths_dev[:, None] + b.steps[offset:offset + length]
        kv_length = b.cache.set_positions(positions, b.lengths + offset)
        return {"cache": b.cache, "positions": positions, "kv_length": kv_length, "aligned": b.cache.aligned}

    def _draft_step(self, b: _Batch, token: torch.Tensor, offset: int, end: int):
        """Token (B,) at position n + offset through blocks [0, end): hidden state (B, 1, D)."""
        place = self._place(b, offset, 1)
        hidden = self.view.embed(token[:, None], place["positions"])
        return self.view.run_layers(hidden, 0, end, **place)

    def _pick(self, b: _Batch, logits: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Draft token (B,) from draft logits (B, V) for the token at `position` (B, 1)."""
        if b.sampling.greedy:
            return logits.argmax(-1)
        return sample(b.sampling.probs(logits), uniforms(b.seeds, position, DRAFT)[:, 0])

    def _round(self, b: _Batch, plan: DraftPlan, policy: DraftPolicy, clock: _Clock, cap: int):
        """One round for every row: draft, verify all drafts in one pass, accept a prefix.

        The draft: `plan.copied` (B, m) copied tokens, then up to `plan.extend` early-exit drafts,
        cut short when the policy turns the rest of the round into a copy (`policy.copy_after`); at
        most `cap` drafts in all. Returns tokens (B, k+1), accepted (B,), three timestamps and the
        draft's `Segment`s. A row emits tokens[:accepted + 1]: its accepted drafts, then the
        target's own token (the correction after a rejection, the bonus after a full acceptance).
        k = 0 is one plain decoding step.
        """
        view, exit_layer, num_layers = self.view, self.exit_layer, self.view.num_layers
        m, extend = plan.num_copied, plan.extend
        start = clock.mark()
        # Tokens that have no exit hidden state yet (the pending token, copied drafts) go through
        # the blocks in parallel passes; early-exit drafts keep the hidden state of their own step.
        first = b.pending[:, None]  # (B, 1)
        copied = first[:, 1:]  # (B, 0)
        if m:
            copied = torch.as_tensor(plan.copied, device=first.device)  # (B, m)
            first = torch.cat([first, copied], 1)  # (B, m+1)
        place = self._place(b, 0, m + 1)
        hidden = view.embed(first, place["positions"])  # (B, m+1, D)
        segments = [Segment("copy", 0, m)] if m else []
        drafts, q = [copied], [("copy", copied)]  # in draft order; q: how each part was drafted
        if not extend:  # plain decoding (m = 0) or a pure copy: all blocks at once, nothing to draft
            hidden = view.run_layers(hidden, 0, num_layers, **place)
            drafted = start
            k = m
        else:
            # 1. Draft: the early exit proposes tokens one at a time through blocks [0, E) + final
            #    norm + draft head, each step keeping its exit hidden state (B, 1, D).
            hiddens = [view.run_layers(hidden, 0, exit_layer, **place)]
            k = m  # drafts so far; the last one's hidden state is hiddens[-1][:, -1]
            early = []
            for i in range(extend):
                logits = self.draft_head.logits(hiddens[-1][:, -1])  # (B, V)
                token = self._pick(b, logits, b.lengths_dev[:, None] + (k + 1))  # the token at n + k + 1
                early.append(token)
                q.append(("early_exit", logits))
                suffix = None
                if policy.copies_after_early_exit and k + 1 < cap:
                    # the policy reads the drafts on the host: one small device read per draft step,
                    # only for drafters that copy
                    suffix = policy.copy_after(b.rows, torch.stack(early, 1).cpu().numpy())[:, :cap - k - 1]
                if i == extend - 1 or (suffix is not None and suffix.size):
                    drafted = clock.mark()
                if suffix is not None and suffix.size:  # the rest of the round is a copy
                    suffix = torch.as_tensor(suffix, device=token.device)  # (B, r)
                    drafts.append(torch.stack(early, 1))
                    segments.append(Segment("early_exit", m, len(early)))
                    segments.append(Segment("copy", k + 1, suffix.shape[1]))
                    drafts.append(suffix)
                    q.append(("copy", suffix))
                    # the last early-exit draft and the copy through blocks [0, E) in one pass
                    block = torch.cat([token[:, None], suffix], 1)  # (B, r+1)
                    place = self._place(b, k + 1, block.shape[1])
                    hiddens.append(view.run_layers(view.embed(block, place["positions"]), 0, exit_layer, **place))
                    k += block.shape[1]
                    break
                # the new draft through blocks [0, E): the next draft step's input, or, after the
                # last draft, the first part of the verification
                hiddens.append(self._draft_step(b, token, k + 1, exit_layer))
                k += 1
            else:
                drafts.append(torch.stack(early, 1))
                segments.append(Segment("early_exit", m, len(early)))
            # 2. Verify: blocks [E, N) once on all k + 1 exit hidden states; the draft blocks are not
            #    run again on the drafts.
            hidden = torch.cat(hiddens, 1)  # (B, k+1, D)
            if exit_layer < num_layers:
                hidden = view.run_layers(hidden, exit_layer, num_layers, **self._place(b, 0, k + 1))
        p_logits = view.exit_logits(hidden)  # (B, k+1, V)
        # 3. Accept the longest prefix the target agrees with.
        drafts = torch.cat(drafts, 1)  # (B, k)
        if b.sampling.greedy:
            tokens, accepted = accept_greedy(drafts, p_logits)
        else:
            # q: one-hot for copied drafts (deterministic given the context), the early exit's
            # processed distribution for its own drafts.
            vocab = p_logits.shape[-1]
            q = torch.cat([sampling.copied_probs(part, vocab) if source == "copy"
                           else b.sampling.probs(part)[:, None] for source, part in q], 1)  # (B, k, V)
            decided = b.lengths_dev[:, None] + b.steps[1:k + 2]  # (B, k+1): positions n+1 .. n+k+1
            tokens, accepted = accept_sampled(drafts, q, b.sampling.probs(p_logits),
                                              uniforms(b.seeds, decided[:, :k], ACCEPT),
                                              uniforms(b.seeds, decided, TARGET))
        return tokens, accepted, (start, drafted, clock.mark()), segments

    # -- generation ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, num_speculations=None, drafter: str | None = None,
                 eos_token_id=None, stop_strings=None, seed=None, streamer=None) -> GenerationOutput:
        """Generate up to `max_new_tokens` tokens per prompt; the result is exactly the full model's.

        input_ids: a list of token lists (any lengths), one token list, a (B, T) tensor with an
            optional `attention_mask` (left or right padding), or strings when a tokenizer is set.
        temperature/top_k/top_p: 0 = greedy; the same processing applies to draft and target.
        num_speculations: the early exit's k per round: an int (0: no early-exit drafts, so plain
            decoding with the "early_exit" drafter), "auto" (cost model), "window" (the articles'
            rule), or a `Controller`; None uses the generator's default.
        drafter: "early_exit", "ngram" or "hybrid" (see `policy.py`), or a `DraftPolicy`; None uses
            the generator's default.
        eos_token_id: int or list; None = the model's own (generation config, then config, then
            tokenizer); [] = never stop at eos. The eos token is included in the output.
        stop_strings: strings that end a row once its decoded output contains one (needs a
            tokenizer); the token completing it is the last one kept.
        seed: int (row i uses seed + i), a list of per-row seeds, or None (drawn from torch's global
            generator). Each row's numbers depend only on its own seed and positions, so with a fixed
            k a row's result does not depend on its batch-mates; a batch-shared adaptive k changes
            where rounds end and thus which numbers are used, never the distribution.
        streamer: an object with Hugging Face's streamer interface (`put(token_ids)`, `end()`), e.g.
            `transformers.TextStreamer`. As in Hugging Face's generate, `put` first receives the
            prompt (the first row's), then the accepted tokens of each round as they are decided, then
            `end()` is called. The rows of a batch stream one after another in row order: row 0 live,
            each later row's tokens held back until the rows before it have finished.
        """
        wall = time.perf_counter()
        prompts = self._prompts(input_ids, attention_mask)
        sampling = SamplingParams(temperature, top_k, top_p)
        policy = drafter if isinstance(drafter, DraftPolicy) else make_policy(
            drafter or self.drafter, self.num_speculations if num_speculations is None else num_speculations,
            self.ngram)
        policy.start(prompts)
        eos = self._eos_ids(eos_token_id)
        stops = self._stop_strings(stop_strings)
        if self.view.model.training:
            warnings.warn("the model is in training mode (dropout on): outputs will not match eval mode",
                          stacklevel=2)
        stats = GenerationStats(exit_layer=self.exit_layer, num_layers=self.view.num_layers)
        max_new_tokens = max(0, max_new_tokens)
        generated = np.zeros((len(prompts), max_new_tokens), dtype=np.int64)
        counts = np.zeros(len(prompts), dtype=np.int64)  # tokens generated per row
        stream = _RowOrderStream(streamer, prompts) if streamer is not None else None
        if max_new_tokens == 0:
            if stream:
                stream.end()
            return GenerationOutput([[] for _ in prompts], stats, [""] * len(prompts) if self.tokenizer else None)
        prompt_lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        limit = self.view.max_positions
        if limit is not None and prompt_lengths.max() + max_new_tokens > limit:
            raise ValueError(f"a prompt of {prompt_lengths.max()} tokens plus max_new_tokens = {max_new_tokens} "
                             f"exceeds the model's {limit} positions; shorten the prompt or lower max_new_tokens")
        clock = _Clock(self.view.device)

        b = self._start(prompts, sampling, seed, capacity=int(prompt_lengths.max()) + max_new_tokens
                        + policy.k_max + 1)
        stats.prefill_time = time.perf_counter() - wall
        while b.rows.size:  # finished rows leave the batch
            plan = policy.plan(b.rows)
            cap = policy.k_max
            if limit is not None:  # no draft beyond the last position the model has (GPT-2's table)
                cap = min(cap, limit - 1 - int(b.lengths.max()))
                plan = plan.truncate(cap)
            tokens, accepted, (start, drafted, verified), segments = self._round(b, plan, policy, clock, cap)
            k = tokens.shape[1] - 1
            host = torch.cat([tokens, accepted[:, None]], 1).cpu().numpy()  # the round's one host sync
            tokens, accepted = host[:, :-1], host[:, -1]
            draft_time, verify_time = clock.seconds(start, drafted), clock.seconds(drafted, verified)
            self._record(stats, segments, accepted, draft_time, verify_time)
            policy.update(segments, accepted, draft_time, verify_time)

            rows = b.rows
            emit, finished = self._emit_counts(tokens, accepted, counts[rows], max_new_tokens, eos)
            slots, cols = np.nonzero(np.arange(k + 1) < emit[:, None])
            generated[rows[slots], counts[rows[slots]] + cols] = tokens[slots, cols]
            if stops:
                finished |= self._cut_at_stop_strings(stops, generated, rows, counts[rows], emit)
            counts[rows] += emit
            policy.observe(rows, tokens, emit)
            if stream:
                stream.feed(rows, tokens, emit, finished)
            self._advance(b, tokens, emit, keep=~finished)
            if self.check_cache:
                b.cache.check(prompt_lengths[b.rows] - 1 + counts[b.rows])

        if stream:
            stream.end()
        stats.generated_tokens = int(counts.sum())
        stats.total_time = time.perf_counter() - wall
        sequences = [generated[row, :counts[row]].tolist() for row in range(len(prompts))]
        texts = [self.tokenizer.decode(s) for s in sequences] if self.tokenizer is not None else None
        return GenerationOutput(sequences, stats, texts)

    def _start(self, prompts, sampling, seed, capacity: int) -> _Batch:
        """Allocate the cache and prefill every prompt token but the last (the first pending token)."""
        device, rows = self.view.device, len(prompts)
        b = _Batch(cache=KVCache(self.view.num_layers, rows, capacity), sampling=sampling,
                   steps=torch.arange(capacity, device=device), rows=np.arange(rows),
                   lengths=np.zeros(rows, dtype=np.int64),
                   pending_host=np.array([p[-1] for p in prompts], dtype=np.int64),
                   seeds_host=np.array(self._seeds(seed, rows, sampling.greedy), dtype=np.int64))
        b.upload(device)
        width = max(len(p) for p in prompts) - 1
        if width > 0:  # right-padded with token 0; the padding's slots are stale, hidden, overwritten
            ids = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts], device=device)
            place = self._place(b, 0, width)
            self.view.run_layers(self.view.embed(ids, place["positions"]), 0, self.view.num_layers, **place)
        b.lengths = np.array([len(p) - 1 for p in prompts], dtype=np.int64)
        b.cache.rollback(b.lengths)
        b.upload(device)
        return b

    def _advance(self, b: _Batch, tokens: np.ndarray, emit: np.ndarray, keep: np.ndarray) -> None:
        """Keep each row's emitted tokens (the last becomes pending, the cache rolls back to the rest),
        then drop finished rows from the batch so that no round is spent on them."""
        b.pending_host = tokens[np.arange(len(emit)), emit - 1]  # every running row emits >= 1 token
        b.lengths = b.lengths + emit
        b.cache.rollback(b.lengths)
        if not keep.all():
            b.rows, b.lengths, b.pending_host, b.seeds_host = (
                b.rows[keep], b.lengths[keep], b.pending_host[keep], b.seeds_host[keep])
            b.cache.select_rows(np.nonzero(keep)[0])
        b.upload(self.view.device)

    @staticmethod
    def _record(stats: GenerationStats, segments: list[Segment], accepted: np.ndarray, draft_time: float,
                verify_time: float) -> None:
        k = sum(s.length for s in segments)
        stats.update(accepted, k)
        for segment in segments:
            reached, kept = segment.accepted(accepted)
            if reached.any():
                getattr(stats, segment.source).update(kept, segment.length)
        if k:
            stats.draft_steps += sum(s.length for s in segments if s.source == "early_exit")  # copies take none
            stats.draft_time += draft_time
            stats.verify_time += verify_time
        else:
            stats.plain_steps += 1
            stats.plain_time += verify_time

    @staticmethod
    def _emit_counts(tokens, accepted, counts, max_new_tokens, eos):
        """Tokens each running row keeps from this round, cut after an eos and at the limit; finished rows."""
        emit = np.minimum(accepted + 1, max_new_tokens - counts)
        hit_eos = np.zeros(len(emit), dtype=bool)
        if eos.size:
            hits = np.isin(tokens, eos) & (np.arange(tokens.shape[1]) < emit[:, None])
            hit_eos = hits.any(1)
            emit = np.where(hit_eos, hits.argmax(1) + 1, emit)
        return emit, hit_eos | (counts + emit >= max_new_tokens)

    def _cut_at_stop_strings(self, stops, generated, rows, counts, emit) -> np.ndarray:
        """Shorten `emit` (in place) to end at the token completing a stop string; the slots that stop."""
        stopped = np.zeros(len(emit), dtype=bool)
        for slot, row in enumerate(rows):
            tokens = generated[row, :counts[slot] + emit[slot]].tolist()
            if not any(s in self.tokenizer.decode(tokens) for s in stops):
                continue
            for end in range(counts[slot] + 1, len(tokens) + 1):
                if any(s in self.tokenizer.decode(tokens[:end]) for s in stops):
                    emit[slot] = end - counts[slot]
                    stopped[slot] = True
                    break
        return stopped

    # -- inputs --------------------------------------------------------------------------------------
    def _prompts(self, input_ids, attention_mask) -> list[list[int]]:
        if isinstance(input_ids, str) or (isinstance(input_ids, Sequence) and input_ids
                                          and all(isinstance(x, str) for x in input_ids)):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: SelfSpecGenerator(model, tokenizer, ...)")
            texts = [input_ids] if isinstance(input_ids, str) else list(input_ids)
            prompts = [list(self.tokenizer(text)["input_ids"]) for text in texts]
        elif isinstance(input_ids, torch.Tensor):
            ids = input_ids if input_ids.dim() == 2 else input_ids[None]
            if attention_mask is None:
                prompts = ids.tolist()
            else:
                mask = attention_mask.reshape(ids.shape).bool()
                prompts = [row[keep].tolist() for row, keep in zip(ids, mask)]
        elif isinstance(input_ids, Sequence) and input_ids and all(isinstance(x, int) for x in input_ids):
            prompts = [list(input_ids)]
        else:
            prompts = [[int(t) for t in row] for row in input_ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        return prompts

    @staticmethod
    def _seeds(seed, rows: int, greedy: bool) -> list[int]:
        if seed is None:  # greedy needs no random numbers: leave torch's global generator alone
            seed = 0 if greedy else int(torch.randint(0, 2**31 - 1, ()))
        if isinstance(seed, int):
            return [seed + row for row in range(rows)]
        seeds = [int(s) for s in seed]
        if len(seeds) != rows:
            raise ValueError(f"seed: got {len(seeds)} per-row seeds for {rows} prompts")
        return seeds

    def _eos_ids(self, eos_token_id) -> np.ndarray:
        if eos_token_id is None:
            generation_config = getattr(self.view.model, "generation_config", None)
            eos_token_id = getattr(generation_config, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = getattr(self.view.config, "eos_token_id", None)
            if eos_token_id is None and self.tokenizer is not None:
                eos_token_id = self.tokenizer.eos_token_id
        if eos_token_id is None:
            eos_token_id = []
        if isinstance(eos_token_id, int):
            eos_token_id = [eos_token_id]
        return np.array(list(eos_token_id), dtype=np.int64)

    def _stop_strings(self, stop_strings) -> list[str]:
        if not stop_strings:
            return []
        if self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: SelfSpecGenerator(model, tokenizer, ...)")
        return [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)


__all__ = ["GenerationOutput", "GenerationStats", "SelfSpecGenerator"]
