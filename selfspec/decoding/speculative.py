"""`SelfSpecGenerator`: self-speculative decoding over a Hugging Face causal LM, lossless, any batch size.

The facade a user holds: it loads nothing itself (`load_tuned` does), resolves what a call asks for
(`generate(input_ids, config, **overrides)`, `chat`, a streamer, the drafting settings) and runs it as
an `Engine` (`engine.py`) over the model's `Runner` (`runner.py`), which owns the round: drafts, one
verification, the accepted prefix. `engine()` hands the caller a decode to step (a server's loop).
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from ..backends import make_backend
from ..cpu import release_freed_memory
from ..errors import UserError
from ..model import DecoderView
from ..sampling import SamplingParams
from .controller import Controller
from .costs import CostGate, RoundCosts
from .draft_head import DraftHead
from .engine import CallOptions, ContextSwitch, Engine
from .generation import GenerationConfig
from .grammar import GrammarTokenizer, constraints_for_rows
from .lanes import Lanes
from .ngram import TokenText
from .outputs import GenerationOutput, GenerationStats, NewRow, RoundOutput
from .policy import DraftPolicy
from .prefix import PrefixCache
from .runner import Runner
from .settings import DecodeSettings, context_picks, sampled_pick


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
        never reads them); format_settings: {constraint kind:
        settings}, the default of a `generate` call whose constrained rows all have that kind
        ("json_schema", "regex", "lark"), as a sweep on such prompts stored it; under `SAMPLED`
        ("sampled@T") the default of an unconstrained sampled call (temperature > 0); under "context@T"
        (`context_key`) the settings a greedy decode at the generator's own settings switches to once its
        longest context reaches T tokens (`engine.ContextSwitch`): an unconstrained `generate` call, and the
        greedy lane of `engine()`, whose rows may bring constraints (lossless either way).
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
                 prefix_cache: PrefixCache | None = None, **overrides):
        view = DecoderView(model)
        self.tokenizer, self.view = tokenizer, view
        self.backend = make_backend(view, backend, static_passes)
        self.static_passes = static_passes  # as given (the backend knows its mode)
        self.token_counts = token_counts
        # the model's measured `RoundCosts` on this device (`costs.py`; what `selfspec eval sweep` stores,
        # `load_tuned` sets), or None: with them each round's k passes a `CostGate`, which drafts only
        # where drafting pays at the row's context length and takes plain steps elsewhere
        self.round_costs: RoundCosts | None = None
        # the model's round machinery: its draft heads and compiled grammars are reused; each engine steps
        # a runner of its own (`Runner.for_engine`)
        self.runner = Runner(view, self.backend, tokenizer, self._eos_ids(None).tolist(),
                             token_counts=token_counts, exit_adapters=exit_adapters,
                             prefix_cache=prefix_cache)
        settings = (settings or DecodeSettings()).override(**overrides)
        self.settings = self.settings_for(settings)
        self.format_settings = {kind: self.settings_for(s) for kind, s in (format_settings or {}).items()}

    @property
    def model(self):
        return self.view.model

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache prompts prefill through (`Runner.prefix_cache`), or None; settable."""
        return self.runner.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        self.runner.prefix_cache = cache

    @property
    def check_cache(self) -> bool:
        """Whether every round asserts that each layer's cache length equals the sequence length (on by
        default; a timed run turns it off: `Runner.check_cache`); settable."""
        return self.runner.check_cache

    @check_cache.setter
    def check_cache(self, check: bool) -> None:
        self.runner.check_cache = check

    @property
    def exit_adapters(self) -> dict:
        return self.runner.exit_adapters

    @property
    def fixed_width(self) -> bool:
        """Whether every decoding pass runs at one width (a bf16/fp16 model: `Runner.fixed_width`)."""
        return self.runner.fixed_width

    @property
    def token_text(self) -> TokenText | None:
        """The vocabulary's pieces for copies matched on the text (`Runner.token_text`)."""
        return self.runner.token_text

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """llguidance's index of the tokenizer (structured output), built on first use."""
        return self.runner.grammar_tokenizer()

    def draft_head(self, settings: DecodeSettings | None = None) -> DraftHead:
        """The draft head of `settings` (default the generator's): its E's MLP adapter, its V' ids."""
        return self.runner.draft_head(settings or self.settings)

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
        own = (settings is None and constraints is None and config.temperature == 0
               and config.drafter is None and config.num_speculations is None)
        if settings is None and len(kinds) == 1 and kinds <= self.format_settings.keys():
            settings = self.format_settings[kinds.pop()]  # the format's own fastest
        elif settings is None and not kinds and config.temperature > 0:
            settings = self._sampled_settings(config.temperature)
        settings, policy = self._resolve(settings, config.drafter, config.num_speculations)
        if self.view.model.training:
            warnings.warn("the model is in training mode (dropout on): outputs will not match eval mode",
                          stacklevel=2)
        stops = tuple(self._stop_strings(config.stop_strings) or ())
        options = CallOptions(settings, SamplingParams(config.temperature, config.top_k, config.top_p),
                              self._eos_ids(config.eos_token_id), stops, config.seed,
                              grammar=constraints is not None, draft_max_rows=config.draft_max_rows,
                              watched=streamer is not None or bool(stops), profile=config.profile,
                              switches=self._context_switches() if own else ())
        engine = Engine(self.runner.for_engine(), policy, options)
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
                                None if constraints is None else [c is None for c in constraints],
                                ["length"] * len(prompts))

    def engine(self, settings: DecodeSettings | None = None, *, sampling: SamplingParams | None = None,
               eos_token_id=None, structured: bool = False, rounds_per_step: int = 1,
               draft_max_rows: int | None = None) -> Lanes:
        """A decode to step yourself (`lanes.Lanes`, as an `engine.Engine`): `add(NewRow(prompt,
        max_new_tokens, seed, ..., sampling=SamplingParams(...)))` returns the row, `step()` runs a round
        and returns each running row's `RoundOutput`, `cancel(row)` ends one, `output()` gives what
        `generate` returns. Each row brings its own sampling settings, seed, stop strings and constraint,
        or takes the engine's; greedy and sampled rows decode in two batches of their own.
        settings: how to draft (default: the generator's for greedy rows, and for sampled rows the
        checkpoint's sampled pick nearest the first one's temperature, as `generate` decodes them);
        sampling: the rows' that bring none (None: greedy); structured: the rows start under a grammar (a
        row that brings a constraint opens it); rounds_per_step: a lone row's rounds per step where the
        CPU kernels run them in one call (its first step one round); draft_max_rows: as `generate`'s."""
        eos = self._eos_ids(eos_token_id)

        def lane(sampled: bool, first: SamplingParams) -> Engine:
            chosen = self._sampled_settings(first.temperature) if settings is None and sampled else settings
            resolved, policy = self._resolve(chosen, None, None)
            own = settings is None and not sampled and not structured
            options = CallOptions(resolved, sampling or SamplingParams(), eos, grammar=structured,
                                  rounds_per_step=rounds_per_step, draft_max_rows=draft_max_rows,
                                  switches=self._context_switches() if own else ())
            return Engine(self.runner.for_engine(), policy, options)

        return Lanes(lane, sampling or SamplingParams())

    def _sampled_settings(self, temperature: float) -> DecodeSettings | None:
        """A sampled sweep's pick for calls at `temperature` (the stored one nearest it, `sampled_pick`), or
        None where the checkpoint has none."""
        picked = sampled_pick(self.format_settings, temperature)
        return None if picked is None else self.format_settings[picked]

    def _context_switches(self) -> tuple[ContextSwitch, ...]:
        """The long-context picks stored for greedy decodes at the generator's settings (`context_picks`),
        as `ContextSwitch`es with fresh policies, by ascending context."""
        return tuple(ContextSwitch(at, *self._resolve(self.format_settings[key], None, None))
                     for at, key in context_picks(self.format_settings))

    def chat(self, messages, **kwargs) -> GenerationOutput:
        """Reply to a conversation, a list of {"role", "content"} messages (or to a list of
        conversations, one row each), through the tokenizer's chat template with the generation
        prompt; keywords as `generate`'s. The texts leave out special tokens (the end of the turn)."""
        if not messages:
            raise UserError("chat needs a conversation: a list of {'role', 'content'} messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        return self.generate([self.chat_prompt(c) for c in conversations], **kwargs)

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
        costs = self.round_costs
        gate = None if costs is None else CostGate(costs, costs.applies_to(settings.exit_layer,
                                                                           settings.draft_vocab_size))
        return settings, settings.policy(controller, gate)

    def release_memory(self) -> None:
        """Forget what is kept only for reuse (compiled constraints), collect the garbage cycles and
        return the heap's free pages to the kernel (`cpu.release_freed_memory`): what a server does when
        it falls idle. The collection first: a refused grammar's exception holds the frames that hold
        its matcher (tens of MiB for `^a{1000000}$`) in a cycle, which an idle process, allocating
        nothing, would not collect."""
        self.runner.forget_compiled()
        gc.collect()
        release_freed_memory()

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
