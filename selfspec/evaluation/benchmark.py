"""Speed benchmark: the engine plain vs self-speculative vs Hugging Face's generators, in one process.

Ways to decode the same prompts greedily, batch 1, the same number of new tokens (each engine method
at its own `DecodeSettings`, see `timing.method_settings`):

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
- ``hf_draft`` (with `--draft DIR`): `model.generate(assistant_model=draft)`, the exit exported as a
  separate draft model (`selfspec export --draft`) in Hugging Face's assisted generation, at its own
  draft-length schedule: what a user serving with Hugging Face gets from a selfspec-tuned exit
  (batch 1 only; its own cache, so no KV reuse).

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

import statistics
from pathlib import Path

from ..checkpoint import META_FILE, read_meta, resolve_settings, sweep_candidates
from ..decoding import SAMPLED, DecodeSettings, sampled_pick
from ..errors import UserError
from .costs import cost_model, grammar_costs, prefill_split, source_summary, weight_cost, weights_in_cache
from .diagnosis import cost_figures, own_exit_alpha, summary
from .options import BenchmarkOptions, BenchmarkRun
from .paired import median_interval, paired_speedups
from .prompts import JSON_EXTRACT, Structured, read_prompts
from .report import write_report as write_files
from .results import BenchmarkReport
from .rounds import round_profile
from .rounds import to_markdown as profile_markdown
from .timing import (
    ENGINE_METHODS,
    PROMPT_LOOKUP_TOKENS,
    LoadedCheckpoint,
    Timings,
    interleaved_rates,
    load_checkpoint,
    make_runner,
)


def run_benchmark(checkpoint: LoadedCheckpoint, prompts: list[list[int]], options: BenchmarkRun | None = None,
                  *, cells: list[tuple[str, DecodeSettings, float]] | None = None,
                  progress: bool = False) -> BenchmarkReport:
    """Measure `options.methods` on `prompts` (token lists), `options.batch_size` prompts per call;
    returns the report as a dict (see module docstring). The engine methods decode at the checkpoint's
    settings, each drafter at its own fastest when the checkpoint names one (`timing.method_settings`).
    options.profile: add the engine methods' round profile (`rounds.round_profile`); static_passes: the
    engine's passes at fixed shapes (`SelfSpecGenerator`); prefix_cache: the engine prefills through a
    `PrefixCache` that holds, before each timed call, the prompt's prefix shared with another prompt of
    the set (`timing.make_runner`'s `prepare`: what a server would have cached). cells: a sweep's
    re-timed cells (`checkpoint.sweep_candidates`), timed here too, interleaved with the methods:
    `candidate_report`."""
    options = options or BenchmarkRun()
    methods = options.methods
    if options.max_new_tokens < 1 or not prompts:
        raise UserError(f"the benchmark needs max_new_tokens >= 1 ({options.max_new_tokens}) and a prompt "
                        f"({len(prompts)})")
    if cells and "plain" not in methods:
        raise UserError("--candidates are judged against plain decoding: keep plain in --methods")
    run = make_runner(checkpoint, max_new_tokens=options.max_new_tokens, keep_eos=options.keep_eos,
                      profile=options.profile, static_passes=options.static_passes,
                      backend=options.backend, prefix_cache=options.prefix_cache, draft=options.draft,
                      sampling=options.sampling_keywords(seed=0))
    run.share_prefixes(prompts)
    generator = run.generator
    named = {f"{drafter} cell {i + 1}": (drafter, generator.settings_for(cell), sweep_speedup)
             for i, (drafter, cell, sweep_speedup) in enumerate(cells or [])}
    run.settings.update({name: cell for name, (_, cell, _) in named.items()})
    batches = [prompts[i:i + options.batch_size] for i in range(0, len(prompts), options.batch_size)]
    timings = interleaved_rates([*methods, *named], run, batches, options.repeats, options.warmup, run.device,
                                "benchmark" if progress else None, prepare=run.prepare)
    report = _report(options, run, timings, len(prompts))
    if options.prefix_cache:
        report["prefix_cache"] = {"chunk": generator.prefix_cache.chunk,
                                  "shared_tokens": statistics.mean(run.shared.values()),
                                  "prompt_tokens": statistics.mean(len(p) for p in run.shared),
                                  "loaded_tokens_per_call": run.cached_tokens / max(1, run.engine_calls)}
    stats = {m: timings.run_stats(m) for m in methods}
    if any(isinstance(p, Structured) for p in prompts) and "plain" in methods:
        report["grammar"] = grammar_costs(stats["plain"])
    if "plain" in methods and "early_exit" in methods:
        early, view = run.settings["early_exit"], generator.view
        report["cost_model"] = cost_model(stats["plain"], stats["early_exit"],
                                          report["speedups"].get("early_exit_over_plain"),
                                          weight_cost(view, early.exit_layer, early.draft_vocab_size or 0),
                                          weights_in_cache(view))
    if options.profile:
        report["round_profile"] = round_profile({m: stats[m] for m in methods if m in ENGINE_METHODS})
    if named:
        report["candidates"] = candidate_report(named, timings, run.settings)
    report["diagnosis"] = diagnosis(report)
    return report


SPEEDUPS = (("hybrid", "hf_prompt_lookup"), ("hybrid", "plain"), ("hybrid", "early_exit"),
            ("hybrid", "ngram"), ("ngram", "hf_prompt_lookup"), ("ngram", "plain"),
            ("early_exit", "plain"), ("early_exit", "hf_early_exit"), ("early_exit", "hf_prompt_lookup"),
            ("plain", "hf_greedy"), ("early_exit", "hf_greedy"), ("hf_early_exit", "hf_greedy"),
            ("hf_prompt_lookup", "hf_greedy"), ("hf_draft", "hf_greedy"), ("hf_draft", "hf_early_exit"),
            ("early_exit", "hf_draft"))  # the report's "a_over_b" ratios, where both ran


def _report(options: BenchmarkRun, run, timings: Timings, num_prompts: int) -> dict:
    """The report's rates, speedups, identity checks, sources and prefill split of the methods."""
    methods, settings, view = options.methods, run.settings, run.generator.view
    rates, outputs = {m: timings.rates(m) for m in methods}, timings.outputs
    stats = {m: timings.run_stats(m) for m in methods}
    report = {"max_new_tokens": options.max_new_tokens, "num_prompts": num_prompts,
              "batch_size": options.batch_size, "repeats": options.repeats, "warmup": options.warmup,
              "device": str(run.device), "dtype": str(view.dtype).replace("torch.", ""),
              "num_layers": view.num_layers,
              "settings": {m: settings[m].to_json() for m in methods if m in ENGINE_METHODS},
              "draft": options.draft if "hf_draft" in methods else None,
              "sampling": options.sampling().describe(), "methods": {}}
    for method in methods:
        report["methods"][method] = {"tokens_per_second": statistics.median(rates[method]),
                                     "tokens_per_second_all": rates[method]}
        if "plain" in methods:  # paired with plain in each repeat: the median and its interval
            report["methods"][method]["over_plain"] = median_interval(paired_speedups(rates[method],
                                                                                      rates["plain"]))
    tps = {m: report["methods"][m]["tokens_per_second"] for m in methods}
    report["speedups"] = {f"{a}_over_{b}": tps[a] / tps[b] for a, b in SPEEDUPS if a in tps and b in tps}
    reference = "plain" if "plain" in methods else methods[0]
    report["reference"] = reference
    if options.sampling().greedy:  # sampled decodes are draws: the distribution tests hold them lossless
        report["identical"] = {m: outputs[m] == outputs[reference] for m in methods}
        report["greedy_outputs_identical"] = all(report["identical"][m]
                                                 for m in methods if m != "hf_early_exit")
    report["sources"] = {m: source_summary(stats[m]) for m in methods if m in ENGINE_METHODS and m != "plain"}
    report["prefill"] = prefill_split({m: stats[m] for m in methods if m in ENGINE_METHODS})
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
    if method == "hf_draft":
        return "assistant_model = the exported draft"
    return DecodeSettings.from_json(settings[method]).describe() if method in settings else ""


def to_markdown(report: dict) -> str:
    """The report as Markdown: the methods' table, then each part the report holds."""
    lines = [f"# Self-speculative decoding benchmark ({report['num_layers']} layers)", "",
             f"{report['num_prompts']} prompts, batch {report.get('batch_size', 1)}, "
             f"{report['max_new_tokens']} new tokens, {report.get('sampling', 'greedy')}, "
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
    lines += _source_lines(report) + _cost_lines(report) + _candidate_lines(report)
    if "identical" in report:
        lines += ["", "Greedy outputs identical (every method but hf_early_exit, which is reported apart): "
                  f"**{report['greedy_outputs_identical']}**; identical to {report['reference']} per method: "
                  + ", ".join(f"{m} {same}" for m, same in report["identical"].items())]
    else:
        lines += ["", "Sampled: each method's outputs are its own draws (seeded), not compared token for "
                      "token; α is the sampled acceptance."]
    if report.get("diagnosis"):
        lines += ["", report["diagnosis"]]
    return "\n".join(lines) + "\n"


def _source_lines(report: dict) -> list[str]:
    """The Markdown of the drafts' sources per engine method (α and share of tokens of each)."""
    sources = report.get("sources", {})
    if not sources:
        return []
    return ["", "| method | source | rounds | drafted | accepted | α | share of tokens |",
            "|---|---|---:|---:|---:|---:|---:|"] + [
        f"| {method} | {source} | {row['rounds']} | {row['drafted']} | {row['accepted']} | "
        f"{row['acceptance_rate']:.3f} | {row['share_of_tokens']:.1%} |"
        for method, per_source in sources.items() for source, row in per_source.items() if row["rounds"]]


def _cost_lines(report: dict) -> list[str]:
    """The Markdown of the cost model, the prefill split, the prefix cache, the grammar masks' cost and
    the round profile, each where the report holds it."""
    lines = []
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
    return lines


def _candidate_lines(report: dict) -> list[str]:
    """The Markdown of the sweep's cells timed again (`candidate_report`), where the report holds them."""
    if not report.get("candidates"):
        return []
    lines = ["", "The sweep's re-timed cells, timed again here:", "",
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
    return lines


# --------------------------------------------------------------------------------------------------
# The `selfspec eval speedup` command
# --------------------------------------------------------------------------------------------------

def speedup(options: BenchmarkOptions) -> BenchmarkReport:
    """`selfspec eval speedup`: benchmark the checkpoint `options.model`; print the report, write it into
    `options.out`.

    The engine decodes at the checkpoint's settings (`selfspec.json`), with the given fields
    overriding them; without any override each drafter runs at its fastest a sweep stored (for
    constrained prompts, a sweep under that kind of constraint: `formats`; sampled, a sampled sweep).
    Structured output: `json_schema`/`grammar` (files) or `regex` constrain every reply, and
    `prompts="json-extract"` takes the extraction prompts, each under its own schema.
    profile: add the round profile of every engine method (where its rounds' time goes).
    static_passes: "graph" (or "eager") runs the engine's passes at fixed shapes, as CUDA graphs.
    candidates: also time every cell the last sweep re-timed (`checkpoint.sweep_candidates`) and say
    whether each drafter's stored cell is still its fastest.
    prefix_cache: the engine's methods prefill through a prefix cache holding each prompt's prefix
    shared with the others (`run_benchmark`).

        speedup(BenchmarkOptions(model="runs/demo/model", repeats=3))
    """
    model = options.model
    constraint = options.constraint()
    # constrained prompts decode at what a sweep under that kind stored (`formats`), when there is one;
    # sampled ones at what a sampled sweep stored
    sampling = options.sampling()
    stored = read_meta(model).get("formats", {}) if (Path(model) / META_FILE).is_file() else {}
    kind = (constraint.kind if constraint is not None
            else "json_schema" if options.prompts == JSON_EXTRACT
            else None if sampling.greedy
            else sampled_pick(stored, sampling.temperature) or SAMPLED)
    resolved = resolve_settings(model, constraint_kind=kind, **options.overrides())
    if resolved[0].exit_layer is None:
        raise UserError(f"--exit-layer is required: {model} has no selfspec.json")
    cells = sweep_candidates(model, constraint_kind=kind) if options.candidates else None
    checkpoint = load_checkpoint(model, *resolved, device=options.device, dtype=options.dtype)
    prompt_ids = read_prompts(checkpoint.tokenizer, options.prompts, options.corpus, options.num_prompts,
                              options.prompt_tokens)
    if constraint is not None:
        prompt_ids = [Structured(p.ids if isinstance(p, Structured) else p, constraint) for p in prompt_ids]
    report = run_benchmark(checkpoint, prompt_ids, options, cells=cells, progress=True)
    report["model"] = model
    json_path, md_path = write_report(report, options.out)
    print(to_markdown(report))
    print(f"wrote {json_path} and {md_path}")
    return report
