"""A multi-task suite: every method on the questions of several categories, per category and overall.

    selfspec eval suite --model runs/smollm2/base --suite mt-bench,sharegpt-heldout,humaneval \
        --max-per-category 2 --max-new-tokens 128

Questions come in the common format (one JSON object a line: ``question_id``, ``category``,
``turns``, a list of user messages) from `--questions FILE`, or from suites that installed packages
ship (`prompts.SUITES`, read by `prompts.select_questions`): the 80 two-turn MT-bench questions,
HumanEval's 164 code prompts, the held-out ShareGPT slice's first turns and the stdlib test split's
code. Chat questions run through the tokenizer's chat template (`prompts.prompt_ids`); a later turn
holds the model's own earlier answer (plain decoding's, as MT-bench does), so turn t + 1 is timed
after turn t. Code prompts are continued as they are.

Every method (`timing.METHODS`) decodes every prompt, interleaved as in the benchmark, and each
output is compared with plain decoding's. The report gives per category and overall: tokens/s, the
speedup over Hugging Face greedy (the field's convention) and over the engine's own plain decoding,
tokens per full-model pass (the field's "mean accepted tokens": generated tokens ÷ rounds, each
round one pass of the whole model; 1 for plain decoding), the early exit's α and the share of
tokens that were accepted copies. It writes suite.json, suite.md and suite.png (grouped bars).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..checkpoint import resolve_settings
from ..decoding import DecodeSettings
from ..errors import UserError
from ..model.loading import load_tokenizer
from .costs import cost_model, source_summary, weight_cost, weights_in_cache
from .diagnosis import cost_figures, own_exit_alpha, summary
from .options import SuiteOptions, SuiteRun
from .prompts import Question, Structured, prompt_ids, select_questions
from .report import publish, pyplot, save_figure
from .results import SuiteReport
from .timing import (
    ENGINE_METHODS,
    LoadedCheckpoint,
    Timings,
    interleaved_rates,
    load_checkpoint,
    make_runner,
)

OVERALL = "overall"


def _constrained(ids: list[int], question: Question):
    """A prompt as the runner takes it: its ids, under its question's constraint when it has one."""
    return ids if question.constraint is None else Structured(ids, question.constraint)


def run_suite(checkpoint: LoadedCheckpoint, questions: list[Question], options: SuiteRun | None = None, *,
              progress: bool = True) -> SuiteReport:
    """Decode every question's turns with every method, interleaved; returns the report as a dict.

    Turn by turn: all questions' turn t are timed (batches of `options.batch_size` prompts of one
    category), then plain decoding's answers (greedy, so every lossless method's) are put into turn
    t + 1. `options.warmup` untimed decodes of the first batch by every method come first. A prompt
    longer than the model's positions minus `max_new_tokens` keeps its last tokens; the report counts
    those cut. The checkpoint needs its tokenizer (the chat template, the answers).
    """
    options = options or SuiteRun()
    methods = list(options.methods)
    if not questions or options.max_new_tokens < 1 or options.repeats < 1:
        raise UserError(f"the suite needs a question ({len(questions)}), max_new_tokens >= 1 "
                        f"({options.max_new_tokens}) and repeats >= 1 ({options.repeats})")
    run = make_runner(checkpoint, max_new_tokens=options.max_new_tokens, keep_eos=not options.no_eos,
                      draft=options.draft, sampling=options.sampling_keywords(seed=0))
    start = time.perf_counter()
    turns = _time_turns(run, checkpoint.tokenizer, questions, options, progress)
    view, timings = run.generator.view, turns.timings
    reference = "plain" if "plain" in methods else methods[0]
    report = {"num_questions": len(questions), "num_prompts": turns.num_prompts,
              "cut_prompts": turns.cut, "max_new_tokens": options.max_new_tokens,
              "stop_at_eos": not options.no_eos, "batch_size": options.batch_size, "repeats": options.repeats,
              "warmup": options.warmup, "device": str(view.device),
              "dtype": str(view.dtype).replace("torch.", ""), "num_layers": view.num_layers,
              "settings": {m: run.settings[m].to_json() for m in methods if m in ENGINE_METHODS},
              "questions_per_category": {c: sum(q.category == c for q in questions)
                                         for c in dict.fromkeys(q.category for q in questions)},
              "sampling": options.sampling().describe(), "reference": reference}
    if options.sampling().greedy:  # sampled outputs are draws, not compared token for token
        report["identical"] = {m: timings.outputs[m] == timings.outputs[reference] for m in methods}
        report["greedy_outputs_identical"] = all(same for m, same in report["identical"].items()
                                                 if m != "hf_early_exit")
    groups = {c: [b for b, bc in enumerate(turns.categories) if bc == c]
              for c in dict.fromkeys(turns.categories)}
    groups[OVERALL] = list(range(len(turns.categories)))
    report["results"] = {c: _category_results(timings, methods, batches) for c, batches in groups.items()}
    report["diagnosis"] = _diagnosis(report, timings, methods, run)
    report["seconds"] = time.perf_counter() - start
    return report


