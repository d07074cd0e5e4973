"""Speed benchmark: the engine plain vs self-speculative vs Hugging Face's generators, in one process.

Ways to decode the same prompts greedily, batch 1, the same number of new tokens (each engine method
at its own `DecodeSettings`, see `method_settings`):

- ``plain``: `SelfSpecGenerator.generate(num_speculations=0)`, the same engine, one full forward per
  token on the same cache: the fair baseline;
- ``early_exit``: the engine's early-exit drafts at (exit_layer E, num_speculations k or "auto");
- ``ngram``: the engine drafting only by copying from the context (n-gram lookup), plain steps
  when nothing matches: prompt lookup on selfspec's engine;
- ``hybrid``: copies when the context has a match, early-exit drafts otherwise (`decoding/policy.py`);
- ``hf_greedy``: `model.generate(do_sample=False)`;
- ``hf_early_exit``: `model.generate(assistant_early_exit=E)`, Hugging Face's self-speculation: its
  `EarlyExitCandidateGenerator` drafts by temporarily lowering `config.num_hidden_layers` to E and
  keeps a separate assistant cache, so the draft blocks run again during verification (batch 1 only;
  GPT-2 ignores `num_hidden_layers`, so there the "draft" is the whole model);
- ``hf_prompt_lookup``: `model.generate(prompt_lookup_num_tokens=10)`, Hugging Face's prompt lookup
  decoding: drafts copied from the context by n-gram matching, free to propose, verified by the full
  model (batch 1 only). The tool a user would otherwise pick for code and other repetitive text.

Timing: `warmup` untimed passes, then `repeats` rounds; inside a round every prompt is decoded by
every method, the method order rotating from round to round (interleaved, so drift in clocks or
thermals hits all methods alike). Each method's tokens/s is the median over rounds of (tokens of all
prompts ÷ their summed wall time, device synchronised). Speedups are ratios of medians.

Reported next to the measured speedup: α, mean accepted length (bonus counted), the draft cost c
measured as (engine's draft time per step in the early_exit run) ÷ (engine's time per plain step in
the plain run), and the cost model's predictions from those (see `selfspec.metrics`). Greedy outputs of
every method but hf_early_exit must be identical; hf_early_exit's are checked and
reported too.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..checkpoint import checkpoint_adapters, resolve_settings, sweep_candidates
from ..cpu import sync_device
from ..decoding import DRAFTERS, DecodeSettings, SelfSpecGenerator
from ..decoding.grammar import Constraint, HFGrammarProcessor, read_constraint
from ..decoding.prefix import PrefixCache
from ..decoding.speculative import SOURCES
from ..errors import UserError
from ..metrics import (
    AcceptanceStats,
    break_even_acceptance,
    predicted_speedup,
    speedup_kv_reuse,
    speedup_measured_costs,
)
from ..model.loading import load_causal_lm, load_tokenizer
from .doctor import cost_figures, summary, weight_cost, weights_in_cache
from .paired import median_interval, paired_speedups
from .report import write_report as write_files
from .results import BenchmarkReport
from .rounds import round_profile
from .rounds import to_markdown as profile_markdown

METHODS = ("plain", "early_exit", "ngram", "hybrid", "hf_greedy", "hf_early_exit", "hf_prompt_lookup")
ENGINE_METHODS = ("plain", *DRAFTERS)  # selfspec's engine; each drafter is a method of its own name
HF_BATCH1_METHODS = ("hf_early_exit", "hf_prompt_lookup")  # Hugging Face's assisted generation: batch 1 only
PROMPT_LOOKUP_TOKENS = 10  # Hugging Face's documented example value


@dataclass(frozen=True)
class Structured:
    """A prompt (token ids) whose reply follows `constraint` (structured output). The runner decodes
    it under the grammar: the engine methods with `generate(json_schema=...)`, Hugging Face's with
    the same llguidance masks as a logits processor (`HFGrammarProcessor`, batch 1)."""

    ids: list
    constraint: Constraint


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


def prompts_from_corpus(tokenizer, source: str = "stdlib", num_prompts: int = 8, prompt_tokens: int = 64,
                        split: str = "test", text_field: str = "text") -> list[list[int]]:
    """`prompt_tokens` tokens from the middle of each of the first `num_prompts` documents of a split.

    The middle, not the start: the first tokens of source files are mostly license headers and
    module docstrings, while the workload is completing code in the middle of a file.
    source: anything `selfspec.data.load_text_corpus` takes ("stdlib", files, a dataset name).
    Documents shorter than 2 x `prompt_tokens` tokens are skipped.
    """
    from ..data import load_text_corpus

    prompts = []
    for text in load_text_corpus(source, text_field=text_field)[split][text_field]:
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= 2 * prompt_tokens:
            middle = len(ids) // 2
            prompts.append(ids[middle - prompt_tokens:middle])
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise UserError(f"no document of {source!r} split {split!r} has {2 * prompt_tokens} tokens or more")
    return prompts


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
                 ignore_eos: bool, profile: bool = False):
        self.generator, self.model, self.settings = generator, generator.model, settings
        self.shared: dict[tuple, int] = {}  # prompt -> positions it shares with another (`share_prefixes`)
        self.engine_calls = self.cached_tokens = 0  # the engine's calls, and the positions they loaded
        self.max_new_tokens, self.profile = max_new_tokens, profile
        self.eos = [] if ignore_eos else None
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
                                          **constraint_keywords(constraints))
            self.engine_calls += 1
            self.cached_tokens += (cache.hit_tokens - before) if cache is not None else 0
            return out.sequences, out.stats
        if len({len(p) for p in batch}) > 1:
            raise UserError("Hugging Face methods in a batch need prompts of one length; use "
                            "--methods plain,early_exit or --batch-size 1")
        ids = torch.tensor(batch, device=self.device)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                      do_sample=False, pad_token_id=self.pad_token_id)
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
        with torch.inference_mode():
            out = self.model.generate(ids, **kwargs)
        return out[:, ids.shape[1]:].tolist(), None


def check_methods(methods, batch_size: int) -> None:
    """Every method known, and batch 1 for Hugging Face's assisted generation; else a UserError."""
    for method in methods:
        if method not in METHODS:
            raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if batch_size < 1:
        raise UserError(f"the batch size must be >= 1, got {batch_size}")
    batch1_only = [m for m in methods if m in HF_BATCH1_METHODS]
    if batch_size > 1 and batch1_only:
        raise UserError(f"Hugging Face's assisted generation decodes batch 1 only; "
                        f"leave {', '.join(batch1_only)} out of --methods for --batch-size > 1")


