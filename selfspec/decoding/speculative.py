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
host reads the device once per round (the round's tokens and accepted counts), plus once per draft
step for η (`stop_below`) and for drafters that copy; everything else the loop needs (positions,
kv_length, cache lengths) is known on the host already.

One row decoding greedily with early-exit drafts (or plain steps) or with copies only, unconstrained,
runs its rounds in compiled calls of many rounds where the kernels apply (`Backend.greedy_rounds`):
the same passes, so the same tokens, without the host's Python between them; the statistics and the
policy then take the rounds' counts. A fixed k runs to the row's end in one call; an adaptive k (or
copy length) changes between calls of `ADAPT_ROUNDS` rounds; a call that streams or stops at strings
runs one round per call, and a stepped engine's (`engine(rounds_per_step=...)`: the server) that many.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from ..backends import FusedDrafts, make_backend
from ..cpu import release_freed_memory
from ..errors import UserError
from ..model import DecoderView
from ..sampling import RowSampling, SamplingParams
from .batch import Batch
from .cache import CachePool, KVCache
from .controller import Controller
from .draft_head import DraftHead, frequent_tokens
from .engine import CallOptions, Engine
from .generation import GenerationConfig
from .grammar import GrammarBatch, GrammarTokenizer, constraints_for_rows
from .ngram import TokenText
from .outputs import GenerationOutput, GenerationStats, NewRow, RoundCounts, RoundOutput
from .passes import RoundPasses
from .policy import DraftPlan, DraftPolicy, Segment
from .prefix import PrefixCache
from .profile import RoundProfile
from .proposers import RoundDrafter
from .settings import DecodeSettings
from .verification import Verifier


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

    def feed(self, outputs: list[RoundOutput]) -> None:
        """A step's emitted tokens, per row."""
        for out in outputs:
            self.buffers[out.row] += out.tokens
            self.done[out.row] |= out.finished
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
        stop strings; settings: the default `DecodeSettings` of `generate` (drafter, E, k, V', copy
        settings); keywords override its fields as `DecodeSettings.override` takes them (exit_layer,
        num_speculations, drafter, draft_vocab_size, stop_below, ngram, min_ngram, overlap):
        `SelfSpecGenerator(model, exit_layer=4)` is the early exit at E = 4, k = "auto". E = N drafts
        with the whole model (every draft accepted, useful as a check).
    token_counts: (V,) token frequencies that rank the V' ids of a trimmed draft head (needed for
        draft_vocab_size > 0; see `draft_head.py`); exit_adapters: {E: adapter} trained for those
        exits (`model.exit_adapter`: an `ExitAdapter`, or an `ExitBlock` with a KV cache of its own
        at cache layer N), applied to the exit's hidden states before the draft head (verification
        never reads them); check_cache: assert after every round that each layer's cache length
        equals the sequence length (a timed run sets False); format_settings: {constraint kind:
        settings}, the default of a `generate` call whose constrained rows all have that kind
        ("json_schema", "regex", "lark"), as a sweep on such prompts stored it.
    static_passes: None, or run every decoding pass of up to `static_passes.WIDTH` positions (plain
        steps, drafts, verifications; rounds are capped to that many) at fixed shapes, the path for
        CUDA graphs (`backends.static`): "eager" as written, "compile" through `torch.compile`
        (CUDA graphs on a GPU), "graph" each pass captured as a CUDA graph (`backends.graphs`,
        emulated off CUDA). The cache is then kept per batch size and length bucket and reused.
        Llama-family models only; greedy output equals plain decoding's with the same setting.
    backend: how the round's passes run (`selfspec.backends`): "reference" (torch operations, the
        oracle), "cpu_kernels" (selfspec's compiled CPU calls), "static" (fixed shapes; `static_passes`
        says which mode, "eager" by default); None: static when `static_passes` is given, else the CPU
        kernels on a CPU and the reference elsewhere.
    prefix_cache: a `PrefixCache` (`prefix.py`), or None: prompts prefill through it, a chunk per
        pass, reusing the chunks earlier calls computed; a prompt decodes to the same bits whether
        its chunks were cached or not (not always the bits of a prefill without one).

    A bf16/fp16 model runs every decoding pass's products and attention on a fixed number of rows
    (`fixed_width`, `model.fast.fixed_width`), which makes speculative output equal plain output in low
    precision too (Llama-family blocks; GPT-2's are Hugging Face's own and are not covered).
    """

    def __init__(self, model, tokenizer=None, settings: DecodeSettings | None = None, *, token_counts=None,
                 exit_adapters: dict | None = None, format_settings: dict | None = None,
                 backend: str | None = None, static_passes: str | None = None,
                 prefix_cache: PrefixCache | None = None, check_cache: bool = True, **overrides):
        self.view = DecoderView(model)
        self.backend = make_backend(self.view, backend, static_passes)
        self.passes = RoundPasses(self.view, self.backend)
        self.drafter = RoundDrafter(self.passes, token_text=lambda: self.token_text)  # the proposers
        self.verifier = Verifier(self.passes)
        self.static_passes = static_passes  # as given (the backend knows its mode)
        # a backend whose passes are captured writes the same buffers from call to call (`CachePool`)
        self._pool = CachePool(self.backend.allocate) if self.backend.pools_caches else None
        # bf16/fp16: every decoding pass at one width (`model.fast.fixed_width`), so that a position
        # gets the same rounding alone (plain) as among k + 1 (verification); fp32 needs no help.
        self.fixed_width = self.view.dtype in (torch.bfloat16, torch.float16)
        self.tokenizer = tokenizer
        settings = (settings or DecodeSettings()).override(**overrides)
        self.token_counts = token_counts
        self.exit_adapters = dict(exit_adapters or {})
        self.check_cache = check_cache
        self.prefix_cache = prefix_cache
        self._heads: dict[tuple[int, int], DraftHead] = {}  # (E, V') -> its draft head, built once
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self.settings = self.settings_for(settings)
        self.format_settings = {kind: self.settings_for(s) for kind, s in (format_settings or {}).items()}

    @property
    def model(self):
        return self.view.model

    def settings_for(self, settings: DecodeSettings) -> DecodeSettings:
        """`settings` with E resolved for this model (the copy drafter needs none: E = N), or a UserError."""
        num_layers = self.view.num_layers
        if settings.exit_layer is None:
            if settings.drafter != "ngram" and not settings.is_plain:
                raise UserError("exit_layer is not set: pass exit_layer=E "
                                "(the number of blocks the draft runs)")
            settings = dataclasses.replace(settings, exit_layer=num_layers)
        if settings.exit_layer > num_layers:
            raise UserError(f"exit_layer must be an int in 1..{num_layers} "
                            f"(the number of blocks the draft runs), got {settings.exit_layer}")
        if settings.draft_vocab_size and self.token_counts is None:
            raise UserError(f"draft_vocab_size = {settings.draft_vocab_size} needs token counts to rank the "
                            f"ids: SelfSpecGenerator(..., token_counts=counts) or "
                            f"`selfspec draft-vocab MODEL`")
        return settings

    def draft_head(self, settings: DecodeSettings | None = None) -> DraftHead:
        """The draft head of `settings` (default the generator's): its E's MLP adapter, its V' ids."""
        settings = settings or self.settings
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

    # -- the round -----------------------------------------------------------------------------------
    def _round(self, b: Batch, plan: DraftPlan, policy: DraftPolicy, clock, cap: int):
        """One round for every row: draft, verify all drafts in one pass, accept a prefix.

        Returns decided (B, k+2): per row the tokens (k + 1) then the accepted count, three timestamps
        (start, drafted, verified) and the `Draft` (its `Segment`s, whether η stopped it). A row emits
        tokens[:accepted + 1]: its accepted drafts, then the target's own token (the correction after
        a rejection, the bonus after a full acceptance). k = 0 is one plain decoding step.
        """
        start = clock.mark()
        draft = self.drafter.draft(b, plan, policy, cap)
        drafted = clock.mark()
        decided = self.verifier.verify(b, draft)
        return decided, (start, drafted, clock.mark()), draft

    # -- generation ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids, attention_mask=None, config: GenerationConfig | None = None, *,
                 settings: DecodeSettings | None = None, streamer=None, **overrides) -> GenerationOutput:
        """Generate up to `max_new_tokens` tokens per prompt; the result is exactly the full model's.

        input_ids: a list of token lists (any lengths), one token list, a (B, T) tensor with an
            optional `attention_mask` (left or right padding), or strings when a tokenizer is set.
        config: what the call asks for (`GenerationConfig`: token limit, sampling, seeds, eos, stop
            strings, structured output, ...); keywords named as its fields override it, as in Hugging
            Face's `generate(**kwargs)`. settings: how to draft (`DecodeSettings`); None: the
            generator's, or under one kind of output constraint its `format_settings` entry.
        streamer: an object with Hugging Face's streamer interface (`put(token_ids)`, `end()`), e.g.
            `transformers.TextStreamer`: `put` first receives the prompt (the first row's), then the
            accepted tokens of each round as they are decided, then `end()` is called. A batch's rows
            stream one after another: row 0 live, each later row's tokens held back until the rows
            before it have finished. To follow every row live, or to let rows join and leave, step the
            decode yourself (`engine`).
        """
        config = (config or GenerationConfig()).with_overrides(overrides)
        prompts = self._prompts(input_ids, attention_mask)
        constraints = constraints_for_rows(len(prompts), config.json_schema, config.regex, config.grammar)
        kinds = {c.kind for c in constraints or () if c is not None}
        if settings is None and len(kinds) == 1 and kinds <= self.format_settings.keys():
            settings = self.format_settings[kinds.pop()]  # the format's own fastest
        settings, policy = self._resolve(settings, config.drafter, config.num_speculations)
        if self.view.model.training:
            warnings.warn("the model is in training mode (dropout on): outputs will not match eval mode",
                          stacklevel=2)
        stops = tuple(self._stop_strings(config.stop_strings) or ())
        options = CallOptions(settings, SamplingParams(config.temperature, config.top_k, config.top_p),
                              self._eos_ids(config.eos_token_id), stops, config.seed,
                              grammar=constraints is not None, draft_max_rows=config.draft_max_rows,
                              watched=streamer is not None or bool(stops), profile=config.profile)
        engine = Engine(self, policy, options)
        stream = _RowOrderStream(streamer, prompts) if streamer is not None else None
        if config.max_new_tokens > 0:
            for row, prompt in enumerate(prompts):
                engine.add(NewRow(prompt, config.max_new_tokens,
                                  constraint=None if constraints is None else constraints[row]))
            while not engine.done:
                outputs = engine.step()
                if stream:
                    stream.feed(outputs)
        if stream:
            stream.end()
        if config.max_new_tokens > 0:
            return engine.output()
        return GenerationOutput([[] for _ in prompts], engine.stats,
                                [""] * len(prompts) if self.tokenizer else None,
                                None if constraints is None else [c is None for c in constraints])

    def engine(self, settings: DecodeSettings | None = None, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, eos_token_id=None, structured: bool = False, rounds_per_step: int = 1,
               draft_max_rows: int | None = None) -> Engine:
        """A decode to step yourself (`engine.Engine`): `add(NewRow(prompt, max_new_tokens, seed))` returns
        the row, `step()` runs a round and returns each running row's `RoundOutput`, `cancel(row)` ends
        one, `output()` gives what `generate` returns. settings: how to draft (default the generator's);
        structured: rows may carry output constraints (`NewRow.constraint`); rounds_per_step: a lone
        greedy row's rounds per step where the CPU kernels run them in one call (its first step one
        round); draft_max_rows: as `generate`'s."""
        settings, policy = self._resolve(settings, None, None)
        sampling = SamplingParams(temperature, top_k, top_p)
        options = CallOptions(settings, sampling, self._eos_ids(eos_token_id), grammar=structured,
                              rounds_per_step=rounds_per_step, draft_max_rows=draft_max_rows)
        return Engine(self, policy, options)

    def chat(self, messages, **kwargs) -> GenerationOutput:
        """Reply to a conversation, a list of {"role", "content"} messages (or to a list of
        conversations, one row each), through the tokenizer's chat template with the generation
        prompt; keywords as `generate`'s. The texts leave out special tokens (the end of the turn)."""
        if not messages:
            raise UserError("chat needs a conversation: a list of {'role', 'content'} messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        out = self.generate([self.chat_prompt(c) for c in conversations], **kwargs)
        out.texts = [self.tokenizer.decode(s, skip_special_tokens=True) for s in out.sequences]
        return out

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The token ids of one conversation through the chat template, ending with the generation
        prompt (the assistant's turn opened)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise UserError("chat needs a tokenizer with a chat template (an instruct model's); "
                            "use generate for a plain continuation")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _resolve(self, settings, drafter, num_speculations) -> tuple[DecodeSettings, DraftPolicy]:
        """This call's settings (the generator's, then `settings`, then the two overrides) and policy."""
        settings = self.settings_for(settings) if settings is not None else self.settings
        if isinstance(drafter, DraftPolicy):
            return settings, drafter
        controller = num_speculations if isinstance(num_speculations, Controller) else None
        if type(num_speculations) is int and num_speculations == 0:
            drafter = "early_exit"  # k = 0 asked for: plain decoding, whatever drafter the settings name
        settings = self.settings_for(settings.override(
            drafter=drafter, num_speculations=None if controller is not None else num_speculations))
        return settings, settings.policy(controller)

    @functools.cached_property
    def token_text(self) -> TokenText | None:
        """The vocabulary's pieces for copies matched on the text (`ngram.TokenText`); None without a
        tokenizer."""
        return TokenText(self.tokenizer) if self.tokenizer is not None else None

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """llguidance's index of the tokenizer (structured output), built on first use."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.view.vocab_size,
                                                       self._eos_ids(None).tolist())
        return self._grammar_tokenizer

    def release_memory(self) -> None:
        """Forget what is kept only for reuse (compiled constraints), collect the garbage cycles and
        return the heap's free pages to the kernel (`cpu.release_freed_memory`): what a server does when
        it falls idle. The collection first: a refused grammar's exception holds the frames that hold
        its matcher (tens of MiB for `^a{1000000}$`) in a cycle, which an idle process, allocating
        nothing, would not collect."""
        if self._grammar_tokenizer is not None:
            self._grammar_tokenizer.forget_compiled()
        gc.collect()
        release_freed_memory()

    def _check_positions(self, prompt_length: int, max_new_tokens: int) -> None:
        """A UserError when a prompt and its token limit pass the model's positions."""
        limit = self.view.max_positions
        if limit is not None and prompt_length + max_new_tokens > limit:
            raise UserError(f"a prompt of {prompt_length} tokens plus "
                            f"max_new_tokens = {max_new_tokens} exceeds the model's {limit} positions; "
                            f"shorten the prompt or lower max_new_tokens")

    def _join(self, b: Batch, joining: list[NewRow], first: int, policy: DraftPolicy,
              settings: DecodeSettings, k_max: int) -> int:
        """Rows joining the running batch `b` (continuous batching) as caller rows first, first + 1, ...:
        prefilled in a cache of their own (`_start`), then appended to `b`'s rows, cache (grown to the
        capacity they need) and grammars. Returns how many joined."""
        for row in joining:  # `Engine.add` checked the rest
            self._check_positions(len(row.prompt), row.max_new_tokens)
        prompts = [list(row.prompt) for row in joining]
        params = [row.sampling for row in joining]
        seeds = [(0 if p.greedy else int(torch.randint(0, 2**31 - 1, ()))) if row.seed is None else row.seed
                 for p, row in zip(params, joining)]
        capacity = max(b.cache.capacity, max(len(p) + r.max_new_tokens for p, r in zip(prompts, joining))
                       + k_max + 1)
        # a cache of their own (b's may be the pool's, `_cache`), moved onto b's after
        new = self._start(prompts, params, seeds, settings, capacity, role="joining")
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

    def _start(self, prompts, params: list[SamplingParams], seed, settings: DecodeSettings, capacity: int,
               role: str = "batch") -> Batch:
        """Allocate the cache and prefill every prompt token but the last (the first pending token);
        params: each row's sampling settings."""
        device, rows = self.view.device, len(prompts)
        exit_block = self.exit_block(settings)
        head = self.draft_head(settings)
        extra_layers = 0 if exit_block is None else exit_block.cache_layers
        b = Batch(cache=self._cache(self.view.num_layers + extra_layers, rows, capacity, role),
                   params=list(params), sampling=RowSampling.of(params, device),
                   exit_layer=settings.exit_layer, head=head, exit_block=exit_block,
                   loop_head=head.tensors() if exit_block is None and not settings.is_plain else None,
                   step_head=head.tensors() if not settings.is_plain else None,
                   stop_below=settings.stop_below, overlap=settings.overlap, grammar=None,
                   forced=not settings.is_plain,
                   steps=torch.arange(capacity, device=device), rows=np.arange(rows),
                   lengths=np.zeros(rows, dtype=np.int64),
                   pending_host=np.array([p[-1] for p in prompts], dtype=np.int64),
                   seeds_host=np.array(self._seeds(seed, rows, all(p.greedy for p in params)),
                                       dtype=np.int64))
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
            b, cache=self._cache(b.cache.num_layers, 1, b.cache.capacity, "row"), rows=np.arange(1),
            lengths=np.zeros(1, dtype=np.int64), pending_host=b.pending_host[row:row + 1],
            seeds_host=b.seeds_host[row:row + 1], params=b.params[row:row + 1],
            sampling=RowSampling.of(b.params[row:row + 1], self.view.device), _shared=None)
        if one is not b:
            one.upload(self.view.device)
        layout = cache.layout(self.view.model, b.exit_block, one.cache.num_layers)
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

    def _cache(self, layers: int, rows: int, capacity: int, role: str = "batch") -> KVCache:
        """An empty cache of at least `capacity` slots per row. On a backend that pools caches (static
        passes), at the backend's capacity bucket on the pool's buffers of its `role` (`CachePool`: the
        call's own "batch", rows "joining" it, a "row" prefilled alone), which the next call writes
        again: captured passes are specific to the shapes and, under CUDA graphs, to the addresses of
        the buffers they write. So such a generator decodes one call at a time."""
        if self._pool is None:
            return KVCache(layers, rows, capacity)
        return self._pool.cache(layers, rows, self.backend.capacity(capacity), role)

    def _advance(self, b: Batch, tokens: np.ndarray, emit: np.ndarray, keep: np.ndarray) -> None:
        """Keep each row's emitted tokens (the last becomes pending, the cache rolls back to the rest),
        then drop finished rows from the batch so that no round is spent on them."""
        b.pending_host = tokens[np.arange(len(emit)), emit - 1]  # every running row emits >= 1 token
        b.lengths = b.lengths + emit
        b.cache.rollback(b.lengths)
        self._keep_rows(b, keep)

    def _keep_rows(self, b: Batch, keep: np.ndarray) -> None:
        """Only the rows `keep` (B,) bool stay in the batch (finished or cancelled ones leave), their
        cache back on the pool's buffers where the backend pools them."""
        if not keep.all():
            b.keep_rows(keep)
            if self._pool is not None:
                self._pool.home(b.cache)
        b.upload(b.steps.device)

    def _rounds_in_one_call(self, b: Batch, policy: DraftPolicy, rounds_per_call: int) -> bool:
        """Whether a row's rounds may run several in one call of the backend (`_greedy_rounds`): a backend
        with fused rounds, no exit block, a policy whose rounds fuse (`DraftPolicy.fuses`), and early-exit
        drafts only with a head the compiled draft loop reads. A round asks besides that its batch is one
        greedy row without a grammar (`Engine._fused_rounds`): rows join and leave."""
        if not self.backend.fused_rounds or b.exit_block is not None:
            return False
        return policy.fuses(rounds_per_call) and (not policy.drafts_early_exit or b.loop_head is not None)

    def _greedy_rounds(self, b: Batch, drafts: FusedDrafts, eos: np.ndarray, max_tokens: int,
                       max_rounds: int, stats: GenerationStats, policy: DraftPolicy,
                       laps: RoundProfile | None):
        """Up to `max_rounds` rounds of the batch's one row in one call of the backend
        (`Backend.greedy_rounds`), drafting as `drafts` says (the policy's k and copies), each round
        recorded in `stats` and shown to `policy` as the rounds from Python record them: (tokens (1, t)
        the row kept, emit (1,) = t, finished (1,): an eos or `max_tokens` reached, the call's
        `RoundCounts`), or None, nothing run, where the backend declines."""
        k = drafts.k
        head = b.loop_head if k else b.head.tensors()
        if head is None:
            return None
        drafts = dataclasses.replace(drafts, exit_layer=b.exit_layer, head=head, eta=b.stop_below)
        out = self.backend.greedy_rounds(int(b.pending_host[0]), b.cache, int(b.lengths[0]), drafts,
                                         torch.from_numpy(eos), max_tokens, max_rounds, b.overlap)
        if out is None:
            return None
        tokens, rounds, seconds = out
        if laps is not None:  # the call's own clock splits its time; the rest of it is acceptance
            laps.split({"draft passes": float(seconds[:, 0].sum()),
                        "verification pass": float(seconds[:, 1].sum())}, rest="acceptance")
        for (early, copied, accepted, _, ahead), (draft_time, verify_time) in zip(rounds.tolist(),
                                                                                 seconds.tolist()):
            segments = [Segment(source, start, length) for source, start, length in
                        (("early_exit", 0, early), ("copy", early, copied)) if length]
            if not segments:  # a plain step, also one whose first E blocks ran before η stopped the draft
                draft_time, verify_time = 0.0, draft_time + verify_time
            stats.stopped_below_eta += early < k and not (copied and not early)  # a copy round drafts no exit
            stats.drafted_ahead += ahead
            self._record(stats, segments, np.array([accepted]), draft_time, verify_time)
            policy.update(segments, np.array([accepted]), draft_time, verify_time)
        b.lap("statistics")
        finished = len(tokens) >= max_tokens or bool(len(tokens) and np.isin(tokens[-1], eos))
        early, copied, accepted = np.asarray(rounds, dtype=np.int64).reshape(-1, 5)[:, :3].sum(0)
        done = RoundCounts(np.array([len(rounds)]), np.array([early + copied]), np.array([accepted]))
        return np.asarray(tokens, dtype=np.int64)[None], np.array([len(tokens)]), np.array([finished]), done

    @staticmethod
    def _record(stats: GenerationStats, segments: list[Segment], accepted: np.ndarray, draft_time: float,
                verify_time: float) -> None:
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
    def _emit_counts(tokens, accepted, counts, max_new_tokens, eos):
        """Tokens each running row keeps from this round, cut after an eos and at the limit; finished rows."""
        emit = np.minimum(accepted + 1, max_new_tokens - counts)
        hit_eos = np.zeros(len(emit), dtype=bool)
        if eos.size:
            # (B, k+1, n_eos) compared at once: np.isin sorts, several times slower on a round's few tokens
            hits = (tokens[..., None] == eos).any(-1) & (np.arange(tokens.shape[1]) < emit[:, None])
            hit_eos = hits.any(1)
            emit = np.where(hit_eos, hits.argmax(1) + 1, emit)
        return emit, hit_eos | (counts + emit >= max_new_tokens)

    def _cut_at_stop_strings(self, stops, generated, rows, counts, emit) -> np.ndarray:
        """Shorten `emit` (in place) to end at the token completing one of its row's stop strings (`stops`,
        a tuple per slot); the slots that stop."""
        stopped = np.zeros(len(emit), dtype=bool)
        for slot, row in enumerate(rows):
            if not stops[slot]:
                continue
            tokens = generated[row, :counts[slot] + emit[slot]].tolist()
            if not any(s in self.tokenizer.decode(tokens) for s in stops[slot]):
                continue
            for end in range(counts[slot] + 1, len(tokens) + 1):
                if any(s in self.tokenizer.decode(tokens[:end]) for s in stops[slot]):
                    emit[slot] = end - counts[slot]
                    stopped[slot] = True
                    break
        return stopped

    # -- inputs --------------------------------------------------------------------------------------
    def _prompts(self, input_ids, attention_mask) -> list[list[int]]:
        if isinstance(input_ids, str) or (isinstance(input_ids, Sequence) and input_ids
                                          and all(isinstance(x, str) for x in input_ids)):
            if self.tokenizer is None:
                raise UserError("string prompts need a tokenizer: SelfSpecGenerator(model, tokenizer, ...)")
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
            raise UserError("every prompt needs at least one token")
        return prompts

    @staticmethod
    def _seeds(seed, rows: int, greedy: bool) -> list[int]:
        if seed is None:  # greedy needs no random numbers: leave torch's global generator alone
            seed = 0 if greedy else int(torch.randint(0, 2**31 - 1, ()))
        if isinstance(seed, int):
            return [seed + row for row in range(rows)]
        seeds = [int(s) for s in seed]
        if len(seeds) != rows:
            raise UserError(f"seed: got {len(seeds)} per-row seeds for {rows} prompts")
        return seeds

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a row by default: the generation config's, else the config's, else the
        tokenizer's (what `generate(eos_token_id=None)` uses)."""
        return self._eos_ids(None).tolist()

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
            raise UserError("stop_strings need a tokenizer: SelfSpecGenerator(model, tokenizer, ...)")
        return [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)


__all__ = ["GenerationOutput", "GenerationStats", "SelfSpecGenerator"]
