"""The timing harness the decoding evaluations share: the model on its device, the methods and a
runner of them, the one interleaved timing loop, and the engine's passes timed alone.

- `METHODS`: the ways to decode that the benchmark and the suite compare (see `benchmark`);
  `LoadedCheckpoint`: a model with what its checkpoint brings (`load_checkpoint`);
  `method_settings`: the `DecodeSettings` each engine method decodes with; `make_runner`: the engine
  and a runner of every method on a batch (the engine's methods through `SelfSpecGenerator.generate`,
  Hugging Face's through `model.generate`, `Structured` prompts under their grammar);
- `interleaved_rates`: every name on every batch, `warmup` untimed rounds then `repeats` timed ones,
  the order rotating so that drift hits all alike; it returns `Timings`, seconds, tokens and engine
  stats per name, timed round and batch, so any subset of batches gives its own rate;
- `measure_passes`: the passes a round runs (a plain step, a draft step, a verification of m
  positions, a whole-model pass) each timed alone on a cache holding a fixed context (`Passes`),
  for the roofline and the doctor.

A leaf of `evaluation/`: it stands on `prompts` alone, and no command's module imports another's.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..checkpoint import checkpoint_adapters
from ..cpu import sync_device
from ..decoding import DRAFTERS, DecodeSettings, SelfSpecGenerator
from ..decoding.cache import KVCache
from ..decoding.grammar import HFGrammarProcessor
from ..decoding.prefix import PrefixCache
from ..errors import UserError
from ..model.loading import load_causal_lm, load_tokenizer
from ..model.view import DecoderView
from .prompts import Structured

METHODS = ("plain", "early_exit", "ngram", "hybrid", "hf_greedy", "hf_early_exit", "hf_prompt_lookup",
           "hf_draft")
DEFAULT_METHODS = METHODS[:-1]  # hf_draft needs an exported draft (`--draft`)
ENGINE_METHODS = ("plain", *DRAFTERS)  # selfspec's engine; each drafter is a method of its own name
HF_BATCH1_METHODS = ("hf_early_exit", "hf_prompt_lookup", "hf_draft")  # Hugging Face's assisted generation
PROMPT_LOOKUP_TOKENS = 10  # Hugging Face's documented example value


def constraint_keywords(constraints: list) -> dict:
    """`generate`'s per-row keyword lists (json_schema, regex, grammar) of a batch's constraints
    (None: a free row); {} when no row is constrained."""
    if all(c is None for c in constraints):
        return {}
    out = {"json_schema": [None] * len(constraints), "regex": [None] * len(constraints),
           "grammar": [None] * len(constraints)}
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            (keyword, text), = constraint.keywords().items()
            out[keyword][row] = text
    return out


def load_model(path: str, device: str | None = None, dtype: str = "auto"):
    """`AutoModelForCausalLM` + `AutoTokenizer` from `path` in eval mode, on CUDA when there is one.

    dtype "auto": float32 on CPU, the checkpoint's own dtype on accelerators.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(path, dtype=dtype, device=device, huge_pages=True).eval()
    return model, load_tokenizer(path)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A model as the evaluations decode it, with what its checkpoint brings: the settings it decodes at
    (`checkpoint.resolve_settings`, flags applied), each drafter's fastest a sweep stored, the token
    counts of a trimmed draft head (V' > 0) and its exit adapters ({E: adapter},
    `checkpoint.checkpoint_adapters`). A model built in Python needs only the first two."""

    model: Any
    settings: DecodeSettings
    tokenizer: Any = None
    fastest: dict[str, DecodeSettings] | None = None
    token_counts: Any = None
    exit_adapters: dict | None = None


def load_checkpoint(path: str, settings: DecodeSettings, fastest: dict | None = None, token_counts=None, *,
                    device: str | None = None, dtype: str = "auto") -> LoadedCheckpoint:
    """The model at `path` on `device` (`load_model`) with its tokenizer and exit adapters, to decode at
    `settings` (and each drafter at its `fastest`: `resolve_settings`'s three values)."""
    model, tokenizer = load_model(path, device, dtype)
    adapters = checkpoint_adapters(path, model)
    return LoadedCheckpoint(model, settings, tokenizer, fastest, token_counts, adapters)


def method_settings(settings: DecodeSettings, fastest: dict[str, DecodeSettings] | None = None
                    ) -> dict[str, DecodeSettings]:
    """What each engine method decodes with: "plain" is `settings` at k = 0; each drafter runs at
    its fastest (`fastest`, as a sweep stored them) or else at `settings` with that drafter."""
    fastest = fastest or {}
    out = {"plain": settings.override(drafter="early_exit", num_speculations=0)}
    out.update({drafter: fastest.get(drafter) or settings.override(drafter=drafter) for drafter in DRAFTERS})
    return out


class _Runner:
    """Runs one method on one batch: returns the generated tokens and, for the engine, its stats."""

    def __init__(self, generator: SelfSpecGenerator, settings: dict[str, DecodeSettings], max_new_tokens: int,
                 keep_eos: bool, profile: bool = False, draft=None, sampling: dict | None = None):
        self.generator, self.model, self.settings = generator, generator.model, settings
        # `generate`'s sampling keywords (temperature, top_k, top_p, seed); {}: greedy
        self.sampling = {k: v for k, v in (sampling or {}).items() if k != "seed" or v is not None}
        self.draft = draft  # hf_draft's assistant model (an exported draft), or None
        self.shared: dict[tuple, int] = {}  # prompt -> positions it shares with another (`share_prefixes`)
        self.engine_calls = self.cached_tokens = 0  # the engine's calls, and the positions they loaded
        self.max_new_tokens, self.profile = max_new_tokens, profile
        self.eos = None if keep_eos else []  # [] never stops early; None: the model's eos
        self.device = generator.view.device
        # Only silences generate()'s warning for prompts without padding; the model's own when it has one.
        config = getattr(self.model, "generation_config", None)
        self.pad_token_id = next((t for t in (getattr(config, "pad_token_id", None),
                                              getattr(config, "eos_token_id", None))
                                  if isinstance(t, int)), 0)

    def share_prefixes(self, prompts: list) -> None:
        """With a prefix cache: note for every prompt the longest prefix it shares with another of
        `prompts`, which `prepare` puts in the cache before each timed call."""
        ids = [p.ids if isinstance(p, Structured) else p for p in prompts]
        for i, prompt in enumerate(ids):
            common = [len(os.path.commonprefix([prompt, other])) for j, other in enumerate(ids) if j != i]
            self.shared[tuple(prompt)] = min(max(common, default=0), len(prompt) - 1)

    def prepare(self, method: str, batch: list) -> None:
        """Before a timed call (untimed): with a prefix cache, empty it, then let it hold what a server
        that had already answered the other prompts would hold for this batch: each prompt's prefix
        shared with another (`share_prefixes`), prefilled under the method's own settings (the
        cache's layout follows them). The rest of the prompt is the timed call's to prefill."""
        cache = self.generator.prefix_cache
        if cache is None or method not in self.settings:
            return
        cache.clear()
        for prompt in batch:
            ids = prompt.ids if isinstance(prompt, Structured) else prompt
            shared = self.shared.get(tuple(ids), 0)
            if shared >= cache.chunk:
                self.generator.generate([list(ids[:shared + 1])], max_new_tokens=1,
                                        settings=self.settings[method])

    def __call__(self, method: str, batch: list):
        """Decode one batch of prompts (token lists, or `Structured` ones) with `method`: (tokens per row,
        engine stats or None)."""
        constraints = [p.constraint if isinstance(p, Structured) else None for p in batch]
        batch = [p.ids if isinstance(p, Structured) else p for p in batch]
        if method in self.settings:  # the engine: a drafter, plain, or a sweep's candidate cell
            cache = self.generator.prefix_cache
            before = cache.hit_tokens if cache is not None else 0
            out = self.generator.generate(batch, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                                          settings=self.settings[method], profile=self.profile,
                                          **self.sampling, **constraint_keywords(constraints))
            self.engine_calls += 1
            self.cached_tokens += (cache.hit_tokens - before) if cache is not None else 0
            return out.sequences, out.stats
        if len({len(p) for p in batch}) > 1:
            raise UserError("Hugging Face methods in a batch need prompts of one length; use "
                            "--methods plain,early_exit or --batch-size 1")
        ids = torch.tensor(batch, device=self.device)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                      pad_token_id=self.pad_token_id, **self.hf_sampling())
        if self.eos == []:
            kwargs["eos_token_id"] = None
        if constraints[0] is not None:  # the same grammar as a logits processor, batch 1
            if len(batch) > 1:
                raise UserError("Hugging Face methods under a grammar decode batch 1; pass --batch-size 1")
            processor = HFGrammarProcessor(self.generator.grammar_tokenizer(), constraints[0])
            kwargs.update(logits_processor=[processor], stopping_criteria=[processor.stopping()])
        if method == "hf_early_exit":  # Hugging Face's self-speculation at the early exit's own E
            kwargs["assistant_early_exit"] = self.settings["early_exit"].exit_layer
        elif method == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        elif method == "hf_draft":  # a separate draft model, at Hugging Face's own draft-length schedule
            kwargs["assistant_model"] = self.draft
        with torch.inference_mode():
            out = self.model.generate(ids, **kwargs)
        if constraints[0] is not None:
            return [processor.completed(out)], None
        return out[:, ids.shape[1]:].tolist(), None


    def hf_sampling(self) -> dict:
        """Hugging Face's `generate` keywords for the same sampling (its own random numbers, seeded from
        the run's seed: a sampled decode is timed, not compared token for token)."""
        temperature = self.sampling.get("temperature", 0)
        if not temperature:
            return {"do_sample": False}
        torch.manual_seed(self.sampling.get("seed", 0))
        return {"do_sample": True, "temperature": temperature, "top_k": self.sampling.get("top_k", 0),
                "top_p": self.sampling.get("top_p", 1.0)}