def make_runner(model, settings: DecodeSettings, *, tokenizer=None, fastest=None, token_counts=None,
                exit_adapters=None, max_new_tokens: int = 128, ignore_eos: bool = True,
                profile: bool = False, static_passes: str | None = None,
                prefix_cache: bool = False) -> _Runner:
    """The engine over `model` and a runner of every method: the engine methods at `method_settings`,
    profiling their rounds with `profile` (`decoding.profile`), on static passes with `static_passes`,
    prefilling through a `PrefixCache` with `prefix_cache`."""
    # check_cache=False as in the sweep: a timed run does no per-round bookkeeping
    generator = SelfSpecGenerator(model, tokenizer, settings, token_counts=token_counts,
                                  exit_adapters=exit_adapters, check_cache=False, static_passes=static_passes,
                                  prefix_cache=PrefixCache() if prefix_cache else None)
    settings = {m: generator.settings_for(s) for m, s in method_settings(generator.settings, fastest).items()}
    return _Runner(generator, settings, max_new_tokens, ignore_eos, profile)


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


def run_benchmark(model, prompts: list[list[int]], settings: DecodeSettings, *, tokenizer=None,
                  fastest: dict[str, DecodeSettings] | None = None, token_counts=None,
                  exit_adapters: dict | None = None,
                  max_new_tokens: int = 128, repeats: int = 5, warmup: int = 1, ignore_eos: bool = True,
                  methods: tuple[str, ...] = METHODS, batch_size: int = 1, progress: bool = False,
                  profile: bool = False, static_passes: str | None = None,
                  candidates: list[tuple[str, DecodeSettings, float]] | None = None,
                  prefix_cache: bool = False) -> BenchmarkReport:
    """Measure `methods` on `prompts` (token lists), `batch_size` prompts per call; returns the report
    as a dict (see module docstring). The engine methods decode at `settings`, each drafter at its
    own fastest when `fastest` names one (`method_settings`). token_counts: the ranking of a trimmed
    draft head's ids (V' > 0); exit_adapters: {E: ExitAdapter} of the checkpoint; profile: add the
    engine methods' round profile (`rounds.round_profile`); static_passes: the engine's passes at fixed
    shapes (`SelfSpecGenerator`). candidates: a sweep's re-timed cells (`checkpoint.sweep_candidates`),
    timed here too, interleaved with the methods: `candidate_report`. prefix_cache: the engine
    prefills through a `PrefixCache` that holds, before each timed call, the prompt's prefix shared
    with another prompt of the set (`_Runner.prepare`: what a server would have cached)."""
    check_methods(methods, batch_size)
    if max_new_tokens < 1 or not prompts:
        raise UserError(f"the benchmark needs max_new_tokens >= 1 ({max_new_tokens}) and a prompt "
                        f"({len(prompts)})")
    if candidates and "plain" not in methods:
        raise UserError("--candidates are judged against plain decoding: keep plain in --methods")
    run = make_runner(model, settings, tokenizer=tokenizer, fastest=fastest, token_counts=token_counts,
                      exit_adapters=exit_adapters, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                      profile=profile, static_passes=static_passes, prefix_cache=prefix_cache)
    run.share_prefixes(prompts)
    generator, settings = run.generator, run.settings
    device, view = run.device, generator.view
    cells = {f"{drafter} cell {i + 1}": (drafter, generator.settings_for(cell), sweep_speedup)
             for i, (drafter, cell, sweep_speedup) in enumerate(candidates or [])}
    run.settings.update({name: cell for name, (_, cell, _) in cells.items()})
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    timings = interleaved_rates([*methods, *cells], run, batches, repeats, warmup, device,
                                "benchmark" if progress else None, prepare=run.prepare)
    rates, outputs = {m: timings.rates(m) for m in methods}, timings.outputs
    stats = {m: timings.run_stats(m) for m in methods}

    report = {"max_new_tokens": max_new_tokens, "num_prompts": len(prompts), "batch_size": batch_size,
              "repeats": repeats, "warmup": warmup, "device": str(device),
              "dtype": str(view.dtype).replace("torch.", ""), "num_layers": view.num_layers,
              "settings": {m: settings[m].to_json() for m in methods if m in ENGINE_METHODS},
              "methods": {}}
    for method in methods:
        report["methods"][method] = {"tokens_per_second": statistics.median(rates[method]),
                                     "tokens_per_second_all": rates[method]}
        if "plain" in methods:  # paired with plain in each repeat: the median and its interval
            report["methods"][method]["over_plain"] = median_interval(paired_speedups(rates[method],
                                                                                      rates["plain"]))
    tps = {m: report["methods"][m]["tokens_per_second"] for m in methods}
    report["speedups"] = {f"{a}_over_{b}": tps[a] / tps[b] for a, b in (
        ("hybrid", "hf_prompt_lookup"), ("hybrid", "plain"), ("hybrid", "early_exit"), ("hybrid", "ngram"),
        ("ngram", "hf_prompt_lookup"), ("ngram", "plain"),
        ("early_exit", "plain"), ("early_exit", "hf_early_exit"), ("early_exit", "hf_prompt_lookup"),
        ("plain", "hf_greedy"), ("early_exit", "hf_greedy"), ("hf_early_exit", "hf_greedy"),
        ("hf_prompt_lookup", "hf_greedy")) if a in tps and b in tps}
    reference = "plain" if "plain" in methods else methods[0]
    report["reference"] = reference
    report["identical"] = {m: outputs[m] == outputs[reference] for m in methods}
    report["greedy_outputs_identical"] = all(report["identical"][m]
                                             for m in methods if m != "hf_early_exit")
    report["sources"] = {m: source_summary(stats[m]) for m in methods if m in ENGINE_METHODS and m != "plain"}
    report["prefill"] = prefill_split({m: stats[m] for m in methods if m in ENGINE_METHODS})
    if prefix_cache:
        report["prefix_cache"] = {"chunk": generator.prefix_cache.chunk,
                                  "shared_tokens": statistics.mean(run.shared.values()),
                                  "prompt_tokens": statistics.mean(len(p) for p in run.shared),
                                  "loaded_tokens_per_call": run.cached_tokens / max(1, run.engine_calls)}
    if any(isinstance(p, Structured) for p in prompts) and "plain" in methods:
        report["grammar"] = grammar_costs(stats["plain"])
    if "plain" in methods and "early_exit" in methods:
        early = settings["early_exit"]
        report["cost_model"] = cost_model(stats["plain"], stats["early_exit"],
                                          report["speedups"].get("early_exit_over_plain"),
                                          weight_cost(view, early.exit_layer, early.draft_vocab_size or 0),
                                          weights_in_cache(view))
    if profile:
        report["round_profile"] = round_profile({m: stats[m] for m in methods if m in ENGINE_METHODS})
    if cells:
        report["candidates"] = candidate_report(cells, timings, settings)
    report["diagnosis"] = diagnosis(report)
    return report


