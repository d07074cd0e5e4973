"""Sweep of drafters and their settings: which decodes fastest, measured side by side.

The grid: plain decoding (k = 0) once; early-exit drafting at every exit layer E × draft length k ×
draft-head size V'; the hybrid drafter (copies from the context, the early exit otherwise) at every
E × k × V' × copy threshold (`min_ngram`); the n-gram drafter alone at every threshold; where
overlapped rounds can run (`overlap_applies`), each early-exit and hybrid cell both with and without
them (`DecodeSettings.overlap`: which is faster depends on how much a pass loses on one thread); where a
row's rounds run many in one compiled call, each drafter's pick is re-timed with its rounds from Python
too (`DecodeSettings.fused`, `with_python_rounds`). The engine
decodes the same prompts greedily at batch 1 with each setting. Every round visits all settings,
the order rotating from round to round (interleaved, so drift hits all alike); each setting's
tokens/s is the median over rounds. Per (E, V') it reports α and the draft cost c (draft step ÷
plain step), and how much of the whole head's α each V' keeps; per setting the measured speedup over
plain, its spread over the repeats and, for early-exit drafting, the cost model's E(k, α)/(1 + k·c).
Every output must equal plain decoding's (checked, reported).

A grid of many cells measured a few times each has winners by noise: the best of thirty cells that
all run at 1.00× shows 1.03×. So the sweep re-times its best cells (each drafter's `confirm` fastest)
against plain decoding, interleaved, with `confirm_repeats` repeats, and judges each by its paired
speedups (cell ÷ plain within one repeat): their median, and a distribution-free
confidence interval for that median (`paired.median_interval`). "best" and "fastest_per_drafter" are the
re-timed cells; the write-back stores a cell only when the interval's lower end beats plain. With
`confirm_context` the cells are re-timed after long prompts too, and a repeat's speedup is the geometric
mean of its short and long ones: a setting that pays after 64 tokens of context may not after 1,024 (a
longer draft loses more as the exit's acceptance falls with the context), and a checkpoint's one pick
serves both. With `context` the whole grid runs after prompts of that many tokens instead, and the
write-back stores its pick under `formats["context@T"]` (`switch_length`): greedy decodes switch to it once
their longest context reaches T tokens (`decoding.ContextSwitch`), where a deeper exit with shorter drafts
beats the short prompts' pick.

    selfspec eval sweep --model runs/demo/model --exit-layers 2:10:2 --ks 1,2,4,6,8 --write-back

writes sweep.json, sweep.md and sweep.png into --out; --write-back records the fastest setting
(a `DecodeSettings`: drafter, E, k, V', copy settings) in the checkpoint's selfspec.json (what
`load_tuned` then uses), and each drafter's fastest beside it (what the benchmark compares).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import torch

from ..backends import cpu_rounds as round_kernels
from ..checkpoint import (
    META_FILE,
    read_meta,
    read_settings,
    resolve_settings,
    token_counts_for,
    update_meta,
    write_settings,
)
from ..config import parse_layers
from ..decoding import (
    ADAPTIVE_K,
    CONTEXT,
    DRAFTERS,
    SAMPLED,
    DecodeSettings,
    SelfSpecGenerator,
    context_key,
    sampled_key,
)
from ..decoding.settings import FIELDS
from ..errors import UserError
from ..metrics import predicted_speedup
from ..model import DecoderView
from ..model import num_layers as count_layers
from .context_costs import cost_lengths, costs_table, measure_round_costs
from .costs import pooled_costs, source_summary, weight_cost, weights_in_cache
from .diagnosis import summary
from .options import SweepGrid, SweepOptions, float_list, int_list, k_list, k_order
from .paired import beats_plain, median_interval, paired_speedups
from .prompts import JSON_EXTRACT, Structured, prompts_from_corpus, read_prompts, suite_prompts
from .report import publish, pyplot, save_figure
from .results import SweepReport
from .timing import LoadedCheckpoint, Timings, constraint_keywords, interleaved_rates, load_checkpoint


def grid_settings(base: DecodeSettings, exit_layers, ks, drafters, vocabs, min_ngrams,
                  stop_belows=(0.0,), overlaps=(False,)) -> list[DecodeSettings]:
    """Plain first (k = 0), then every combination each drafter uses, each derived from `base` (the
    checkpoint's settings: its copy settings other than the threshold carry over). The n-gram drafter
    has no E, k, V', η or overlap of its own: it keeps `base`'s. Every cell runs a lone row's rounds in
    one call (`fused`), whatever `base` stored: the re-timing tries the other way (`with_python_rounds`)."""
    base = base.override(fused=True)
    settings = [base.override(drafter="early_exit", num_speculations=0)]
    for drafter in dict.fromkeys(drafters):  # each once
        if drafter == "ngram":
            # no V' or η of its own either: no trimmed head to build, no token counts needed
            copies = dataclasses.replace(base, draft_vocab_size=0, stop_below=0.0)
            settings += [copies.override(drafter="ngram", min_ngram=n) for n in min_ngrams]
            continue
        for e in exit_layers:
            for v in vocabs:
                for k in ks:
                    for stop_below in stop_belows:
                        for overlap in overlaps:
                            cell = base.override(drafter=drafter, exit_layer=e, num_speculations=k,
                                                 draft_vocab_size=v, stop_below=stop_below, overlap=overlap)
                            settings += ([cell.override(min_ngram=n) for n in min_ngrams]
                                         if drafter == "hybrid" else [cell])
    return settings


def select_fastest(rows: list[dict]) -> tuple[dict | None, dict]:
    """From re-timed rows (each with "drafter", "speedup" = its median paired speedup, "low", and
    "settings"): each drafter's pick and the fastest of those picks. A drafter's pick: of its cells
    whose median lies inside the interval of its fastest median (cells the repeats cannot order), the
    one with the shortest draft length k (an adaptive k last), then the fastest median.

    Why the shortest k: cells of one drafter and exit often run within a few per cent of each other,
    closer than a sweep's repeats on a busy machine can order them, and a benchmark minutes later may
    order them otherwise (docs/performance.md, "Figures behind the code's choices"); of such cells the
    shortest k verifies fewer drafts a round, so it loses least where α falls on other text. Whether a
    pick beats plain is `beats_plain`'s question, asked at the write-back."""
    ordered = sorted(rows, key=lambda row: -row["speedup"])
    fastest = {}
    for drafter in dict.fromkeys(row["drafter"] for row in ordered):
        own = [row for row in ordered if row["drafter"] == drafter]
        top = own[0]
        tied = [row for row in own if row["speedup"] >= top.get("low", top["speedup"])]
        fastest[drafter] = min(tied, key=lambda row: (_draft_length(row), -row["speedup"]))
    best = max(fastest.values(), key=lambda row: row["speedup"], default=None)
    return best, fastest


def _draft_length(row: dict) -> float:
    """A re-timed row's draft length k for `select_fastest` (an adaptive k counts as the longest; rows
    without settings as 0, no preference)."""
    k = row.get("settings", {}).get("num_speculations", 0)
    return float("inf") if isinstance(k, str) else k


def confirm_candidates(rows: list[dict], confirm: int) -> list[dict]:
    """The cells to re-time: each drafter's `confirm` fastest grid rows (by the grid's median speedup),
    fastest first within each drafter. Not the grid's few fastest overall: where one drafter leads
    (copies on code), those would all be its cells, and another drafter's pick would rest on its one
    luckiest grid cell, which a grid of single short repeats often is (docs/performance.md,
    "Figures behind the code's choices")."""
    picked: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda row: -row["speedup"]):
        own = picked.setdefault(row["drafter"], [])
        if len(own) < confirm:
            own.append(row)
    return [row for own in picked.values() for row in own]