def check_methods(methods, batch_size: int, draft: str | None = None) -> None:
    """Every method known, a draft for hf_draft, and batch 1 for Hugging Face's assisted generation;
    else a UserError."""
    for method in methods:
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if batch_size < 1:
        raise UserError(f"the batch size must be >= 1, got {batch_size}")
    batch1_only = [m for m in methods if m in HF_BATCH1_METHODS]
    if batch_size > 1 and batch1_only:
        raise UserError(f"Hugging Face's assisted generation decodes batch 1 only; "
                        f"leave {', '.join(batch1_only)} out of --methods for --batch-size > 1")
    if "hf_draft" in methods and draft is None:
        raise UserError("--methods hf_draft needs --draft DIR: a draft written by `selfspec export MODEL "
                        "--draft DIR`")


def make_runner(checkpoint: LoadedCheckpoint, *, max_new_tokens: int = 128, keep_eos: bool = False,
                profile: bool = False, static_passes: str | None = None, backend: str | None = None,
                prefix_cache: bool = False, draft: str | None = None,
                sampling: dict | None = None) -> _Runner:
    """The engine over the checkpoint's model and a runner of every method: the engine methods at
    `method_settings`, always `max_new_tokens` new tokens unless `keep_eos`, profiling their rounds with
    `profile` (`decoding.profile`), on `backend` (static passes with `static_passes`), prefilling through a
    `PrefixCache` with `prefix_cache`; `draft`: an exported draft's directory, hf_draft's assistant model,
    loaded on the model's device at its dtype; `sampling`: `generate`'s sampling keywords
    (`SamplingOptions.sampling_keywords`), every method sampling alike (None: greedy)."""
    generator = SelfSpecGenerator(checkpoint.model, checkpoint.tokenizer, checkpoint.settings,
                                  token_counts=checkpoint.token_counts,
                                  exit_adapters=checkpoint.exit_adapters,
                                  static_passes=static_passes, backend=backend,
                                  prefix_cache=PrefixCache() if prefix_cache else None)
    generator.check_cache = False  # as in the sweep: a timed run does no per-round bookkeeping
    settings = {m: generator.settings_for(s)
                for m, s in method_settings(generator.settings, checkpoint.fastest).items()}
    assistant = None
    if draft is not None:
        view = generator.view
        assistant = load_causal_lm(draft, dtype=str(view.dtype).removeprefix("torch."), device=view.device,
                                   huge_pages=True).eval()
    return _Runner(generator, settings, max_new_tokens, keep_eos, profile, assistant, sampling)