def candidate_report(cells: dict, timings: Timings, settings: dict[str, DecodeSettings]) -> dict:
    """A sweep's re-timed cells timed again by the benchmark, per drafter: each cell's paired speedup
    over plain here beside the sweep's, whether it is the drafter's stored setting, and the stored
    cell's speedup ÷ the best cell's here (`stored_over_best`: does the sweep's pick hold up?).
    cells: {name: (drafter, settings, the sweep's speedup)}."""
    plain = timings.rates("plain")
    out: dict[str, dict] = {}
    for name, (drafter, cell, sweep_speedup) in cells.items():
        entry = out.setdefault(drafter, {"cells": []})
        entry["cells"].append({"settings": cell.to_json(), "sweep_speedup": sweep_speedup,
                               "over_plain": median_interval(paired_speedups(timings.rates(name), plain)),
                               "stored": cell == settings.get(drafter),
                               "identical_to_plain": timings.outputs[name] == timings.outputs["plain"]})
    for entry in out.values():
        best = max(c["over_plain"]["speedup"] for c in entry["cells"])
        stored = [c["over_plain"]["speedup"] for c in entry["cells"] if c["stored"]]
        entry["stored_over_best"] = stored[0] / best if stored else None
    return out


def source_summary(runs) -> dict:
    """Where the drafts of engine runs came from: per source (copy, forced by a grammar, early exit)
    the rounds, drafted, accepted and α, and the share of all generated tokens that were accepted
    drafts of that source."""
    generated = sum(s.generated_tokens for s in runs)
    out = {}
    for source in SOURCES:
        pooled = AcceptanceStats()
        for stats in runs:
            pooled.merge(getattr(stats, source))
        out[source] = {"rounds": pooled.rounds, "drafted": pooled.drafted, "accepted": pooled.accepted,
                       "acceptance_rate": pooled.acceptance_rate,
                       "share_of_tokens": pooled.accepted / generated if generated else float("nan")}
    return out