def fused_applies(device, structured: bool) -> bool:
    """Whether a row's rounds can run many in one compiled call (`DecodeSettings.fused`): on the CPU with
    its compiled rounds (`backends.cpu_rounds.greedy_rounds`), without a grammar (constrained rounds run
    from Python)."""
    return torch.device(device).type == "cpu" and not structured and round_kernels.greedy_rounds() is not None


def overlap_applies(device, structured: bool) -> bool:
    """Whether overlapped rounds can run: where fused rounds can (`fused_applies`), on two threads or
    more."""
    return fused_applies(device, structured) and torch.get_num_threads() >= 2


def with_python_rounds(candidates: list[dict]) -> list[dict]:
    """`candidates` (grid rows, each drafter's fastest first), and each drafter's first again with its
    rounds from Python (`DecodeSettings.fused` False; not an overlapped one, which only a compiled call
    runs): which is faster depends on the drafter and the model (docs/performance.md, "The fused loop
    against Python rounds"), so the re-timing decides."""
    firsts = {}
    for row in candidates:
        firsts.setdefault(row["drafter"], row)
    return candidates + [{**row, "fused": False} for row in firsts.values() if not row.get("overlap")]


def settings_of(row: dict) -> DecodeSettings:
    """The `DecodeSettings` of a grid row of the report (its `to_json` fields)."""
    # a report written before a field existed lacks it: its default
    return DecodeSettings.from_json({key: row[key] for key in FIELDS if key in row})


def check_drafters(drafters, draft_vocab_sizes, min_ngrams, token_counts) -> None:
    """Refuse an unknown drafter, a negative V', a bad copy threshold, or V' without token counts."""
    unknown = [d for d in drafters if d not in DRAFTERS]
    if unknown or not drafters:
        raise UserError(f"drafters {unknown or list(drafters)} are not in {', '.join(DRAFTERS)}")
    if any(v < 0 for v in draft_vocab_sizes) or not draft_vocab_sizes:
        raise UserError(f"draft vocabulary sizes {list(draft_vocab_sizes)} must be >= 0 (0: the whole head)")
    if any(v for v in draft_vocab_sizes) and token_counts is None:
        raise UserError("a trimmed draft head needs the checkpoint's token counts; "
                        "run `selfspec draft-vocab MODEL`")
    for n in min_ngrams:
        DecodeSettings().override(min_ngram=n)  # validates


