"""Sweep of (E, k): which exit layer and draft length decode fastest, measured side by side.

For every exit layer E and draft length k in the grid, the engine decodes the same prompts greedily
at batch 1; plain decoding (k = 0) runs in the same rounds. Every round visits all configurations,
the order rotating from round to round (interleaved, so drift hits all alike); each configuration's
tokens/s is the median over rounds. Per E it reports α and the draft cost c (draft step ÷ plain
step), per (E, k) the measured speedup over plain and the cost model's E(k, α)/(1 + k·c), so the
gap between them is visible. Every output must equal plain decoding's (checked, reported).

    selfspec eval sweep --model runs/demo/model --exit-layers 2:10:2 --ks 1,2,4,6,8 --write-back

writes sweep.json, sweep.md and sweep.png into --out; --write-back records the fastest (E, k) in
the checkpoint's selfspec.json (what `load_tuned` then uses).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from ..checkpoint import META_FILE, update_meta
from ..config import parse_layers
from ..decoding import SelfSpecGenerator
from ..metrics import speedup_simple
from ..model import num_layers as count_layers
from .benchmark import interleaved_rates, load_model, pooled_costs, read_prompts
from .report import save_figure, write_report

PLAIN = (0, 0)  # (E, k) key of plain decoding


def run_sweep(model, prompts: list[list[int]], exit_layers: list[int], ks: list[int], max_new_tokens: int = 64,
              repeats: int = 3, warmup: int = 1, progress: bool = True) -> dict:
    """Measure every (E, k) of the grid against plain decoding; returns the report as a dict."""
    generators = {e: SelfSpecGenerator(model, exit_layer=e, check_cache=False) for e in exit_layers}
    num_layers = next(iter(generators.values())).view.num_layers if generators else 0
    bad = [e for e in exit_layers if not 1 <= e < num_layers]
    if bad or not exit_layers:
        raise ValueError(f"exit layers {bad or exit_layers} are not in 1..{num_layers - 1}: E = N would "
                         f"draft with the whole model")
    if not ks or min(ks) < 1:
        raise ValueError(f"draft lengths {ks} must be >= 1 (plain decoding, k = 0, is always measured)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")

    def run(config, batch):
        exit_layer, k = config
        out = generators[exit_layer or exit_layers[0]].generate(
            batch, max_new_tokens=max_new_tokens, num_speculations=k, eos_token_id=[])
        return out.sequences, out.stats

    configs = [PLAIN] + [(e, k) for e in exit_layers for k in ks]
    device = generators[exit_layers[0]].view.device
    rates, outputs, stats = interleaved_rates(configs, run, [[p] for p in prompts], repeats, warmup, device,
                                              "sweep" if progress else None)  # batch 1

    plain_rate = statistics.median(rates[PLAIN])
    grid, per_exit = [], {}
    for exit_layer in exit_layers:
        runs = [s for k in ks for s in stats[(exit_layer, k)]]
        costs = pooled_costs(stats[PLAIN], runs)
        per_exit[str(exit_layer)] = {"acceptance_rate": costs["stats"].acceptance_rate,
                                     "draft_cost": costs["draft_cost"]}
        for k in ks:
            run_costs = pooled_costs(stats[PLAIN], stats[(exit_layer, k)])
            alpha = run_costs["stats"].acceptance_rate
            rate = statistics.median(rates[(exit_layer, k)])
            grid.append({"exit_layer": exit_layer, "num_speculations": k, "tokens_per_second": rate,
                         "speedup": rate / plain_rate, "acceptance_rate": alpha,
                         "mean_accepted_length": run_costs["stats"].mean_accepted_length,
                         "predicted_speedup": speedup_simple(k, alpha, costs["draft_cost"]),
                         "identical_to_plain": outputs[(exit_layer, k)] == outputs[PLAIN]})
    lossless = [row for row in grid if row["identical_to_plain"]]
    best = max(lossless, key=lambda row: row["speedup"]) if lossless else None
    return {"num_layers": num_layers, "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
            "repeats": repeats, "warmup": warmup, "device": str(device),
            "plain_tokens_per_second": plain_rate,
            "plain_step_seconds": pooled_costs(stats[PLAIN], [])["plain_step"],
            "per_exit_layer": per_exit, "grid": grid,
            "best": None if best is None else {"exit_layer": best["exit_layer"],
                                               "num_speculations": best["num_speculations"],
                                               "speedup": best["speedup"]},
            "all_identical_to_plain": len(lossless) == len(grid)}


def to_markdown(report: dict) -> str:
    ks = sorted({row["num_speculations"] for row in report["grid"]})
    lines = [f"# (E, k) sweep: measured speedup over plain decoding ({report['num_layers']} layers)", "",
             f"{report['num_prompts']} prompts, batch 1, {report['max_new_tokens']} new tokens, greedy, "
             f"{report['device']}; plain {report['plain_tokens_per_second']:.1f} tokens/s; median of "
             f"{report['repeats']} interleaved repeats after {report['warmup']} warm-up. "
             "Cells: measured × (cost model E(k,α)/(1+k·c)).", "",
             "| E | α | c | " + " | ".join(f"k={k}" for k in ks) + " |",
             "|---|---:|---:|" + "---:|" * len(ks)]
    for exit_layer, summary in report["per_exit_layer"].items():
        cells = {row["num_speculations"]: row for row in report["grid"] if str(row["exit_layer"]) == exit_layer}
        lines.append(f"| {exit_layer} | {summary['acceptance_rate']:.3f} | {summary['draft_cost']:.3f} | "
                     + " | ".join(f"{cells[k]['speedup']:.2f} ({cells[k]['predicted_speedup']:.2f})" for k in ks)
                     + " |")
    best = report["best"]
    fastest = "none (no output matched plain decoding)" if best is None else (
        f"E = {best['exit_layer']}, k = {best['num_speculations']}: **{best['speedup']:.2f}×** plain decoding")
    lines += ["", f"Fastest: {fastest}. Outputs identical to plain decoding: **{report['all_identical_to_plain']}**"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str | Path) -> Path:
    """Measured (solid) and predicted (dashed) speedup against k, one colour per exit layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, exit_layer in enumerate(report["per_exit_layer"]):
        rows = sorted((r for r in report["grid"] if str(r["exit_layer"]) == exit_layer),
                      key=lambda r: r["num_speculations"])
        ks = [r["num_speculations"] for r in rows]
        colour = f"C{index % 10}"
        ax.plot(ks, [r["speedup"] for r in rows], "o-", color=colour, label=f"E = {exit_layer}")
        ax.plot(ks, [r["predicted_speedup"] for r in rows], "--", color=colour, alpha=0.6)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(sorted({r["num_speculations"] for r in report["grid"]}))
    ax.set_xlabel("k (draft length)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("measured (solid) vs cost model (dashed)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's flags (`selfspec eval sweep`, `eval/sweep.py`)."""
    parser.add_argument("--model", required=True, help="directory loadable with AutoModelForCausalLM")
    parser.add_argument("--exit-layers", default=None,
                        help="E values: a list '2,4,6', a slice '2:10:2' or 'all' (default: all, 1..N-1)")
    parser.add_argument("--ks", default="1,2,3,4,6,8", help="draft lengths k, e.g. '1,2,4,8'")
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
                        help=f"record the fastest (E, k) in the checkpoint's {META_FILE}")