def prefill_split(runs_by_method: dict) -> dict:
    """Each engine method's time split at its first round: the prefill (and the call's setup), the
    same work for every method, and the decoding after it, where the drafters differ. Per method:
    `share` (the prefill's share of its time), `decode_tokens_per_second` (tokens ÷ the time after the
    prefill) and `decode_over_plain` (that rate ÷ plain's). A drafter's speedup end to end is its
    decoding's diluted by the prefill: with a share p of plain's time, a decoding s× faster gives
    1 / (p + (1 − p) / s)."""
    split = {}
    for method, runs in runs_by_method.items():
        prefill, total = sum(s.prefill_time for s in runs), sum(s.total_time for s in runs)
        tokens = sum(s.generated_tokens for s in runs)
        if total > prefill > 0:
            split[method] = {"share": prefill / total, "decode_tokens_per_second": tokens / (total - prefill)}
    plain = split.get("plain")
    for row in split.values():
        row["decode_over_plain"] = (row["decode_tokens_per_second"] / plain["decode_tokens_per_second"]
                                    if plain else float("nan"))
    return split


def grammar_costs(plain_runs) -> dict:
    """What the grammar costs in constrained plain decoding: llguidance's seconds per generated token,
    and as a share of a plain step."""
    tokens = sum(s.generated_tokens for s in plain_runs)
    per_token = sum(s.grammar_time for s in plain_runs) / max(1, tokens)
    plain_step = sum(s.plain_time for s in plain_runs) / max(1, sum(s.plain_steps for s in plain_runs))
    return {"seconds_per_token": per_token, "share_of_plain_step": per_token / plain_step if plain_step
            else float("nan")}