@dataclass
class Timings:
    """What `interleaved_rates` measured, per name: each timed round's seconds, tokens and engine
    stats per batch ([round][batch]), and the last round's outputs (rows per batch)."""

    seconds: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)

    def rates(self, name, batches=None) -> list[float]:
        """Tokens/s of `name` in each timed round over `batches` (indices; all when None): all their
        rows' tokens ÷ their summed time."""
        rates = []
        for seconds, tokens in zip(self.seconds[name], self.tokens[name]):
            chosen = range(len(seconds)) if batches is None else batches
            rates.append(sum(tokens[b] for b in chosen) / max(sum(seconds[b] for b in chosen), 1e-9))
        return rates

    def run_stats(self, name, batches=None) -> list:
        """The engine stats of `name`'s timed runs of `batches` (all when None); [] for Hugging Face."""
        return [s for per_batch in self.stats[name]
                for b, s in enumerate(per_batch) if s is not None and (batches is None or b in batches)]

    def extend(self, other: Timings) -> None:
        """Append `other`'s batches (the same names and number of rounds) after this one's."""
        for name in other.seconds:
            if name not in self.seconds:
                self.seconds[name] = [[] for _ in other.seconds[name]]
                self.tokens[name] = [[] for _ in other.tokens[name]]
                self.stats[name] = [[] for _ in other.stats[name]]
                self.outputs[name] = []
            for mine, theirs in ((self.seconds, other.seconds), (self.tokens, other.tokens),
                                 (self.stats, other.stats)):
                for round_mine, round_theirs in zip(mine[name], theirs[name]):
                    round_mine.extend(round_theirs)
            self.outputs[name].extend(other.outputs[name])