LONG_PROMPT_ROOM = 16  # positions past a long prompt and its new tokens that a round's drafts may take


def run_sweep(checkpoint: LoadedCheckpoint, prompts: list[list[int]], exit_layers: list[int],
              grid: SweepGrid | None = None, *, progress: bool = True,
              long_prompts: list[list[int]] | None = None) -> SweepReport:
    """Measure every setting of the grid against plain decoding; returns the report as a dict.

    checkpoint.settings: the settings the grid varies (the checkpoint's, or `DecodeSettings()`);
    token_counts: (V,) token frequencies (the checkpoint's), needed for draft_vocab_sizes other than 0;
    exit_adapters: E -> the checkpoint's `ExitAdapter` for that exit (its draft cost is measured with it).
    grid.stop_belows: the η values of the early exit's stopping rule (0: never stops); the first one's
    cells give the α and c per exit. grid.confirm / confirm_repeats: re-time each drafter's `confirm`
    fastest lossless cells (`confirm_candidates`) with plain decoding over `confirm_repeats` interleaved
    repeats ("best", "fastest_per_drafter" and "confirmed" come from them), after `long_prompts` too
    where given (interleaved with the short ones; each repeat's speedup the geometric mean of the two);
    confirm = 0 judges the cells by the grid's own repeats. prompts may be `prompts.Structured`
    (structured output): each decodes under its grammar, which needs the checkpoint's tokenizer.
    """
    grid = grid or SweepGrid()
    num_layers = count_layers(checkpoint.model)
    _check_grid(grid, exit_layers, num_layers, prompts, checkpoint.token_counts)
    base = checkpoint.settings
    generator = SelfSpecGenerator(checkpoint.model, checkpoint.tokenizer,
                                  settings=base.override(exit_layer=base.exit_layer or exit_layers[0]),
                                  token_counts=checkpoint.token_counts,
                                  exit_adapters=checkpoint.exit_adapters)
    generator.check_cache = False  # a timed run does no per-round bookkeeping
    sampling = grid.sampling_keywords(seed=0) if not grid.sampling().greedy else {}

    def run(setting: DecodeSettings, batch):
        keywords = constraint_keywords([p.constraint if isinstance(p, Structured) else None for p in batch])
        out = generator.generate([p.ids if isinstance(p, Structured) else p for p in batch],
                                 max_new_tokens=grid.max_new_tokens, eos_token_id=[], settings=setting,
                                 **sampling, **keywords)
        return out.sequences, out.stats

    device = generator.view.device
    structured = any(isinstance(p, Structured) for p in prompts)
    overlaps = (False, True) if overlap_applies(device, structured) else (False,)
    settings = grid_settings(base, exit_layers, grid.ks, grid.drafters, grid.draft_vocab_sizes,
                             grid.min_ngrams, grid.stop_belows, overlaps)
    plain = settings[0]
    timings = interleaved_rates(settings, run, [[p] for p in prompts], grid.repeats, grid.warmup, device,
                                "sweep" if progress else None)  # batch 1
    per_exit, rows = _grid_rows(timings, settings, exit_layers, grid)
    lossless = [row for row in rows if row["identical_to_plain"] is not False]
    if grid.confirm:
        candidates = confirm_candidates(lossless, grid.confirm)
        if fused_applies(device, structured):
            candidates = with_python_rounds(candidates)
        confirmed = _confirm(candidates, plain, run, prompts, long_prompts, grid, device, progress)
    else:
        plain_rates = timings.rates(plain)
        confirmed = [{**_brief(row), **median_interval(paired_speedups(timings.rates(s), plain_rates)),
                      "grid_speedup": row["speedup"], "drafter": row["drafter"]}
                     for row, s in zip(rows, settings[1:]) if row["identical_to_plain"] is not False]
    best, fastest = select_fastest(confirmed)
    ratios = [row["measured_over_predicted"] for row in rows if row.get("measured_over_predicted", 0) > 0]
    return {"num_layers": num_layers, "max_new_tokens": grid.max_new_tokens, "num_prompts": len(prompts),
            "measured_over_predicted": statistics.median(ratios) if ratios else float("nan"),
            "table_stop_below": grid.stop_belows[0], "sampling": grid.sampling().describe(),
            "repeats": grid.repeats, "warmup": grid.warmup, "device": str(device),
            "plain_tokens_per_second": statistics.median(timings.rates(plain)),
            "plain_step_seconds": pooled_costs(timings.run_stats(plain), [])["plain_step"],
            "per_exit_layer": per_exit, "grid": rows,
            "confirm_repeats": grid.confirm_repeats if grid.confirm else grid.repeats,
            "confirmed": sorted(confirmed, key=lambda row: -row["speedup"]),
            "fastest_per_drafter": fastest, "best": best,
            **({"confirm_context": len(long_prompts[0])} if grid.confirm and long_prompts else {}),
            "all_identical_to_plain": len(lossless) == len(rows) if grid.sampling().greedy else None,
            "diagnosis": diagnosis(rows, per_exit, fastest, generator.view)}