def pooled_costs(plain_runs, spec_runs) -> dict:
    """Engine runs pooled: acceptance statistics of `spec_runs`, seconds per plain step (from
    `plain_runs`), per draft step and per verification, and the draft cost c = draft ÷ plain step."""
    pooled = AcceptanceStats()
    draft_time = verify_time = 0.0
    draft_steps = spec_rounds = ahead = 0
    for stats in spec_runs:
        pooled.merge(stats)
        draft_time += stats.draft_time
        verify_time += stats.verify_time
        draft_steps += stats.draft_steps
        spec_rounds += stats.rounds - stats.plain_steps
        ahead += stats.drafted_ahead
    plain_step = sum(s.plain_time for s in plain_runs) / max(1, sum(s.plain_steps for s in plain_runs))
    draft_step = draft_time / draft_steps if draft_steps else float("nan")
    return {"stats": pooled, "plain_step": plain_step, "draft_step": draft_step, "draft_steps": draft_steps,
            "spec_rounds": spec_rounds, "verify_per_round": verify_time / max(1, spec_rounds),
            "drafted_ahead_share": ahead / max(1, spec_rounds),
            "draft_cost": draft_step / plain_step if plain_step else float("nan")}


def cost_model(plain_runs, spec_runs, measured: float | None, weights: float | None = None,
               in_cache: list[int] | None = None) -> dict:
    """α, mean accepted length, c and the predictions, pooled over the timed early_exit runs;
    `weights`: the c its weights predict (`doctor.weight_cost`), kept beside the measured one;
    `in_cache`: [weight bytes, cache bytes] where the weights fit in the CPU's last-level cache
    (`doctor.weights_in_cache`), which the diagnosis names. "drafted_ahead_share": the share of rounds
    whose drafts ran beside the round before's verification (`DecodeSettings.overlap`); c and v then
    measure what a round pays, not a pass alone."""
    costs = pooled_costs(plain_runs, spec_runs)
    pooled, plain_step, draft_steps = costs["stats"], costs["plain_step"], costs["draft_steps"]
    alpha = pooled.acceptance_rate
    out = {"acceptance_rate": alpha, "draft_efficiency": pooled.draft_efficiency,
           "mean_accepted_length": pooled.mean_accepted_length, "mean_accepted_length_counts_bonus": True,
           "per_position_acceptance": pooled.per_position_acceptance,
           "accepted_histogram": pooled.accepted_histogram,
           "k_rounds": {int(k): n for k, n in sorted(pooled.k_rounds.items())},
           "plain_step_seconds": plain_step}
    if weights is not None:
        out["weight_cost"] = weights
    if in_cache is not None:
        out["weights_in_cache"] = in_cache
    if not draft_steps or alpha != alpha:  # no speculative round (auto may turn it off): nothing to predict
        return out
    draft_step, c, verify = costs["draft_step"], costs["draft_cost"], costs["verify_per_round"]
    k_mean = draft_steps / costs["spec_rounds"]
    k_rounds = pooled.k_rounds
    out.update({
        "draft_step_seconds": draft_step, "verify_seconds_per_round": verify,
        "draft_cost": c, "mean_k": k_mean, "drafted_ahead_share": costs["drafted_ahead_share"],
        "verify_cost": verify / plain_step,
        # E(k)/(k·c + v) per round with v the measured verification in plain steps, weighted by how
        # many rounds used each k (k = 0 rounds count 1/1)
        "predicted_speedup": predicted_speedup(k_rounds, alpha, c, verify / plain_step),
        "predicted_speedup_kv_reuse": speedup_kv_reuse(round(k_mean), alpha, c),
        "predicted_speedup_measured_costs": speedup_measured_costs(
            round(k_mean), alpha, draft_step, verify, plain_step),
        # the α these rounds would need to match plain decoding at the measured c and v
        "break_even_acceptance": break_even_acceptance(k_rounds, c, verify / plain_step),
    })
    if measured is not None:
        out["measured_over_predicted"] = measured / out["predicted_speedup"]
    return out


def own_exit_alpha(sources: dict) -> float | None:
    """The early exit's own α where other drafts shared its rounds (under a grammar its forced tokens,
    which cost no draft step), so that the checklist judges the exit by it; None when it drafted alone
    (`sources`: `source_summary` of the early-exit method's runs)."""
    mixed = any(part["drafted"] for source, part in sources.items() if source != "early_exit")
    return sources["early_exit"]["acceptance_rate"] if mixed else None