def interleaved_rates(names, run, batches: list[list[list[int]]], repeats: int, warmup: int, device,
                      progress: str | None = None, bar_per_name: bool = False, prepare=None) -> Timings:
    """Time `run(name, batch) -> (tokens per row, stats or None)` for every name on every batch, interleaved.

    `warmup` untimed rounds, then `repeats` timed ones; in each round every batch of prompts is
    decoded by every name, the order of names rotating from batch to batch and round to round so that
    drift hits all alike. `progress`: a tqdm bar's label (None: no bar); `bar_per_name`: one bar per
    name instead, each with its own rate and ETA. `prepare(name, batch)`: called before each run,
    outside its time.
    """
    names = list(names)
    if repeats < 1:
        raise UserError(f"repeats must be >= 1, got {repeats}")
    timings = Timings(*({n: [] for n in names} for _ in range(3)), {n: [None] * len(batches) for n in names})
    total = (warmup + repeats) * len(batches)
    if progress is not None and bar_per_name:
        bars = {n: tqdm(total=total, desc=f"{progress} {n}", position=i, leave=True, unit="prompt")
                for i, n in enumerate(names)}
    else:
        bar = tqdm(total=total * len(names), desc=progress, disable=progress is None, unit="run")
        bars = dict.fromkeys(names, bar)
    for round_index in range(warmup + repeats):
        timed = round_index >= warmup
        if timed:
            for store in (timings.seconds, timings.tokens, timings.stats):
                for name in names:
                    store[name].append([])
        for b, batch in enumerate(batches):
            shift = (round_index + b) % len(names)
            for name in names[shift:] + names[:shift]:
                if prepare is not None:
                    prepare(name, batch)
                sync_device(device)
                start = time.perf_counter()
                rows, run_stats = run(name, batch)
                sync_device(device)
                seconds = time.perf_counter() - start
                timings.outputs[name][b] = rows
                if timed:
                    timings.seconds[name][-1].append(seconds)
                    timings.tokens[name][-1].append(sum(len(row) for row in rows))
                    timings.stats[name][-1].append(run_stats)
                bars[name].update()
    for bar in set(bars.values()):
        bar.close()
    return timings