@dataclass
class _Turns:
    """What `_time_turns` measured: the timings of every turn's batches, each batch's category, the
    prompts cut to fit the model's positions, and the prompts timed."""

    timings: Timings
    categories: list[str]
    cut: int
    num_prompts: int


def _time_turns(run, tokenizer, questions: list[Question], options: SuiteRun, progress: bool) -> _Turns:
    """Every question's turns timed with every method, turn by turn (see `run_suite`)."""
    methods = list(options.methods)
    reference = "plain" if "plain" in methods else methods[0]
    limit = run.generator.view.max_positions
    limit = None if limit is None else limit - options.max_new_tokens
    answers: list[list[str]] = [[] for _ in questions]
    turns = _Turns(Timings(), [], 0, 0)
    for turn in range(max(len(q.turns) for q in questions)):
        asked = [i for i, q in enumerate(questions) if len(q.turns) > turn]
        ids = {i: prompt_ids(tokenizer, questions[i], turn, answers[i]) for i in asked}
        turns.num_prompts += len(asked)
        if limit is not None:
            turns.cut += sum(len(p) > limit for p in ids.values())
            ids = {i: p[-limit:] if len(p) > limit else p for i, p in ids.items()}
        groups = []  # batches of one category each, so each category's rates are its own
        for category in dict.fromkeys(questions[i].category for i in asked):
            members = [i for i in asked if questions[i].category == category]
            groups += [(category, members[j:j + options.batch_size])
                       for j in range(0, len(members), options.batch_size)]
        batches = [[_constrained(ids[i], questions[i]) for i in members] for _, members in groups]
        if turn == 0:
            for _ in range(options.warmup):
                for method in methods:
                    run(method, batches[0])
        phase = interleaved_rates(methods, run, batches, options.repeats, 0, run.device,
                                  f"turn {turn + 1}" if progress else None, bar_per_name=True)
        turns.timings.extend(phase)
        turns.categories += [category for category, _ in groups]
        for (_, members), rows in zip(groups, phase.outputs[reference]):
            for i, row in zip(members, rows):
                answers[i].append(tokenizer.decode(row, skip_special_tokens=True).strip())
    if turns.cut:
        print(f"{turns.cut} prompts were longer than the model's positions minus max_new_tokens ({limit}): "
              f"each kept its last {limit} tokens")
    return turns


def _diagnosis(report: dict, timings: Timings, methods: list[str], run) -> str | None:
    """The checklist's paragraph over the whole suite (and the report's cost model, put in place)."""
    overall, view = report["results"][OVERALL], run.generator.view
    exit_layer = None
    if "plain" in methods and "early_exit" in methods:
        early = run.settings["early_exit"]
        exit_layer = early.exit_layer
        report["cost_model"] = cost_model(
            timings.run_stats("plain"), timings.run_stats("early_exit"),
            overall["early_exit"]["speedup_over_plain"],
            weight_cost(view, early.exit_layer, early.draft_vocab_size or 0), weights_in_cache(view))
    speedups = {m: row["speedup_over_plain"] for m, row in overall.items()
                if m != "plain" and "speedup_over_plain" in row}
    exit_alpha = (own_exit_alpha(source_summary(timings.run_stats("early_exit")))
                  if "early_exit" in methods else None)
    return summary(cost_figures(report.get("cost_model", {}), speedups, exit_layer, exit_alpha=exit_alpha))


def _category_results(timings: Timings, methods: list[str], batches: list[int]) -> dict:
    """Per method, over `batches`: tokens/s (median over rounds), speedups over Hugging Face greedy
    and own plain, tokens per full-model pass, α of the early exit, the share of copied tokens."""
    rates = {m: statistics.median(timings.rates(m, batches)) for m in methods}
    out = {}
    for method in methods:
        row = {"tokens_per_second": rates[method],
               "tokens": sum(timings.tokens[method][0][b] for b in batches)}
        for base in ("hf_greedy", "plain"):
            if base in rates:
                row[f"speedup_over_{base}"] = rates[method] / rates[base]
        runs = timings.run_stats(method, batches)
        if runs:
            passes = sum(s.rounds for s in runs)
            row["tokens_per_pass"] = sum(s.generated_tokens for s in runs) / max(1, passes)
            sources = source_summary(runs)
            row["acceptance_rate"] = sources["early_exit"]["acceptance_rate"]
            row["copied_share"] = sources["copy"]["share_of_tokens"]
        out[method] = row
    return out