def diagnosis(report: dict) -> str | None:
    """`selfspec doctor`'s checklist in one paragraph, from what the benchmark measured (its cost
    model, speedups over plain and round profile); None when it measured nothing to check."""
    speedups = {m: row["over_plain"]["speedup"] for m, row in report["methods"].items()
                if m != "plain" and row.get("over_plain")}
    profile = report.get("round_profile", {}).get("methods", {}).get("early_exit", {})
    overhead = profile.get("plain_steps", {}).get("outside_passes")
    exit_layer = report["settings"].get("early_exit", {}).get("exit_layer")
    sources = report.get("sources", {})
    exit_alpha = own_exit_alpha(sources["early_exit"]) if "early_exit" in sources else None
    return summary(cost_figures(report.get("cost_model", {}), speedups, exit_layer, overhead, exit_alpha,
                                report.get("prefill")))


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """Write `benchmark.json` and `benchmark.md` into out_dir (atomically); returns their paths."""
    json_path, md_path = write_files(out_dir, "benchmark", report, to_markdown(report))
    return json_path, md_path


def _describe_setting(method: str, settings: dict) -> str:
    """The setting column of a method (`settings`: the report's method -> `DecodeSettings.to_json()`)."""
    if method == "hf_prompt_lookup":
        return f"prompt_lookup_num_tokens = {PROMPT_LOOKUP_TOKENS}"
    if method == "hf_early_exit" and "early_exit" in settings:
        return f"E = {settings['early_exit']['exit_layer']}"
    return DecodeSettings.from_json(settings[method]).describe() if method in settings else ""