class Passes:
    """Timed passes over a cache that holds `context` positions; every pass writes after them and
    then rolls the cache back, so each one sees the same context."""

    def __init__(self, view: DecoderView, context: int, max_positions: int):
        self.view, self.context = view, context
        self.cache = KVCache(view.num_layers, 1, context + max_positions)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, view.config.vocab_size, (1, context), generator=generator).to(view.device)
        positions = view.default_positions(ids)
        self.cache.set_positions(positions, [0])
        with torch.inference_mode():
            hidden = view.embed(ids, positions)
            view.run_layers(hidden, 0, view.num_layers, self.cache, positions, aligned=True)
        self.ids = ids

    def run(self, start: int, end: int, length: int) -> None:
        """`length` positions after the context through blocks [start, end) and the head."""
        view, cache = self.view, self.cache
        ids = self.ids[:, :length]
        positions = view.default_positions(ids, self.context)
        kv_length = cache.set_positions(positions, [self.context])
        with torch.inference_mode():
            hidden = view.embed(ids, positions)
            hidden = view.run_layers(hidden, start, end, cache, positions, kv_length=kv_length, aligned=True)
            view.exit_logits(hidden)
        cache.lengths[:] = self.context  # roll back: the next pass sees the same context


def measure_passes(view: DecoderView, exit_layer: int, context: int = 256, positions=range(1, 9),
                   repeats: int = 15, warmup: int = 3, probes: dict | None = None) -> dict:
    """Median seconds of each pass, through the engine's blocks (`DecoderView`) on a cache holding
    `context` positions: "plain" (1 position through all N blocks + head), "draft" (1 position through
    blocks [0, E) + head), f"verify_{m}" (blocks [E, N) + head on m positions) and f"full_{m}" (a
    whole-model pass of m positions) for m in `positions`, interleaved over `repeats` rounds after
    `warmup` untimed ones. Each callable of `probes` (name -> fn) joins the rotation and its median
    comes back under its name (`{"seconds": ...}`): a bandwidth probe timed beside the passes sees the
    machine they see."""
    n = view.num_layers
    positions = sorted(set(positions))
    passes = {"plain": (0, n, 1), "draft": (0, exit_layer, 1)}
    passes.update({f"verify_{m}": (exit_layer, n, m) for m in positions})
    passes.update({f"full_{m}": (0, n, m) for m in positions if m > 1})
    runner = Passes(view, context, max(positions))
    tasks = {name: (lambda spec=spec: runner.run(*spec)) for name, spec in passes.items()}
    tasks.update(probes or {})
    names = list(tasks)
    times = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            sync_device(view.device)
            start = time.perf_counter()
            tasks[name]()
            sync_device(view.device)
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    report = {name: {"seconds": statistics.median(times[name])} for name in names}
    for name, (start, end, length) in passes.items():
        report[name].update({"blocks": [start, end], "positions": length})
    return report


__all__ = ["DEFAULT_METHODS", "ENGINE_METHODS", "METHODS", "Passes", "Timings", "check_methods",
           "constraint_keywords", "interleaved_rates", "load_model", "make_runner", "measure_passes",
           "method_settings"]