def _check_grid(grid: SweepGrid, exit_layers: list[int], num_layers: int, prompts: list,
                token_counts) -> None:
    """A UserError for an exit outside the model, a bad draft length, count or drafter, or no prompt."""
    bad = [e for e in exit_layers if not 1 <= e < num_layers]
    if bad or not exit_layers:
        raise UserError(f"exit layers {bad or exit_layers} are not in 1..{num_layers - 1}: E = N would "
                        f"draft with the whole model")
    ks = list(grid.ks)
    if not ks or any(k not in ADAPTIVE_K if isinstance(k, str) else k < 1 for k in ks):
        raise UserError(f"draft lengths {ks} must be ints >= 1 or {' / '.join(ADAPTIVE_K)} "
                        f"(plain decoding, k = 0, is always measured)")
    if (grid.max_new_tokens < 1 or grid.repeats < 1 or not prompts or grid.confirm < 0
            or grid.confirm_repeats < 1):
        raise UserError(f"the sweep needs max_new_tokens >= 1 ({grid.max_new_tokens}), repeats >= 1 "
                        f"({grid.repeats}), confirm >= 0 ({grid.confirm}), confirm_repeats >= 1 "
                        f"({grid.confirm_repeats}) and a prompt ({len(prompts)})")
    check_drafters(grid.drafters, grid.draft_vocab_sizes, grid.min_ngrams, token_counts)
    for stop_below in grid.stop_belows:
        DecodeSettings(stop_below=stop_below)  # validates


def _grid_rows(timings: Timings, settings: list[DecodeSettings], exit_layers: list[int],
               grid: SweepGrid) -> tuple[dict, list[dict]]:
    """(per exit and V': α, c and the draft step, the early exit's runs pooled over k at the first η;
    a row per grid cell but plain: its speed, α, sources and, in the table, the cost model's
    prediction)."""
    plain = settings[0]
    stats = {s: timings.run_stats(s) for s in settings}
    plain_rate, table_eta = statistics.median(timings.rates(plain)), grid.stop_belows[0]
    per_exit = {}  # str(E) -> {str(V'): α, c, draft step}
    for e in exit_layers:
        for v in grid.draft_vocab_sizes:
            runs = [s for setting in settings if _in_table(setting.to_json(), table_eta)
                    and (setting.exit_layer, setting.draft_vocab_size) == (e, v) for s in stats[setting]]
            if runs:
                costs = pooled_costs(stats[plain], runs)
                per_exit.setdefault(str(e), {})[str(v)] = {
                    "acceptance_rate": costs["stats"].acceptance_rate, "draft_cost": costs["draft_cost"],
                    "draft_step_seconds": costs["draft_step"]}
    rows = []
    for setting in settings[1:]:
        run_costs = pooled_costs(stats[plain], stats[setting])
        alpha = run_costs["stats"].acceptance_rate
        rate = statistics.median(timings.rates(setting))
        spread = median_interval(paired_speedups(timings.rates(setting), timings.rates(plain)))["spread"]
        row = {**setting.to_json(), "tokens_per_second": rate, "speedup": rate / plain_rate,
               "speedup_spread": spread, "acceptance_rate": alpha,
               "mean_accepted_length": run_costs["stats"].mean_accepted_length,
               "sources": source_summary(stats[setting]),
               "stopped_below_eta": sum(s.stopped_below_eta for s in stats[setting]),
               "identical_to_plain": _identical(timings, setting, plain, grid)}
        if _in_table(row, table_eta):
            cost = per_exit[str(setting.exit_layer)][str(setting.draft_vocab_size)]["draft_cost"]
            if alpha != alpha or not run_costs["draft_steps"]:  # η cut every round: nothing to predict
                row["predicted_speedup"] = row["verify_cost"] = float("nan")
            else:
                # the cost model with this cell's measured verification (in plain steps) and its
                # exit's draft cost c, weighted by the k its rounds used
                row["verify_cost"] = run_costs["verify_per_round"] / run_costs["plain_step"]
                row["predicted_speedup"] = predicted_speedup(run_costs["stats"].k_rounds, alpha, cost,
                                                             row["verify_cost"])
            row["measured_over_predicted"] = row["speedup"] / row["predicted_speedup"]
        rows.append(row)
    return per_exit, rows


def _confirm(candidates: list[dict], plain: DecodeSettings, run, prompts: list, long_prompts: list | None,
             grid: SweepGrid, device, progress: bool) -> list[dict]:
    """The lossless `candidates` (grid rows) re-timed against `plain` over `grid.confirm_repeats`
    interleaved repeats, on `prompts` and `long_prompts` (or none): each with its paired speedups
    (`_confirmed_speedups`)."""
    cells = [settings_of(row) for row in candidates]
    # the long prompts' decodes interleaved with the short ones', so each repeat's two speedups share the
    # machine's state
    batches = [[p] for p in [*prompts, *(long_prompts or [])]]
    short = range(len(prompts))
    long = range(len(prompts), len(batches)) if long_prompts else None
    again = interleaved_rates([plain, *cells], run, batches, grid.confirm_repeats, grid.warmup, device,
                              "confirm" if progress else None)
    confirmed = [{**_brief(row), **_confirmed_speedups(again, cell, plain, short, long),
                  "tokens_per_second": statistics.median(again.rates(cell, short)),
                  "grid_speedup": row["speedup"], "drafter": row["drafter"],
                  "identical_to_plain": _identical(again, cell, plain, grid)}
                 for row, cell in zip(candidates, cells)]
    return [row for row in confirmed if row["identical_to_plain"] is not False]