def to_markdown(report: dict) -> str:
    lines = [f"# Self-speculative decoding benchmark ({report['num_layers']} layers)", "",
             f"{report['num_prompts']} prompts, batch {report.get('batch_size', 1)}, "
             f"{report['max_new_tokens']} new tokens, greedy, "
             f"{report['device']} {report['dtype']}, median of {report['repeats']} interleaved repeats "
             f"after {report['warmup']} warm-up.", "",
             "| method | tokens/s | × plain (interval) | setting |", "|---|---:|---:|---|"]
    settings = report.get("settings", {})
    for method, row in report["methods"].items():
        paired = row.get("over_plain")
        shown = (f"{paired['speedup']:.2f} ({paired['low']:.2f}-{paired['high']:.2f})" if paired
                 and paired["coverage"] else "")
        lines.append(f"| {method} | {row['tokens_per_second']:.1f} | {shown} | "
                     f"{_describe_setting(method, settings)} |")
    coverages = [row["over_plain"]["coverage"] for row in report["methods"].values() if row.get("over_plain")]
    if coverages:
        lines += ["", f"× plain: the median of paired speedups (method ÷ plain in the same repeat) and a "
                      f"{coverages[0]:.0%} interval for it (`evaluation.paired`)."]
    lines += ["", "| speedup | × |", "|---|---:|"]
    lines += [f"| {name.replace('_over_', ' / ')} | {value:.3f} |"
              for name, value in report["speedups"].items()]
    sources = report.get("sources", {})
    if sources:
        lines += ["", "| method | source | rounds | drafted | accepted | α | share of tokens |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {method} | {source} | {row['rounds']} | {row['drafted']} | {row['accepted']} | "
                  f"{row['acceptance_rate']:.3f} | {row['share_of_tokens']:.1%} |"
                  for method, per_source in sources.items() for source, row in per_source.items()
                  if row["rounds"]]
    cost = report.get("cost_model", {})
    if cost:
        lines += ["", "| cost model | value |", "|---|---:|"]
        for name, value in cost.items():
            if isinstance(value, float):
                shown = f"{value:.4g}"
            elif isinstance(value, list):
                shown = ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in value)
            else:
                shown = str(value)
            lines.append(f"| {name} | {shown} |")
    prefill = report.get("prefill")
    if prefill:
        lines += ["", "| method | prefill's share of the time | decoding tokens/s after it | "
                      "decoding × plain |", "|---|---:|---:|---:|"]
        lines += [f"| {method} | {row['share']:.1%} | {row['decode_tokens_per_second']:.1f} | "
                  f"{row['decode_over_plain']:.2f} |" for method, row in prefill.items()]
        lines += ["", "The prefill (the prompt's pass, the same for every method) dilutes each drafter's "
                  "decoding speedup end to end."]
    cached = report.get("prefix_cache")
    if cached:
        lines += ["", f"Prefix cache: before each timed call the engine's cache held the prompt's prefix "
                      f"shared with another prompt, {cached['shared_tokens']:.1f} of "
                      f"{cached['prompt_tokens']:.1f} tokens on average; the engine's calls loaded "
                      f"{cached['loaded_tokens_per_call']:.1f} positions each from it (whole chunks of "
                      f"{cached['chunk']}). Hugging Face's methods prefill the whole prompt."]
    grammar = report.get("grammar")
    if grammar:
        lines += ["", f"Grammar masks (llguidance) in constrained plain decoding: "
                  f"{grammar['seconds_per_token'] * 1e6:.0f} µs a token, "
                  f"{grammar['share_of_plain_step']:.1%} of a plain step."]
    if report.get("round_profile"):
        lines += ["", profile_markdown(report["round_profile"]).rstrip()]
    if report.get("candidates"):
        lines += ["", "The sweep's re-timed cells, timed again here:", "",
                  "| drafter | setting | sweep × plain | here × plain (interval) | stored |",
                  "|---|---|---:|---:|---|"]
        for drafter, entry in report["candidates"].items():
            for cell in entry["cells"]:
                here = cell["over_plain"]
                lines.append(f"| {drafter} | {DecodeSettings.from_json(cell['settings']).describe()} | "
                             f"{cell['sweep_speedup']:.2f} | {here['speedup']:.2f} ({here['low']:.2f}-"
                             f"{here['high']:.2f}) | {'stored' if cell['stored'] else ''} |")
        for drafter, entry in report["candidates"].items():
            ratio = entry["stored_over_best"]
            lines += ["", f"{drafter}: the stored cell runs at {ratio:.3f}× the best cell here." if ratio
                      else f"{drafter}: the stored setting is not among the sweep's cells."]
    lines += ["", "Greedy outputs identical (every method but hf_early_exit, which is reported apart): "
              f"**{report['greedy_outputs_identical']}**; identical to {report['reference']} per method: "
              + ", ".join(f"{m} {same}" for m, same in report["identical"].items())]
    if report.get("diagnosis"):
        lines += ["", report["diagnosis"]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# The `selfspec eval speedup` command
# --------------------------------------------------------------------------------------------------

def read_prompts(tokenizer, prompts: str | None = None, corpus: str = "stdlib", num_prompts: int = 8,
                 prompt_tokens: int = 64) -> list[list[int]]:
    """The first `num_prompts` prompts of the file `prompts` (a JSON list of token lists or strings,
    or a text file, one per line), else the first tokens of `corpus`'s test documents."""
    if num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {num_prompts}")
    if prompts is None:
        return prompts_from_corpus(tokenizer, corpus, num_prompts, prompt_tokens)
    if prompts == JSON_EXTRACT:
        return extraction_benchmark_prompts(tokenizer, num_prompts)
    file = Path(prompts)
    if not file.is_file():
        raise UserError(f"prompt file {prompts!r} does not exist; pass a JSON list or a text file, "
                        f"one prompt per line")
    try:
        items = json.loads(file.read_text()) if file.suffix == ".json" else [
            line for line in file.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise UserError(f"{prompts} is not valid JSON ({exc.msg}); "
                        f"write a list of strings or token lists") from None
    if not items:
        raise UserError(f"prompt file {prompts!r} holds no prompt")
    try:
        return [tokenizer(item)["input_ids"] if isinstance(item, str) else [int(t) for t in item]
                for item in items][:num_prompts]
    except (TypeError, ValueError):
        raise UserError(f"{prompts}: every prompt must be a string or a list of token ids") from None


JSON_EXTRACT = "json-extract"  # `--prompts json-extract`: the extraction prompts, each with its schema


def extraction_benchmark_prompts(tokenizer, num_prompts: int, split: str = "test") -> list[Structured]:
    """The first `num_prompts` extraction prompts of `split` (categories in turn), each a user turn
    in the tokenizer's chat template (plain text without one) and constrained by its own schema."""
    from ..data.extraction import CATEGORIES, extraction_prompts

    per_category = -(-num_prompts // len(CATEGORIES))
    by_category = extraction_prompts(split, per_category)
    ordered = [p for i in range(per_category) for p in by_category[i::per_category]][:num_prompts]
    out = []
    for item in ordered:
        text = (tokenizer.apply_chat_template([{"role": "user", "content": item.message}], tokenize=False,
                                              add_generation_prompt=True)
                if getattr(tokenizer, "chat_template", None) else item.message)
        ids = tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]
        out.append(Structured(list(ids), Constraint.of(json_schema=item.schema)))
    return out


def speedup(model: str, *, exit_layer: int | None = None, num_speculations=None,
            draft_vocab_size: int | None = None, stop_below: float | None = None,
            min_ngram: int | None = None, overlap: bool | None = None,
            prompts: str | None = None,
            corpus: str = "stdlib", num_prompts: int = 8, prompt_tokens: int = 64, max_new_tokens: int = 128,
            repeats: int = 5, warmup: int = 1, methods=METHODS, batch_size: int = 1, keep_eos: bool = False,
            device: str | None = None, dtype: str = "auto", out: str = "runs/benchmark",
            json_schema: str | None = None, regex: str | None = None, grammar: str | None = None,
            profile: bool = False, static_passes: str | None = None,
            candidates: bool = False, prefix_cache: bool = False) -> BenchmarkReport:
    """`selfspec eval speedup`: benchmark the checkpoint `model`; print the report, write it into `out`.

    The engine decodes at the checkpoint's settings (`selfspec.json`), with the given fields
    overriding them; without any override each drafter runs at its fastest a sweep stored (for
    constrained prompts, a sweep under that kind of constraint: `formats`).
    Structured output: `json_schema`/`grammar` (files) or `regex` constrain every reply, and
    `prompts="json-extract"` takes the extraction prompts, each under its own schema.
    profile: add the round profile of every engine method (where its rounds' time goes).
    static_passes: "compile" (or "eager") runs the engine's passes at fixed shapes, CUDA graphs on a GPU.
    candidates: also time every cell the last sweep re-timed (`checkpoint.sweep_candidates`) and say
    whether each drafter's stored cell is still its fastest.
    prefix_cache: the engine's methods prefill through a prefix cache holding each prompt's prefix
    shared with the others (`run_benchmark`).
    """
    if num_prompts < 1 or repeats < 1 or max_new_tokens < 1:
        raise UserError(f"--num-prompts ({num_prompts}), --repeats ({repeats}) and --max-new-tokens "
                        f"({max_new_tokens}) must be >= 1")
    constraint = read_constraint(json_schema=json_schema, regex=regex, grammar=grammar)
    # constrained prompts decode at what a sweep under that kind stored (`formats`), when there is one
    kind = constraint.kind if constraint is not None else "json_schema" if prompts == JSON_EXTRACT else None
    settings, fastest, token_counts = resolve_settings(
        model, constraint_kind=kind, exit_layer=exit_layer, num_speculations=num_speculations,
        draft_vocab_size=draft_vocab_size, stop_below=stop_below, min_ngram=min_ngram, overlap=overlap)
    if settings.exit_layer is None:
        raise UserError(f"--exit-layer is required: {model} has no selfspec.json")
    cells = sweep_candidates(model, constraint_kind=kind) if candidates else None
    lm, tokenizer = load_model(model, device, dtype)
    prompt_ids = read_prompts(tokenizer, prompts, corpus, num_prompts, prompt_tokens)
    if constraint is not None:
        prompt_ids = [Structured(p.ids if isinstance(p, Structured) else p, constraint) for p in prompt_ids]
    report = run_benchmark(lm, prompt_ids, settings,
                           tokenizer=tokenizer, fastest=fastest, token_counts=token_counts,
                           exit_adapters=checkpoint_adapters(model, lm), max_new_tokens=max_new_tokens,
                           repeats=repeats, warmup=warmup, ignore_eos=not keep_eos,
                            methods=(tuple(m.strip() for m in methods.split(",")) if isinstance(methods, str)
                                     else tuple(methods)),
                           batch_size=batch_size, progress=True, profile=profile, static_passes=static_passes,
                           candidates=cells, prefix_cache=prefix_cache)
    report["model"] = model
    json_path, md_path = write_report(report, out)
    print(to_markdown(report))
    print(f"wrote {json_path} and {md_path}")
    return report