def run(args: argparse.Namespace) -> dict:
    """Run the sweep that `args` (from `add_arguments`) describes; prints and writes the report."""
    if args.repeats < 1 or args.max_new_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--repeats, --max-new-tokens and --num-prompts must be >= 1")
    try:
        ks = sorted({int(k) for k in args.ks.split(",")})
    except ValueError:
        raise ValueError(f"--ks must be a comma list of ints such as '1,2,4,8', got {args.ks!r}") from None
    if args.write_back and not (Path(args.model) / META_FILE).is_file():
        raise ValueError(f"--write-back needs a tuned checkpoint: {args.model} has no {META_FILE}")

    model, tokenizer = load_model(args.model, args.device, args.dtype)
    num_layers = count_layers(model)
    exit_layers = parse_layers(args.exit_layers or "all", num_layers)
    prompts = read_prompts(args, tokenizer)
    report = run_sweep(model, prompts, exit_layers, ks, args.max_new_tokens, args.repeats, args.warmup)
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
    """Record the sweep's fastest (E, k) in the checkpoint's selfspec.json, only when it is lossless and
    beats plain decoding (else the checkpoint keeps its own). Returns whether it wrote."""
    best = report["best"]
    if best is None or best["speedup"] <= 1.0:
        print(f"{model_dir}/{META_FILE} left as it is: no lossless (E, k) beat plain decoding")
        return False
    update_meta(model_dir, exit_layer=best["exit_layer"], num_speculations=best["num_speculations"],
                sweep={"speedup": best["speedup"], "report": str(report_path)})
    print(f"{model_dir}/{META_FILE}: exit_layer = {best['exit_layer']}, num_speculations = {best['num_speculations']}")
    return True


def main(argv=None) -> dict:
    """`python eval/sweep.py ...`: the same flags as `selfspec eval sweep`."""
    parser = argparse.ArgumentParser(prog="selfspec eval sweep", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


__all__ = ["add_arguments", "main", "plot", "run", "run_sweep", "to_markdown", "write_back"]