def to_markdown(report: dict) -> str:
    """The leaderboard tables: a row per method, a column per category and overall."""
    results = report["results"]
    columns = list(results)
    methods = list(results[OVERALL])
    counts = report["questions_per_category"]
    lines = [f"# Suite: {report['num_questions']} questions, {report['num_prompts']} prompts "
             f"({report['num_layers']} layers)", "",
             f"{', '.join(f'{c} {n}' for c, n in counts.items())}; {report['max_new_tokens']} new tokens"
             f"{' (or eos)' if report['stop_at_eos'] else ''}, greedy, batch {report['batch_size']}, "
             f"{report['device']} {report['dtype']}, median of {report['repeats']} interleaved repeats; "
             f"{report['cut_prompts']} prompts cut to fit the model's positions; "
             f"{report['seconds'] / 60:.1f} minutes.", ""]

    def table(title: str, cell) -> list[str]:
        rows = [f"**{title}**", "", "| method | " + " | ".join(columns) + " |",
                "|---|" + "---:|" * len(columns)]
        for method in methods:
            rows.append(f"| {method} | " + " | ".join(cell(results[c][method]) for c in columns) + " |")
        return rows + [""]

    def ratio(key):
        return lambda row: f"{row[key]:.2f}×" if key in row else "–"

    if "hf_greedy" in methods:
        lines += table("Speedup over Hugging Face greedy", ratio("speedup_over_hf_greedy"))
    if "plain" in methods:
        lines += table("Speedup over selfspec plain", ratio("speedup_over_plain"))
    lines += table("Tokens/s", lambda row: f"{row['tokens_per_second']:.1f}")
    lines += table("Tokens per full-model pass (mean accepted tokens)",
                   lambda row: f"{row['tokens_per_pass']:.2f}" if "tokens_per_pass" in row else "–")
    lines += table("Early exit α · share of tokens copied", lambda row: (
        f"{_fraction(row['acceptance_rate'])} · {row['copied_share']:.0%}" if "acceptance_rate" in row
        else "–"))
    lines += ["Settings: " + "; ".join(f"{m} {DecodeSettings.from_json(s).describe()}"
                                       for m, s in report["settings"].items())
              + f"; decoding {report.get('sampling', 'greedy')}.", ""]
    if "identical" in report:
        lines += [f"Greedy outputs identical to {report['reference']} (hf_early_exit reported apart): "
                  f"**{report['greedy_outputs_identical']}**; per method: "
                  + ", ".join(f"{m} {same}" for m, same in report["identical"].items())]
    else:
        lines += ["Sampled: each method's replies are its own draws (seeded); α is the sampled acceptance."]
    if report.get("diagnosis"):
        lines += ["", report["diagnosis"]]
    return "\n".join(lines) + "\n"


def _fraction(value: float) -> str:
    return "–" if value != value else f"{value:.2f}"


def plot(report: dict, path: str | Path) -> Path:
    """Grouped bars: per category (and overall) one bar per method, the speedup over Hugging Face
    greedy (over selfspec plain when Hugging Face greedy was not run)."""
    plt = pyplot()

    results = report["results"]
    columns, methods = list(results), list(results[OVERALL])
    base = "hf_greedy" if "hf_greedy" in methods else "plain"
    key = f"speedup_over_{base}"
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(columns) * max(1, len(methods) / 4)), 4.2))
    for m, method in enumerate(methods):
        values = [results[c][method].get(key, float("nan")) for c in columns]
        ax.bar([c + (m - (len(methods) - 1) / 2) * width for c in range(len(columns))], values, width,
               label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(columns)), columns, rotation=20)
    ax.set_ylabel(f"speedup over {base.replace('_', ' ')}")
    ax.set_title(f"{report['num_questions']} questions, {report['max_new_tokens']} new tokens, greedy")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def suite(options: SuiteOptions) -> SuiteReport:
    """`selfspec eval suite`: run the suite on the checkpoint `options.model`; print the tables and write
    suite.json, suite.md and suite.png into `options.out`. The engine decodes at the checkpoint's settings
    (the given fields override them), each drafter at its stored fastest otherwise. json_schema /
    regex / grammar (files, as `selfspec generate` takes them) constrain every reply of a question
    that has no constraint of its own."""
    model = options.model
    resolved = resolve_settings(model, **options.overrides())
    if resolved[0].exit_layer is None:
        raise UserError(f"--exit-layer is required: {model} has no selfspec.json")
    # the questions first: a missing package or category fails before the model loads
    chosen = select_questions(load_tokenizer(model), options.suites, options.questions, options.categories,
                              options.max_per_category)
    constraint = options.constraint()
    chosen = [replace(q, constraint=q.constraint or constraint) for q in chosen]
    checkpoint = load_checkpoint(model, *resolved, device=options.device, dtype=options.dtype)
    report = run_suite(checkpoint, chosen, options)
    report.update(model=model, suites=options.suites, questions=options.questions)
    publish(options.out, "suite", report, to_markdown(report), plot)
    return report


__all__ = ["OVERALL", "plot", "run_suite", "suite", "to_markdown"]
