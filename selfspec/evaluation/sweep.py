"""Sweep of drafters and their settings: which decodes fastest, measured side by side.

The grid: plain decoding (k = 0) once; early-exit drafting at every exit layer E × draft length k ×
draft-head size V'; the hybrid drafter (copies from the context, the early exit otherwise) at every
E × k × V' × copy threshold (`min_ngram`); the n-gram drafter alone at every threshold. The engine
decodes the same prompts greedily at batch 1 with each setting. Every round visits all settings,
the order rotating from round to round (interleaved, so drift hits all alike); each setting's
tokens/s is the median over rounds. Per (E, V') it reports α and the draft cost c (draft step ÷
plain step), and how much of the whole head's α each V' keeps; per setting the measured speedup over
plain and, for early-exit drafting, the cost model's E(k, α)/(1 + k·c). Every output must equal plain
decoding's (checked, reported).

    selfspec eval sweep --model runs/demo/model --exit-layers 2:10:2 --ks 1,2,4,6,8 --write-back

writes sweep.json, sweep.md and sweep.png into --out; --write-back records the fastest setting
(drafter, E, k, V', min_ngram) in the checkpoint's selfspec.json (what `load_tuned` then uses).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ..checkpoint import META_FILE, read_meta, read_token_counts, update_meta
from ..config import parse_layers
from ..decoding import DRAFTERS, NGramConfig, SelfSpecGenerator, make_policy
from ..decoding.draft_head import frequent_tokens
from ..metrics import predicted_speedup, speedup_simple
from ..model import num_layers as count_layers
from .benchmark import (
    checkpoint_adapters,
    interleaved_rates,
    load_model,
    pooled_costs,
    read_prompts,
    source_summary,
)
from .report import save_figure, write_report


@dataclass(frozen=True)
class Setting:
    """One cell of the grid. drafter "plain" is k = 0; vocab 0 is the whole head; min_ngram 0: no copying."""

    drafter: str
    exit_layer: int = 0
    k: int | str = 0  # an int, or "auto" / "window" (an adaptive controller)
    vocab: int = 0
    min_ngram: int = 0


PLAIN = Setting("plain")
ADAPTIVE = ("auto", "window")  # draft lengths chosen per round by a controller


def grid_settings(exit_layers, ks, drafters, vocabs, min_ngrams) -> list[Setting]:
    """Plain first, then every combination each drafter uses (the n-gram drafter has no E, k or V')."""
    settings = [PLAIN]
    for drafter in drafters:
        if drafter == "ngram":
            settings += [Setting("ngram", min_ngram=n) for n in min_ngrams]
            continue
        for e in exit_layers:
            for v in vocabs:
                for k in ks:
                    settings += ([Setting(drafter, e, k, v, n) for n in min_ngrams] if drafter == "hybrid"
                                 else [Setting(drafter, e, k, v)])
    return settings


def check_drafters(drafters, draft_vocab_sizes, min_ngrams, token_counts) -> None:
    """Refuse an unknown drafter, a negative V', a bad copy threshold, or V' without token counts."""
    unknown = [d for d in drafters if d not in DRAFTERS]
    if unknown or not drafters:
        raise ValueError(f"drafters {unknown or list(drafters)} are not in {', '.join(DRAFTERS)}")
    if any(v < 0 for v in draft_vocab_sizes) or not draft_vocab_sizes:
        raise ValueError(f"draft vocabulary sizes {list(draft_vocab_sizes)} must be >= 0 (0: the whole head)")
    if any(v for v in draft_vocab_sizes) and token_counts is None:
        raise ValueError("a trimmed draft head needs the checkpoint's token counts; run `selfspec draft-vocab MODEL`")
    for n in min_ngrams:
        NGramConfig(max(3, n), n)  # validates


def run_sweep(model, prompts: list[list[int]], exit_layers: list[int], ks: list[int], max_new_tokens: int = 64,
              repeats: int = 3, warmup: int = 1, progress: bool = True, drafters=("early_exit",),
              draft_vocab_sizes=(0,), min_ngrams=(2,), token_counts=None, exit_adapters: dict | None = None) -> dict:
    """Measure every setting of the grid against plain decoding; returns the report as a dict.

    token_counts: (V,) token frequencies (the checkpoint's), needed for draft_vocab_sizes other than 0.
    exit_adapters: E -> the checkpoint's `ExitAdapter` for that exit (its draft cost is measured with it).
    """
    num_layers = count_layers(model)
    bad = [e for e in exit_layers if not 1 <= e < num_layers]
    if bad or not exit_layers:
        raise ValueError(f"exit layers {bad or exit_layers} are not in 1..{num_layers - 1}: E = N would "
                         f"draft with the whole model")
    if not ks or any(k not in ADAPTIVE if isinstance(k, str) else k < 1 for k in ks):
        raise ValueError(f"draft lengths {ks} must be ints >= 1 or {' / '.join(ADAPTIVE)} (plain decoding, k = 0, "
                         f"is always measured)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_drafters(drafters, draft_vocab_sizes, min_ngrams, token_counts)
    generators = {(e, v): SelfSpecGenerator(model, exit_layer=e, check_cache=False,
                                            draft_vocab=frequent_tokens(token_counts, v) if v else None,
                                            exit_adapter=(exit_adapters or {}).get(e))
                  for e in exit_layers for v in draft_vocab_sizes}

    def run(setting: Setting, batch):
        generator = generators[(setting.exit_layer or exit_layers[0], setting.vocab or draft_vocab_sizes[0])]
        drafter = "early_exit" if setting.drafter == "plain" else setting.drafter
        if drafter != "early_exit":  # a fresh policy with this setting's copy threshold
            drafter = make_policy(drafter, setting.k, NGramConfig(max(3, setting.min_ngram), setting.min_ngram))
        out = generator.generate(batch, max_new_tokens=max_new_tokens, num_speculations=setting.k,
                                 drafter=drafter, eos_token_id=[])
        return out.sequences, out.stats

    settings = grid_settings(exit_layers, ks, drafters, draft_vocab_sizes, min_ngrams)
    device = next(iter(generators.values())).view.device
    rates, outputs, stats = interleaved_rates(settings, run, [[p] for p in prompts], repeats, warmup, device,
                                              "sweep" if progress else None)  # batch 1

    plain_rate = statistics.median(rates[PLAIN])
    per_exit = {}  # str(E) -> {str(V'): α, c, draft step}: early-exit runs pooled over k
    for e in exit_layers:
        for v in draft_vocab_sizes:
            runs = [s for setting in settings if setting.drafter == "early_exit"
                    and (setting.exit_layer, setting.vocab) == (e, v) for s in stats[setting]]
            if runs:
                costs = pooled_costs(stats[PLAIN], runs)
                per_exit.setdefault(str(e), {})[str(v)] = {
                    "acceptance_rate": costs["stats"].acceptance_rate, "draft_cost": costs["draft_cost"],
                    "draft_step_seconds": costs["draft_step"]}
    grid = []
    for setting in settings[1:]:
        run_costs = pooled_costs(stats[PLAIN], stats[setting])
        alpha = run_costs["stats"].acceptance_rate
        rate = statistics.median(rates[setting])
        row = {**asdict(setting), "num_speculations": setting.k, "tokens_per_second": rate,
               "speedup": rate / plain_rate, "acceptance_rate": alpha,
               "mean_accepted_length": run_costs["stats"].mean_accepted_length,
               "sources": source_summary(stats[setting]),
               "identical_to_plain": outputs[setting] == outputs[PLAIN]}
        if setting.drafter == "early_exit":
            cost = per_exit[str(setting.exit_layer)][str(setting.vocab)]["draft_cost"]
            row["predicted_speedup"] = (speedup_simple(setting.k, alpha, cost) if isinstance(setting.k, int)
                                        else predicted_speedup(run_costs["stats"].k_rounds, alpha, cost))
        grid.append(row)
    lossless = [row for row in grid if row["identical_to_plain"]]
    best = max(lossless, key=lambda row: row["speedup"]) if lossless else None
    fastest = {}  # drafter -> its fastest lossless row
    for row in lossless:
        if row["drafter"] not in fastest or row["speedup"] > fastest[row["drafter"]]["speedup"]:
            fastest[row["drafter"]] = row
    return {"num_layers": num_layers, "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
            "repeats": repeats, "warmup": warmup, "device": str(device),
            "plain_tokens_per_second": plain_rate,
            "plain_step_seconds": pooled_costs(stats[PLAIN], [])["plain_step"],
            "per_exit_layer": per_exit, "grid": grid,
            "fastest_per_drafter": {d: _brief(row) for d, row in fastest.items()},
            "best": None if best is None else _brief(best),
            "all_identical_to_plain": len(lossless) == len(grid)}


def _brief(row: dict) -> dict:
    return {name: row[name] for name in ("drafter", "exit_layer", "num_speculations", "vocab", "min_ngram",
                                         "speedup", "tokens_per_second")}


def _describe(row: dict) -> str:
    if row["drafter"] == "ngram":
        return f"ngram, min_ngram = {row['min_ngram']}"
    text = f"{row['drafter']}, E = {row['exit_layer']}, k = {row['num_speculations']}"
    text += f", V' = {row['vocab']}" if row.get("vocab") else ""
    return text + (f", min_ngram = {row['min_ngram']}" if row["drafter"] == "hybrid" else "")


def to_markdown(report: dict) -> str:
    early = [r for r in report["grid"] if r["drafter"] == "early_exit"]
    ks = sorted({row["num_speculations"] for row in early}, key=_k_order)
    vocabs = sorted({row["vocab"] for row in early})
    lines = [f"# Drafter sweep: measured speedup over plain decoding ({report['num_layers']} layers)", "",
             f"{report['num_prompts']} prompts, batch 1, {report['max_new_tokens']} new tokens, greedy, "
             f"{report['device']}; plain {report['plain_tokens_per_second']:.1f} tokens/s; median of "
             f"{report['repeats']} interleaved repeats after {report['warmup']} warm-up."]
    if early:
        lines += ["", "Early-exit drafts, cells: measured × (cost model E(k,α)/(1+k·c)); V' 0 is the whole head.", "",
                  "| E | V' | α | α kept | c | " + " | ".join(f"k={k}" for k in ks) + " |",
                  "|---|---:|---:|---:|---:|" + "---:|" * len(ks)]
        for exit_layer, per_vocab in report["per_exit_layer"].items():
            full_alpha = per_vocab.get(str(vocabs[0]), {}).get("acceptance_rate")
            for vocab, summary in per_vocab.items():
                cells = {row["num_speculations"]: row for row in early
                         if str(row["exit_layer"]) == exit_layer and str(row["vocab"]) == vocab}
                kept = summary["acceptance_rate"] / full_alpha if full_alpha else float("nan")
                lines.append(f"| {exit_layer} | {vocab} | {summary['acceptance_rate']:.3f} | {kept:.3f} | "
                             f"{summary['draft_cost']:.3f} | "
                             + " | ".join(f"{cells[k]['speedup']:.2f} ({cells[k]['predicted_speedup']:.2f})"
                                          for k in ks) + " |")
    others = [r for r in report["grid"] if r["drafter"] != "early_exit"]
    if others:
        lines += ["", "Copying drafters (α of copies / of early-exit drafts; share of tokens from copies):", "",
                  "| setting | speedup | tokens/s | α copy | α early exit | tokens copied |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in sorted(others, key=lambda r: -r["speedup"]):
            copy, early_exit = row["sources"]["copy"], row["sources"]["early_exit"]
            lines.append(f"| {_describe(row)} | {row['speedup']:.2f} | {row['tokens_per_second']:.1f} | "
                         f"{copy['acceptance_rate']:.3f} | {early_exit['acceptance_rate']:.3f} | "
                         f"{copy['share_of_tokens']:.1%} |")
    if report.get("fastest_per_drafter"):
        lines += ["", "Fastest per drafter: " + "; ".join(
            f"{_describe(row)}: {row['speedup']:.2f}×" for row in report["fastest_per_drafter"].values())]
    best = report["best"]
    fastest = "none (no output matched plain decoding)" if best is None else (
        f"{_describe(best)}: **{best['speedup']:.2f}×** plain decoding")
    lines += ["", f"Fastest: {fastest}. Outputs identical to plain decoding: **{report['all_identical_to_plain']}**"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str | Path) -> Path:
    """Measured speedup against k per exit layer: early exit (solid; cost model dashed) and the
    hybrid's best threshold and V' (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, exit_layer in enumerate(report["per_exit_layer"]):
        colour = f"C{index % 10}"
        for drafter, style in (("early_exit", "o-"), ("hybrid", "s:")):
            best_per_k = {}
            for r in report["grid"]:
                if r["drafter"] == drafter and str(r["exit_layer"]) == exit_layer:
                    k = r["num_speculations"]
                    if k not in best_per_k or r["speedup"] > best_per_k[k]["speedup"]:
                        best_per_k[k] = r
            rows = [best_per_k[k] for k in sorted(best_per_k, key=_k_order)]
            if not rows:
                continue
            rows = [r for r in rows if isinstance(r["num_speculations"], int)]  # adaptive k: in the tables only
            ks = [r["num_speculations"] for r in rows]
            ax.plot(ks, [r["speedup"] for r in rows], style, color=colour, label=f"{drafter}, E = {exit_layer}")
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's flags (`selfspec eval sweep`, `eval/sweep.py`)."""
    parser.add_argument("--model", required=True, help="directory loadable with AutoModelForCausalLM")
    parser.add_argument("--exit-layers", default=None,
                        help="E values: a list '2,4,6', a slice '2:10:2' or 'all' (default: all, 1..N-1)")
    parser.add_argument("--ks", default="1,2,3,4,6,8",
                        help="early-exit draft lengths k, e.g. '1,2,4,8,auto' (auto: the cost model per round)")
    parser.add_argument("--drafters", default="early_exit",
                        help="comma list of " + ", ".join(DRAFTERS) + " (default: early_exit)")
    parser.add_argument("--min-ngrams", default="2",
                        help="copy thresholds of ngram/hybrid: the shortest context match that copies, e.g. '1,2,3'")
    parser.add_argument("--draft-vocab-sizes", default="0",
                        help="V' of the draft head, e.g. '0,2048,8192' (0: the whole head; others need the "
                             "checkpoint's token counts, see `selfspec draft-vocab`)")
    parser.add_argument("--prompts", default=None, help="JSON list (token lists or strings) or text file")
    parser.add_argument("--corpus", default="stdlib", help="without --prompts: prompts from this corpus's test split")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--write-back", action="store_true",
                        help=f"record the fastest setting in the checkpoint's {META_FILE}")


def _k_order(k):
    return (0, k, "") if isinstance(k, int) else (1, 0, k)


def _k_list(value: str) -> list:
    """--ks: ints and the adaptive controllers' names."""
    try:
        return sorted({v.strip() if v.strip() in ADAPTIVE else int(v) for v in value.split(",")}, key=_k_order)
    except ValueError:
        raise ValueError(f"--ks must be a comma list of ints or {'/'.join(ADAPTIVE)} such as '1,2,4,auto', "
                         f"got {value!r}") from None


def _int_list(value: str, flag: str) -> list[int]:
    try:
        return sorted({int(v) for v in value.split(",")})
    except ValueError:
        raise ValueError(f"{flag} must be a comma list of ints such as '1,2,4,8', got {value!r}") from None


def run(args: argparse.Namespace) -> dict:
    """Run the sweep that `args` (from `add_arguments`) describes; prints and writes the report."""
    if args.repeats < 1 or args.max_new_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--repeats, --max-new-tokens and --num-prompts must be >= 1")
    ks = _k_list(args.ks)
    min_ngrams = _int_list(args.min_ngrams, "--min-ngrams")
    vocabs = _int_list(args.draft_vocab_sizes, "--draft-vocab-sizes")
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    has_meta = (Path(args.model) / META_FILE).is_file()
    if args.write_back and not has_meta:
        raise ValueError(f"--write-back needs a tuned checkpoint: {args.model} has no {META_FILE}")
    counts = read_token_counts(args.model) if has_meta and any(vocabs) else None
    check_drafters(drafters, vocabs, min_ngrams, counts)  # before loading anything

    model, tokenizer = load_model(args.model, args.device, args.dtype)
    num_layers = count_layers(model)
    exit_layers = parse_layers(args.exit_layers or "all", num_layers)
    prompts = read_prompts(args, tokenizer)
    report = run_sweep(model, prompts, exit_layers, ks, args.max_new_tokens, args.repeats, args.warmup,
                       drafters=drafters, draft_vocab_sizes=vocabs, min_ngrams=min_ngrams, token_counts=counts,
                       exit_adapters=checkpoint_adapters(args.model, model, read_meta(args.model)) if has_meta else None)
    report["model"] = args.model
    out = Path(args.out)
    write_report(out, "sweep", report, to_markdown(report))
    plot(report, out / "sweep.png")
    print(to_markdown(report))
    print(f"wrote {out / 'sweep.json'}, {out / 'sweep.md'} and {out / 'sweep.png'}")
    if args.write_back:
        write_back(args.model, report, out / "sweep.json")
    return report


def write_back(model_dir: str, report: dict, report_path: Path) -> bool:
    """Record the sweep's fastest setting in the checkpoint's selfspec.json, only when it is lossless
    and beats plain decoding (else the checkpoint keeps its own). Returns whether it wrote."""
    best = report["best"]
    if best is None or best["speedup"] <= 1.0:
        print(f"{model_dir}/{META_FILE} left as it is: no lossless setting beat plain decoding")
        return False
    drafter = best.get("drafter", "early_exit")
    fields = {"drafter": drafter, "sweep": {"speedup": best["speedup"], "report": str(report_path)}}
    fastest = {d: row for d, row in report.get("fastest_per_drafter", {}).items() if row["speedup"] > 1.0}
    if fastest:  # each drafter's own best: what the benchmark compares the drafters at
        fields["fastest"] = fastest
    if drafter != "ngram":  # the n-gram drafter has no E, k or V' of its own: keep the checkpoint's
        fields.update(exit_layer=best["exit_layer"], num_speculations=best["num_speculations"],
                      draft_vocab_size=best.get("vocab") or None)
    if drafter != "early_exit":
        old = NGramConfig.from_dict(read_meta(model_dir).get("ngram"))
        fields["ngram"] = NGramConfig(max(old.max_ngram, best["min_ngram"]), best["min_ngram"], old.max_copy).as_dict()
    update_meta(model_dir, **fields)
    print(f"{model_dir}/{META_FILE}: {_describe(best)}")
    return True


def main(argv=None) -> dict:
    """`python eval/sweep.py ...`: the same flags as `selfspec eval sweep`."""
    parser = argparse.ArgumentParser(prog="selfspec eval sweep", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


__all__ = ["PLAIN", "Setting", "add_arguments", "grid_settings", "main", "plot", "run", "run_sweep", "to_markdown",
           "write_back"]