def _confirmed_speedups(timings: Timings, cell: DecodeSettings, plain: DecodeSettings, short,
                        long=None) -> dict:
    """A re-timed cell's median paired speedup and its interval (`median_interval`) over the repeats of
    `timings`, on the batches `short` (indices); with `long` (the long prompts' batches) each repeat's
    speedup is the geometric mean of its speedups on both, their medians beside it ("speedup_short",
    "speedup_long")."""
    ratios = paired_speedups(timings.rates(cell, short), timings.rates(plain, short))
    if long is None:
        return median_interval(ratios)
    long_ratios = paired_speedups(timings.rates(cell, long), timings.rates(plain, long))
    both = [(a * b) ** 0.5 for a, b in zip(ratios, long_ratios)]
    return {**median_interval(both), "speedup_short": statistics.median(ratios),
            "speedup_long": statistics.median(long_ratios)}


def _identical(timings: Timings, cell: DecodeSettings, plain: DecodeSettings, grid: SweepGrid) -> bool | None:
    """Whether a cell's greedy outputs equal plain decoding's; None for a sampled grid, whose outputs
    are draws (the distribution tests hold sampled decoding lossless)."""
    return timings.outputs[cell] == timings.outputs[plain] if grid.sampling().greedy else None


def diagnosis(grid: list[dict], per_exit: dict, fastest: dict, view) -> str | None:
    """`selfspec doctor`'s checklist in one paragraph: the fastest early-exit cell of the table (a
    fixed k) read as the doctor reads its probe (α against the α its exit's c and its own measured v
    need, c against the weights' share), then the fastest of each drafter."""
    cells = [row for row in grid if row["drafter"] == "early_exit" and "verify_cost" in row
             and isinstance(row["num_speculations"], int) and row["verify_cost"] == row["verify_cost"]]
    speedups = {drafter: row["speedup"] for drafter, row in fastest.items()}
    figures = {"speedups": speedups}
    if cells:
        row = max(cells, key=lambda r: r["speedup"])
        e, v = row["exit_layer"], row["draft_vocab_size"]
        figures.update(alpha=row["acceptance_rate"], k=row["num_speculations"], exit_layer=e,
                       draft_cost=per_exit[str(e)][str(v)]["draft_cost"], verify_cost=row["verify_cost"],
                       weight_cost=weight_cost(view, e, v or 0), weights_in_cache=weights_in_cache(view))
    return summary(figures)


def _in_table(row: dict, stop_below: float) -> bool:
    """An early-exit setting of the (E, V') x k table: the one η the table shows, rounds one after
    another (other η and overlapped rounds are listed; their c is not a draft step's)."""
    return (row["drafter"] == "early_exit" and row["num_speculations"] != 0
            and row["stop_below"] == stop_below and not row.get("overlap"))


def _spread(row: dict) -> str:
    low, high = row.get("speedup_spread") or row["spread"]
    return f"{low:.2f}-{high:.2f}"


def _brief(row: dict) -> dict:
    """A row's settings and speed: what "best" and "fastest_per_drafter" hold."""
    return {"settings": settings_of(row).to_json(), "speedup": row["speedup"],
            "tokens_per_second": row["tokens_per_second"]}


def _describe(entry: dict) -> str:
    """A grid row or a `_brief` entry as one line."""
    return (DecodeSettings.from_json(entry["settings"]) if "settings" in entry
            else settings_of(entry)).describe()


