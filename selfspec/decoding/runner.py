"""`Runner`: the round machinery of one model on one backend, which an `Engine` owns and steps.

A generator keeps the model's runner; each engine steps a runner of its own (`for_engine`), which shares
the model's parts (the passes, draft heads, grammar index, vocabulary text) and holds its own key/value
buffers where the backend keeps them from call to call: two engines of one generator decode side by
side, each what it decodes alone.

A decode's state is a `Batch` (its running rows, their cache and settings); the runner makes and
advances it: `start` allocates the cache and prefills the prompts, `join` prefills rows that join a
running batch and appends them, `round` drafts (the proposers, `RoundDrafter`) and verifies (`Verifier`)
once for every row, `advance` keeps what the rows emitted and drops those that finished, `fused_rounds`
runs a lone greedy row's rounds in one backend call where the backend has them (`fuses` says where).
Its passes go through `RoundPasses` to the backend (`selfspec.backends`); the backend knows nothing of
rounds. Tokenizer-side helpers the engine needs (the grammars' index, the text of the vocabulary's
pieces) are built here once per model, on first use.

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

Each row brings its own sampling settings (`NewRow.sampling`, on the device as the batch's
`sampling.RowSampling`): a round whose rows are all greedy takes the greedy paths (the argmax, the
backend's compiled steps, fused rounds, a grammar's forced drafts); any other takes speculative
sampling's rule for every row, a greedy row's distributions one-hot, which accepts exactly what the
argmax would. A sampled row's drafts then depend on that row alone (the early exit at a fixed k), so it
draws what it draws alone.

Batches run in lockstep rounds with one k; each row has its own positions, accepted length and
cache length (`cache.KVCache`), and a finished row leaves the batch at the end of its round. The
host reads the device once per round (the round's tokens and accepted counts), plus once per draft
step for η (`stop_below`) and for drafters that copy; everything else the loop needs (positions,
kv_length, cache lengths) is known on the host already.

One row decoding greedily with early-exit drafts (or plain steps) or with copies only, unconstrained,
runs its rounds in compiled calls of many rounds where the kernels apply (`Backend.greedy_rounds`):
the same passes, so the same tokens, without the host's Python between them; the statistics and the
policy then take the rounds' counts. A fixed k runs to the row's end in one call; an adaptive k (or
copy length) changes between calls of `ADAPT_ROUNDS` rounds, more while it stays (`Engine._span`), and a
cost gate's k between calls of at most `GATED_ROUNDS`; a call that streams or stops at strings
runs one round per call, and a stepped engine's (`engine(rounds_per_step=...)`: the server) that many.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import numpy as np
import torch

from ..backends import Backend, FusedDrafts
from ..errors import UserError
from ..model import DecoderView
from ..sampling import RowSampling, SamplingParams
from .batch import Batch, DeviceRows, Drafting
from .cache import CachePool, KVCache
from .draft_head import DraftHead, frequent_tokens
from .grammar import GrammarTokenizer
from .ngram import TokenText
from .outputs import GenerationStats, NewRow, RoundCounts
from .passes import RoundPasses
from .policy import DraftPlan, DraftPolicy, Segment
from .prefix import PrefixCache
from .profile import RoundProfile
from .proposers import RoundDrafter
from .settings import DecodeSettings
from .verification import Verifier


class Runner:
    """The round machinery (module docstring) of the model behind `view` on `backend`.

    tokenizer: for stop strings, grammars and copies matched on text (None: none of those); eos: the
    ids that end a row by default (the grammars' end); token_counts, exit_adapters: as
    `SelfSpecGenerator`'s (the draft heads' V' ranking, the adapters trained for exits); prefix_cache:
    a `PrefixCache` prompts prefill through, or None. `check_cache` (True until a caller sets it
    False, as a timed run does): check every layer's cache length after every round. An engine steps
    a runner of its own (`for_engine`)."""

    def __init__(self, view: DecoderView, backend: Backend, tokenizer=None, eos: list[int] | None = None, *,
                 token_counts=None, exit_adapters: dict | None = None,
                 prefix_cache: PrefixCache | None = None):
        self.view, self.backend, self.tokenizer, self.eos = view, backend, tokenizer, list(eos or [])
        self.passes = RoundPasses(view, backend)
        self.drafter = RoundDrafter(self.passes, token_text=lambda: self.token_text)  # the proposers
        self.verifier = Verifier(self.passes)
        # a backend whose passes are captured writes the same buffers from call to call (`CachePool`):
        # each engine's runner holds a pool of its own, taken from these and put back when it goes
        self._pools: list[CachePool] = []
        self._pool: CachePool | None = None
        # bf16/fp16: every decoding pass at one width (`model.fast.fixed_width`), so that a position
        # gets the same rounding alone (plain) as among k + 1 (verification); fp32 needs no help.
        self.fixed_width = view.dtype in (torch.bfloat16, torch.float16)
        self.token_counts = token_counts
        self.exit_adapters = dict(exit_adapters or {})
        self.prefix_cache = prefix_cache
        self.check_cache = True
        self._heads: dict[tuple[int, int], DraftHead] = {}  # (E, V') -> its draft head, built once
        # built on first use, shared by every engine's runner: the grammars' index, the vocabulary's text
        self._built: dict[str, object] = {}

    def for_engine(self) -> Runner:
        """A runner for one engine: this one's parts, shared, and on a backend that keeps key/value
        buffers from call to call (`CachePool`) a pool no other live engine writes (the last engine's
        that has gone, so a generator's calls one after another write the same addresses)."""
        runner = copy.copy(self)
        if self.backend.pools_caches:
            pools = self._pools
            runner._pool = pools.pop() if pools else CachePool(self.backend.allocate)
            weakref.finalize(runner, pools.append, runner._pool)
        return runner

    def draft_head(self, settings: DecodeSettings) -> DraftHead:
        """The draft head of `settings`: its E's MLP adapter, its V' ids."""
        key = (settings.exit_layer, settings.draft_vocab_size)
        if key not in self._heads:
            ids = (frequent_tokens(self.token_counts, settings.draft_vocab_size) if settings.draft_vocab_size
                   else None)
            adapter = self.exit_adapters.get(settings.exit_layer)
            self._heads[key] = DraftHead(self.view, ids, None if getattr(adapter, "attends", False)
                                         else adapter)
        return self._heads[key]

    def exit_block(self, settings: DecodeSettings):
        """The attending exit adapter the drafts of `settings` read (an `ExitBlock`), or None: none
        trained for its E, or a call that never drafts with the early exit (plain, copies only), which
        then does not pay for it."""
        adapter = self.exit_adapters.get(settings.exit_layer)
        if not getattr(adapter, "attends", False) or settings.is_plain or settings.drafter == "ngram":
            return None
        return adapter

    def drafting(self, settings: DecodeSettings) -> Drafting:
        """How rounds at `settings` draft (`batch.Drafting`): their E, draft head, exit block, η, ..."""
        head = self.draft_head(settings)
        return Drafting(settings.exit_layer, head, self.exit_block(settings),
                        None if settings.is_plain else head.tensors(), settings.stop_below, settings.overlap,
                        settings.fused, forced=not settings.is_plain)

    def round(self, b: Batch, plan: DraftPlan, policy: DraftPolicy, clock, k_max: int):
        """One round for every row: draft, verify all drafts in one pass, accept a prefix.

        Returns decided (B, k+2): per row the tokens (k + 1) then the accepted count, three timestamps
        (start, drafted, verified) and the `Draft` (its `Segment`s, whether η stopped it). A row emits
        tokens[:accepted + 1]: its accepted drafts, then the target's own token (the correction after
        a rejection, the bonus after a full acceptance). k = 0 is one plain decoding step.
        """
        start = clock.mark()
        draft = self.drafter.draft(b, plan, policy, k_max)
        drafted = clock.mark()
        decided = self.verifier.verify(b, draft)
        return decided, (start, drafted, clock.mark()), draft

    @property
    def token_text(self) -> TokenText | None:
        """The vocabulary's pieces for copies matched on the text (`ngram.TokenText`), built on first use;
        None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if "token_text" not in self._built:
            self._built["token_text"] = TokenText(self.tokenizer)
        return self._built["token_text"]

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """llguidance's index of the tokenizer (structured output), built on first use."""
        if "grammar" not in self._built:
            self._built["grammar"] = GrammarTokenizer(self.tokenizer, self.view.vocab_size, self.eos)
        return self._built["grammar"]

    def forget_compiled(self) -> None:
        """Forget the compiled constraints kept for reuse (an idle server's memory)."""
        if "grammar" in self._built:
            self._built["grammar"].forget_compiled()

    def check_positions(self, prompt_length: int, max_new_tokens: int) -> None:
        """A UserError when a prompt and its token limit pass the model's positions."""
        limit = self.view.max_positions
        if limit is not None and prompt_length + max_new_tokens > limit:
            raise UserError(f"a prompt of {prompt_length} tokens plus "
                            f"max_new_tokens = {max_new_tokens} exceeds the model's {limit} positions; "
                            f"shorten the prompt or lower max_new_tokens")

    def join(self, b: Batch, joining: list[NewRow], first: int, policy: DraftPolicy,
              settings: DecodeSettings, k_max: int) -> int:
        """Rows joining the running batch `b` (continuous batching) as caller rows first, first + 1, ...:
        prefilled in a cache of their own (`start`), then appended to `b`'s rows, cache (grown to the
        capacity they need) and grammars. Returns how many joined."""
        for row in joining:  # `Engine.add` checked the rest
            self.check_positions(len(row.prompt), row.max_new_tokens)
        prompts = [list(row.prompt) for row in joining]
        params = [row.sampling for row in joining]
        seeds = [(0 if p.greedy else int(torch.randint(0, 2**31 - 1, ()))) if row.seed is None else row.seed
                 for p, row in zip(params, joining)]
        capacity = max(b.cache.capacity, max(len(p) + r.max_new_tokens for p, r in zip(prompts, joining))
                       + k_max + 1)
        # a cache of their own (b's may be the pool's, `new_cache`), moved onto b's after
        new = self.start(prompts, params, seeds, settings, capacity, role="joining")
        new.rows = first + np.arange(len(joining))
        policy.add(prompts)
        if b.grammar is not None:
            b.grammar.add([row.constraint for row in joining])
        b.add_rows(new)
        if self._pool is not None:
            self._pool.home(b.cache)
        if b.steps.numel() < b.cache.capacity:
            b.steps = torch.arange(b.cache.capacity, device=b.steps.device)
        b.upload(b.steps.device)
        return len(joining)

    def start(self, prompts, params: list[SamplingParams], seed, settings: DecodeSettings, capacity: int,
               role: str = "batch") -> Batch:
        """Allocate the cache and prefill every prompt token but the last (the first pending token);
        params: each row's sampling settings."""
        device, rows = self.view.device, len(prompts)
        drafting = self.drafting(settings)
        extra_layers = 0 if drafting.exit_block is None else drafting.exit_block.cache_layers
        seeds = np.array(self.seeds(seed, rows, all(p.greedy for p in params)), dtype=np.int64)
        b = Batch(cache=self.new_cache(self.view.num_layers + extra_layers, rows, capacity, role),
                   params=list(params), sampling=RowSampling.of(params, device, seeds), drafting=drafting,
                   grammar=None, steps=torch.arange(capacity, device=device), rows=np.arange(rows),
                   lengths=np.zeros(rows, dtype=np.int64),
                   pending=np.array([p[-1] for p in prompts], dtype=np.int64), seeds=seeds)
        b.upload(device)
        width = max(len(p) for p in prompts) - 1
        if self.prefix_cache is not None:
            for row, prompt in enumerate(prompts):
                self._prefill_chunks(b, row, prompt[:-1])
        elif width > 0:  # right-padded with token 0; the padding's slots are stale, hidden, overwritten
            ids = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts], device=device)
            self.passes.run(b, ids, 0, self.view.num_layers)
        b.lengths = np.array([len(p) - 1 for p in prompts], dtype=np.int64)
        b.cache.rollback(b.lengths)
        b.upload(device)
        return b

    def _prefill_chunks(self, b: Batch, row: int, tokens: list[int]) -> None:
        """Row `row`'s prompt `tokens` (all but its pending last) into `b`'s cache through the prefix
        cache (`prefix.py`): the chunks it holds loaded, the rest run a chunk per pass, on this row
        alone (in a one-row batch of its own when `b` has more), then kept for later calls."""
        if not tokens:
            return
        cache = self.prefix_cache
        one = b if len(b.rows) == 1 else dataclasses.replace(
            b, cache=self.new_cache(b.cache.num_layers, 1, b.cache.capacity, "row"), rows=np.arange(1),
            lengths=np.zeros(1, dtype=np.int64), pending=b.pending[row:row + 1],
            seeds=b.seeds[row:row + 1], params=b.params[row:row + 1],
            sampling=RowSampling.of(b.params[row:row + 1], self.view.device, b.seeds[row:row + 1]),
            on_device=DeviceRows())
        if one is not b:
            one.upload(self.view.device)
        layout = cache.layout(self.view.model, b.drafting.exit_block, one.cache.num_layers)
        hits, loaded = cache.match(layout, tokens), 0
        for chunk in hits:
            one.cache.write_slots(0, loaded, chunk.keys, chunk.values)
            loaded += len(chunk.tokens)
        ids = torch.tensor([tokens], device=self.view.device)
        for start, end in cache.spans(len(tokens))[len(hits):]:
            self.passes.run(one, ids[:, start:end], start, self.view.num_layers)
        cache.prefilled_tokens += len(tokens) - loaded
        cache.store(layout, tokens, lambda start, end: one.cache.read_slots(0, start, end))
        if one is not b:
            b.cache.write_slots(row, 0, *one.cache.read_slots(0, 0, len(tokens)))

    def new_cache(self, layers: int, rows: int, capacity: int, role: str = "batch") -> KVCache:
        """An empty cache of at least `capacity` slots per row. On a backend that pools caches (static
        passes), at the backend's capacity bucket on the pool's buffers of its `role` (`CachePool`: the
        call's own "batch", rows "joining" it, a "row" prefilled alone), which the next call writes
        again: captured passes are specific to the shapes and, under CUDA graphs, to the addresses of
        the buffers they write. Each engine's runner has a pool of its own (`for_engine`)."""
        if self._pool is None:
            return KVCache(layers, rows, capacity)
        return self._pool.cache(layers, rows, self.backend.capacity(capacity), role)

    def advance(self, b: Batch, tokens: np.ndarray, emit: np.ndarray, keep: np.ndarray) -> None:
        """Keep each row's emitted tokens (the last becomes pending, the cache rolls back to the rest),
        then drop finished rows from the batch so that no round is spent on them."""
        b.pending = tokens[np.arange(len(emit)), emit - 1]  # every running row emits >= 1 token
        b.lengths = b.lengths + emit
        b.cache.rollback(b.lengths)
        self.keep_rows(b, keep)

    def keep_rows(self, b: Batch, keep: np.ndarray) -> None:
        """Only the rows `keep` (B,) bool stay in the batch (finished or cancelled ones leave), their
        cache back on the pool's buffers where the backend pools them."""
        if not keep.all():
            b.keep_rows(keep)
            if self._pool is not None:
                self._pool.home(b.cache)
        b.upload(b.steps.device)

    def fuses(self, b: Batch, policy: DraftPolicy, rounds_per_call: int) -> bool:
        """Whether a row's rounds may run several in one call of the backend (`fused_rounds`): a backend
        with fused rounds and settings that take them (`DecodeSettings.fused`), no exit block, a policy
        whose rounds fuse (`DraftPolicy.fuses`), and early-exit drafts only with a head the compiled draft
        loop reads. A round asks besides that its batch is one row without a grammar, greedy or sampled at
        a fixed k (`Engine`'s `_fused_rounds`): rows join and leave."""
        if not (self.backend.fused_rounds and b.drafting.fused) or b.drafting.exit_block is not None:
            return False
        reads_head = b.drafting.tensors is not None
        return policy.fuses(rounds_per_call) and (not policy.drafts_early_exit or reads_head)

    def fused_rounds(self, b: Batch, drafts: FusedDrafts, eos: np.ndarray, max_tokens: int,
                     max_rounds: int, stats: GenerationStats, policy: DraftPolicy,
                     laps: RoundProfile | None):
        """Up to `max_rounds` rounds of the batch's one row in one call of the backend
        (`Backend.greedy_rounds`), drafting as `drafts` says (the policy's k and copies), each round
        recorded in `stats` and shown to `policy` as the rounds from Python record them: (tokens (1, t)
        the row kept, emit (1,) = t, finished (1,): an eos or `max_tokens` reached, the call's
        `RoundCounts`), or None, nothing run, where the backend declines."""
        k, d = drafts.k, b.drafting
        head = d.tensors if k else d.head.tensors()
        if head is None:
            return None
        drafts = dataclasses.replace(drafts, exit_layer=d.exit_layer, head=head, stop_below=d.stop_below)
        overlap = d.overlap and policy.overlaps(b.rows)  # where the measured costs say it pays
        out = self.backend.greedy_rounds(int(b.pending[0]), b.cache, int(b.lengths[0]), drafts,
                                         torch.from_numpy(eos), max_tokens, max_rounds, overlap,
                                         None if b.sampling.all_greedy else b.sampling)
        if out is None:
            return None
        tokens, rounds, seconds, drafted = out
        ends = np.cumsum(rounds[:, 0] + rounds[:, 1])  # where each round's drafts end in `drafted`
        if laps is not None:  # the call's own clock splits its time; the rest of it is acceptance
            laps.split({"draft passes": float(seconds[:, 0].sum()),
                        "verification pass": float(seconds[:, 1].sum())}, rest="acceptance")
        made = {}  # (early, copied) -> the round's segments: a call's rounds repeat a few shapes
        for (early, copied, accepted, _, ahead), (draft_time, verify_time), end in zip(
                rounds.tolist(), seconds.tolist(), ends.tolist()):
            segments = made.get((early, copied))
            if segments is None:
                parts = (("early_exit", 0, early), ("copy", early, copied))
                segments = made[early, copied] = [Segment(source, start, length)
                                                  for source, start, length in parts if length]
            if not segments:  # a plain step, also one whose first E blocks ran before η stopped the draft
                draft_time, verify_time = 0.0, draft_time + verify_time
            stats.stopped_below_eta += early < k and not (copied and not early)  # a copy round drafts no exit
            stats.drafted_ahead += ahead
            counts = np.array([accepted])
            round_drafts = [drafted[end - early - copied:end][None]]  # one part, (1, k)
            self.record(stats, segments, counts, draft_time, verify_time, round_drafts)
            policy.update(segments, counts, draft_time, verify_time)
        b.lap("statistics")
        finished = len(tokens) >= max_tokens or bool(len(tokens) and np.isin(tokens[-1], eos))
        early, copied, accepted = np.asarray(rounds, dtype=np.int64).reshape(-1, 5)[:, :3].sum(0)
        done = RoundCounts(np.array([len(rounds)]), np.array([early + copied]), np.array([accepted]))
        return np.asarray(tokens, dtype=np.int64)[None], np.array([len(tokens)]), np.array([finished]), done

    @staticmethod
    def record(stats: GenerationStats, segments: list[Segment], accepted: np.ndarray, draft_time: float,
               verify_time: float, drafts: list = ()) -> None:
        """A round's statistics: its draft `segments`, each row's `accepted` count (B,), its seconds. drafts:
        the round's draft tokens as parts (B, r) in position order (`Draft.parts`, not joined: only a caller
        that logs rounds reads them, the tests holding every path's to the Python round's); the statistics
        count segments, not tokens."""
        k = sum(s.length for s in segments)
        stats.log_round(segments, accepted, k)
        if k:
            # copies and forced tokens take none
            stats.draft_steps += sum(s.length for s in segments if s.source == "early_exit")
            stats.draft_time += draft_time
            stats.verify_time += verify_time
        else:
            stats.plain_steps += 1
            stats.plain_time += verify_time

    @staticmethod
    def emit_counts(tokens, accepted, counts, max_new_tokens, eos):
        """Tokens each running row keeps from this round, cut after an eos and at the limit; finished rows."""
        emit = np.minimum(accepted + 1, max_new_tokens - counts)
        hit_eos = np.zeros(len(emit), dtype=bool)
        if eos.size:
            # (B, k+1, n_eos) compared at once: np.isin sorts, several times slower on a round's few tokens
            hits = (tokens[..., None] == eos).any(-1) & (np.arange(tokens.shape[1]) < emit[:, None])
            hit_eos = hits.any(1)
            emit = np.where(hit_eos, hits.argmax(1) + 1, emit)
        return emit, hit_eos | (counts + emit >= max_new_tokens)

    @staticmethod
    def seeds(seed, rows: int, greedy: bool) -> list[int]:
        if seed is None:  # greedy needs no random numbers: leave torch's global generator alone
            seed = 0 if greedy else int(torch.randint(0, 2**31 - 1, ()))
        if isinstance(seed, int):
            return [seed + row for row in range(rows)]
        seeds = [int(s) for s in seed]
        if len(seeds) != rows:
            raise UserError(f"seed: got {len(seeds)} per-row seeds for {rows} prompts")
        return seeds