def to_markdown(report: dict) -> str:
    early = [r for r in report["grid"] if _in_table(r, report["table_stop_below"])]
    ks = sorted({row["num_speculations"] for row in early}, key=k_order)
    vocabs = sorted({row["draft_vocab_size"] for row in early})
    lines = [f"# Drafter sweep: measured speedup over plain decoding ({report['num_layers']} layers)", "",
             f"{report['num_prompts']} prompts, batch 1, {report['max_new_tokens']} new tokens, greedy, "
             f"{report['device']}; plain {report['plain_tokens_per_second']:.1f} tokens/s; median of "
             f"{report['repeats']} interleaved repeats after {report['warmup']} warm-up."]
    if report.get("context"):
        lines += ["", f"After prompts of {report['context']} tokens: the pick for greedy decodes from "
                      f"{report['from_tokens']} tokens of context on."]
    if early:
        lines += ["",
                  "Early-exit drafts, cells: measured × (cost model E(k,α)/(k·c + v), v the cell's measured "
                  "verification in plain steps); V' 0 is the whole head.",
                  "",
                  "| E | V' | α | α kept | c | " + " | ".join(f"k={k}" for k in ks) + " |",
                  "|---|---:|---:|---:|---:|" + "---:|" * len(ks)]
        for exit_layer, per_vocab in report["per_exit_layer"].items():
            full_alpha = per_vocab.get(str(vocabs[0]), {}).get("acceptance_rate")
            for vocab, summary in per_vocab.items():
                cells = {row["num_speculations"]: row for row in early
                         if str(row["exit_layer"]) == exit_layer and str(row["draft_vocab_size"]) == vocab}
                kept = summary["acceptance_rate"] / full_alpha if full_alpha else float("nan")
                lines.append(f"| {exit_layer} | {vocab} | {summary['acceptance_rate']:.3f} | {kept:.3f} | "
                             f"{summary['draft_cost']:.3f} | "
                             + " | ".join(f"{cells[k]['speedup']:.2f} ({cells[k]['predicted_speedup']:.2f})"
                                          for k in ks) + " |")
    others = [r for r in report["grid"] if not _in_table(r, report["table_stop_below"])]
    if others:
        lines += ["", "Copying drafters, other η and overlapped rounds (α of copies / of early-exit drafts; "
                      "share of tokens from copies):",
                  "",
                  "| setting | speedup | spread | tokens/s | α copy | α early exit | tokens copied |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for row in sorted(others, key=lambda r: -r["speedup"]):
            copy, early_exit = row["sources"]["copy"], row["sources"]["early_exit"]
            lines.append(f"| {_describe(row)} | {row['speedup']:.2f} | {_spread(row)} | "
                         f"{row['tokens_per_second']:.1f} | "
                         f"{copy['acceptance_rate']:.3f} | {early_exit['acceptance_rate']:.3f} | "
                         f"{copy['share_of_tokens']:.1%} |")
    if report.get("confirmed"):
        lines += ["", f"Re-timed against plain decoding ({report['confirm_repeats']} interleaved repeats): "
                      f"median paired speedup, the interval for it and its coverage, the spread; a cell is "
                      f"stored only when the interval's low end beats plain.", "",
                  "| setting | grid | re-timed | interval | coverage | spread | beats plain |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {_describe(row)} | {row['grid_speedup']:.2f} | {row['speedup']:.3f} | "
                  f"{row['low']:.3f}-{row['high']:.3f} | {row['coverage']:.0%} | {_spread(row)} | "
                  f"{'yes' if beats_plain(row) else 'no'} |" for row in report["confirmed"]]
        if report.get("confirm_context"):
            lines += ["", f"Re-timed after prompts of {report['confirm_context']} tokens too; each repeat's "
                          f"speedup is the geometric mean of the short and the long one:", "",
                      "| setting | short prompts | long prompts |", "|---|---:|---:|"]
            lines += [f"| {_describe(row)} | {row['speedup_short']:.3f} | {row['speedup_long']:.3f} |"
                      for row in report["confirmed"]]
    if report.get("fastest_per_drafter"):
        lines += ["", "Fastest per drafter: " + "; ".join(
            f"{_describe(row)}: {row['speedup']:.2f}× ({row['low']:.2f}-{row['high']:.2f})"
            for row in report["fastest_per_drafter"].values())]
    if early:
        costs = [row["verify_cost"] for row in early if row["verify_cost"] == row["verify_cost"]]
        ratio = report["measured_over_predicted"]
        lines += ["", f"Measured ÷ predicted, median over the cells: {ratio:.2f}; "
                      f"a verification costs {min(costs, default=float('nan')):.2f}-"
                      f"{max(costs, default=float('nan')):.2f} plain steps."]
    best = report["best"]
    fastest = "none (no output matched plain decoding)" if best is None else (
        f"{_describe(best)}: **{best['speedup']:.2f}×** plain decoding "
        f"({best['low']:.2f}-{best['high']:.2f}, {best['coverage']:.0%})")
    identical = report["all_identical_to_plain"]
    lines += ["", f"Fastest: {fastest}. " + (f"Outputs identical to plain decoding: **{identical}**"
                                             if identical is not None else
                                             f"Sampled ({report['sampling']}): outputs are draws, α the "
                                             f"sampled acceptance.")]
    if report.get("diagnosis"):
        lines += ["", report["diagnosis"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str | Path) -> Path:
    """Measured speedup against k per exit layer: early exit (solid; cost model dashed) and the
    hybrid's best threshold and V' (dotted)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, exit_layer in enumerate(report["per_exit_layer"]):
        colour = f"C{index % 10}"
        for drafter, style in (("early_exit", "o-"), ("hybrid", "s:")):
            best_per_k = {}
            for r in report["grid"]:
                # the early exit's cells with the cost model's prediction: the table's (one η, rounds in turn)
                shown = drafter == "hybrid" or _in_table(r, report["table_stop_below"])
                if r["drafter"] == drafter and str(r["exit_layer"]) == exit_layer and shown:
                    k = r["num_speculations"]
                    if k not in best_per_k or r["speedup"] > best_per_k[k]["speedup"]:
                        best_per_k[k] = r
            rows = [best_per_k[k] for k in sorted(best_per_k, key=k_order)]
            if not rows:
                continue
            # adaptive k: in the tables only
            rows = [r for r in rows if isinstance(r["num_speculations"], int)]
            ks = [r["num_speculations"] for r in rows]
            ax.plot(ks, [r["speedup"] for r in rows], style, color=colour,
                    label=f"{drafter}, E = {exit_layer}")
            if drafter == "early_exit":
                ax.plot(ks, [r["predicted_speedup"] for r in rows], "--", color=colour, alpha=0.6)
    for r in report["grid"]:
        if r["drafter"] == "ngram":
            ax.axhline(r["speedup"], color="black", linestyle="-.", linewidth=0.8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(sorted({r["num_speculations"] for r in report["grid"]
                          if r["drafter"] != "ngram" and isinstance(r["num_speculations"], int)}) or [0])
    ax.set_xlabel("k (early-exit draft length)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("measured (solid, dotted), cost model (dashed), n-gram only (dash-dot)", fontsize="small")
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    return save_figure(fig, path)


def sweep(options: SweepOptions) -> SweepReport:
    """`selfspec eval sweep`: measure the grid on the model `options.model`; print the report, write
    sweep.json, sweep.md and sweep.png into `options.out`, and with `write_back` the fastest setting into
    its selfspec.json.

    exit_layers: a list, or a string `parse_layers` reads ('2,4,6', '2:10:2', 'all'; default all).
    ks, drafters, min_ngrams, draft_vocab_sizes, stop_belows: lists, or comma lists as the flags take them.
    suites / questions: time the first turns of these questions (`evaluation.prompts.suite_prompts`, the first
    `max_per_category` of each category) instead of `prompts` / `corpus`; the write-back records them.
    confirm / confirm_repeats: how many of each drafter's fastest cells to re-time, over how many
    repeats (`run_sweep`).

        sweep(SweepOptions(model="runs/demo/model", exit_layers="2:10:2", ks="1,2,4", write_back=True))
    """
    model = options.model
    base, _, counts = resolve_settings(model)
    if options.write_back and not (Path(model) / META_FILE).is_file():
        raise UserError(f"--write-back needs a tuned checkpoint: {model} has no {META_FILE}")
    # before loading anything
    check_drafters(options.drafters, options.draft_vocab_sizes, options.min_ngrams, counts)
    checkpoint = load_checkpoint(model, base, None, counts, device=options.device, dtype=options.dtype)
    lm, tokenizer = checkpoint.model, checkpoint.tokenizer
    exit_layers = options.exit_layers
    if exit_layers is None or isinstance(exit_layers, str):
        exit_layers = parse_layers(exit_layers or "all", count_layers(lm))
    if options.suites or options.questions:
        positions = DecoderView(lm).max_positions  # the family's own limit (GPT-2: n_positions)
        chosen = suite_prompts(tokenizer, options.suites, options.questions, options.max_per_category,
                               positions and positions - options.max_new_tokens)
    else:
        chosen = read_prompts(tokenizer, options.prompts, options.corpus, options.num_prompts,
                              options.prompt_tokens)
    max_positions = DecoderView(lm).max_positions
    lengths = cost_lengths(options.cost_lengths, max_positions)
    long_prompts = None
    if options.confirm_context:
        long_prompts = long_sweep_prompts(tokenizer, options, max_positions, options.confirm_context)
    from_tokens = None
    if options.context:  # the grid after long prompts: a pick from `from_tokens` of context on
        from_tokens = switch_length(chosen, options.context)
        chosen = long_sweep_prompts(tokenizer, options, max_positions, options.context)
    report = run_sweep(checkpoint, chosen, list(exit_layers), options, long_prompts=long_prompts)
    report.update(model=model, prompts_from=", ".join(filter(None, (options.suites, options.questions)))
                  or options.prompts or options.corpus,
                  **({"context": options.context, "from_tokens": from_tokens} if from_tokens else {}))
    if options.write_back:  # a sampled grid's pick: for calls near its temperature (`formats["sampled@T"]`)
        kind = ("json_schema" if options.prompts == JSON_EXTRACT
                else context_key(from_tokens) if from_tokens
                else None if options.sampling().greedy else sampled_key(options.sampling().temperature))
        write_back_fastest(model, report, Path(options.out) / "sweep.json", constraint_kind=kind)
        if kind is None and lengths:
            report["round_costs"] = write_back_costs(model, checkpoint, chosen, lengths)
    publish(options.out, "sweep", report, to_markdown(report), plot)
    return report


def long_sweep_prompts(tokenizer, options: SweepOptions, max_positions: int | None,
                       length: int) -> list[list[int]]:
    """Prompts of `length` tokens (`prompts_from_corpus`, from --corpus's test documents twice as long), or
    a UserError where the model's positions cannot hold them and the new tokens."""
    need = length + options.max_new_tokens + LONG_PROMPT_ROOM
    if max_positions is not None and need > max_positions:
        flag = "--context" if options.context else "--confirm-context"
        raise UserError(f"{flag} {length} plus --max-new-tokens {options.max_new_tokens} and "
                        f"{LONG_PROMPT_ROOM} positions for a round's drafts pass the model's "
                        f"{max_positions}; lower {flag}")
    return prompts_from_corpus(tokenizer, options.corpus, options.num_prompts, length)


def switch_length(short_prompts: list, context: int) -> int:
    """From how many tokens of context a pick timed after `context`-token prompts serves greedy decodes:
    the geometric mean of that and the short prompts' median length (where the checkpoint's own pick was
    timed). Speedups by (E, k) move about linearly in log context (docs/results.md, "Long contexts"), so
    two picks cross near the middle of their lengths on a log scale."""
    short = statistics.median(len(p) for p in short_prompts)
    return max(1, min(context, round((short * context) ** 0.5)))


def write_back_costs(model: str, checkpoint: LoadedCheckpoint, prompts: list,
                     lengths: tuple[int, ...]) -> list[dict]:
    """Measure a round's costs at `lengths` with the checkpoint's (new) settings and store them in the
    selfspec.json of `model` (its directory) under `round_costs`, for this device type
    (`context_costs.measure_round_costs`; overlapped rounds too wherever they can run here, whether the
    stored settings overlap or not: a call or a drafter's fastest may); returns the rows per length."""
    settings = read_settings(model)
    generator = SelfSpecGenerator(checkpoint.model, checkpoint.tokenizer, settings=settings,
                                  token_counts=token_counts_for(model, settings.draft_vocab_size),
                                  exit_adapters=checkpoint.exit_adapters)
    tokens = [t for p in prompts for t in (p.ids if isinstance(p, Structured) else p)]
    overlap = overlap_applies(generator.view.device, any(isinstance(p, Structured) for p in prompts))
    costs, rows = measure_round_costs(generator, tokens, settings.override(overlap=overlap), lengths)
    device = generator.view.device.type
    update_meta(model, round_costs={**read_meta(model).get("round_costs", {}), device: costs.to_json()})
    print(f"{model}/{META_FILE}: round costs on {device} by context length\n{costs_table(rows)}")
    return rows


def write_back_fastest(model_dir: str, report: dict, report_path: Path,
                       constraint_kind: str | None = None) -> bool:
    """Record the sweep's fastest re-timed setting in the checkpoint's selfspec.json, only when it is
    lossless and beats plain decoding by more than the noise (`beats_plain`; else the checkpoint
    keeps its own), with each drafter's fastest that does beside it. Returns whether it wrote.
    constraint_kind: the prompts decoded under constraints of that kind ("json_schema", ...): the
    setting goes under `formats` instead, the default of calls under such a constraint
    (`checkpoint.format_settings`), and the checkpoint's own defaults stay."""
    entries = (report["best"], *report["fastest_per_drafter"].values())
    rows = report.get("confirmed") or [entry for entry in entries if entry]
    best, fastest = select_fastest([row for row in rows if beats_plain(row)])
    if best is None:
        print(f"{model_dir}/{META_FILE} left as it is: no lossless setting beat plain decoding by more than "
              f"the noise of its repeats")
        return False
    record = {"speedup": best["speedup"], "interval": [best["low"], best["high"]],
              "coverage": best["coverage"], "report": str(report_path),
              "prompts_from": report.get("prompts_from"),
              # the speedups judged after prompts of this many tokens too (their geometric mean), or absent
              **({"confirm_context": report["confirm_context"]} if report.get("confirm_context") else {}),
              # a long-context pick: timed after prompts of this many tokens
              **({"context": report["context"]} if report.get("context") else {}),
              # every lossless re-timed cell: `selfspec eval speedup --candidates` times them again
              "candidates": [{key: row[key] for key in ("drafter", "settings", "speedup")}
                             for row in report.get("confirmed", [])]}
    if constraint_kind is not None:
        formats = {key: entry for key, entry in read_meta(model_dir).get("formats", {}).items()
                   if not (constraint_kind.startswith(CONTEXT) and key.startswith(CONTEXT))}  # one long pick
        formats[constraint_kind] = {"settings": best["settings"], **record, "fastest": fastest}
        update_meta(model_dir, formats=formats)
        at = constraint_kind.partition("@")[2]
        under = (f"for sampled calls near temperature {at}" if constraint_kind.startswith(SAMPLED)
                 else f"for greedy decodes from {at} tokens of context on"
                 if constraint_kind.startswith(CONTEXT) else f"under a {constraint_kind} constraint")
        print(f"{model_dir}/{META_FILE}: {under}, {_describe(best)}")
        return True
    write_settings(model_dir, DecodeSettings.from_json(best["settings"]), fastest=fastest, sweep=record)
    print(f"{model_dir}/{META_FILE}: {_describe(best)}")
    return True


__all__ = ["float_list", "grid_settings", "int_list", "k_list", "plot", "run_sweep", "select_fastest",
           "settings_of", "sweep", "to_markdown", "write_back_costs", "write_back_fastest"]
