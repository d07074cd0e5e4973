"""Training curves: acceptance at the exit layers and the final layer's perplexity against tokens seen.

    selfspec eval curve runs/smollm2/tuned          # reads metrics.jsonl, writes curve.png + curve.json
    selfspec eval curve runs/a runs/b --exit-layer 10 --out recipes.png   # recipes side by side

The curve is what tells a user what more training would buy: greedy acceptance (top-1 agreement)
and expected acceptance at each candidate exit, and validation perplexity, at every evaluation of the
run (`eval_every` steps), read from the run's `metrics.jsonl`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import UserError
from .report import pyplot, save_figure, write_report

_EXIT_KEY = re.compile(r"^val/(top1_agreement|expected_acceptance)@(\d+)$")


def read_curve(run_dir: str | Path) -> dict:
    """{"tokens": [...], "perplexity": [...], "exits": {E: {"top1_agreement": [...], ...}}} from a run."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist; pass the output_dir of a training run")
    curve = {"steps": [], "tokens": [], "minutes": [], "perplexity": [], "exits": {}}
    minutes = 0.0  # a step row's wall clock carries over to the evaluation row logged after it
    prepared = 0.0  # minutes spent before the first step (an exit adapter's cached features)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a running job's last line, half written
            raise UserError(f"{path}:{number} is not a JSON row; wait for the run to write it, or remove "
                            f"that line") from None
        prepared = row.get("feature_minutes", prepared)
        minutes = row["minutes"] + prepared if "minutes" in row else minutes
        if "val/perplexity" not in row:
            continue
        curve["steps"].append(row["step"])
        curve["tokens"].append(row["tokens"])
        curve["minutes"].append(minutes if row["step"] else 0.0)
        curve["perplexity"].append(row["val/perplexity"])
        for key, value in row.items():
            match = _EXIT_KEY.match(key)
            if match:
                metric, layer = match.group(1), int(match.group(2))
                curve["exits"].setdefault(layer, {}).setdefault(metric, []).append(value)
    if not curve["steps"]:
        raise UserError(f"{path} holds no evaluation; set eval_every > 0 or let the run finish")
    return curve


def plot_curve(curve: dict, out_png: str | Path, title: str = "") -> Path:
    """Acceptance at each exit (left axis) and validation perplexity (right axis) against tokens seen;
    the training loop's evaluation before the first step is the point at 0 tokens."""
    plt = pyplot()

    fig, left = plt.subplots(figsize=(7, 4.2))
    right = left.twinx()
    tokens = curve["tokens"]
    for layer, metrics in sorted(curve["exits"].items()):
        for metric, style in (("top1_agreement", "-o"), ("expected_acceptance", ":")):
            values = metrics.get(metric, [])
            if not values:
                continue
            label = (f"exit {layer}: "
                     f"{'greedy α (top-1)' if metric == 'top1_agreement' else 'expected acceptance'}")
            left.plot([t / 1e3 for t in tokens], values, style, label=label, markersize=3)
    right.plot([t / 1e3 for t in tokens], curve["perplexity"], "--", color="gray",
               label="final-layer perplexity")
    left.set_xlabel("training tokens (thousands)")
    left.set_ylabel("acceptance")
    right.set_ylabel("validation perplexity")
    left.set_ylim(0, 1)
    left.grid(alpha=0.3)
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = left.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    # Below the axes: inside, it sat on the acceptance curves.
    left.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8)
    left.set_title(title or "acceptance at the exit vs training tokens")
    fig.tight_layout()
    return save_figure(fig, out_png)


def plot_runs(curves: dict[str, dict], exit_layer: int, out_png: str | Path) -> Path:
    """Greedy acceptance at `exit_layer` for several runs (label -> `read_curve`), against training
    tokens (left) and wall-clock minutes (right), on one PNG: what each recipe and more time buy."""
    plt = pyplot()

    fig, (by_tokens, by_minutes) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for index, (label, curve) in enumerate(curves.items()):
        values = curve["exits"].get(exit_layer, {}).get("top1_agreement")
        if not values:
            raise UserError(f"run {label!r} has no evaluation at exit {exit_layer}; "
                             f"pick one of {sorted(curve['exits'])}")
        style = {"marker": "o", "markersize": 3, "color": f"C{index}", "label": label}  # one colour a run
        by_tokens.plot([t / 1e3 for t in curve["tokens"]], values, **style)
        if any(curve["minutes"]):  # runs logged before the loop recorded minutes have none
            by_minutes.plot(curve["minutes"], values, **style)
    by_tokens.set_xlabel("training tokens (thousands)")
    by_minutes.set_xlabel("training minutes (wall clock)")
    by_tokens.set_ylabel(f"greedy α at exit {exit_layer} (validation top-1)")
    for axis in (by_tokens, by_minutes):
        axis.grid(alpha=0.3)
        axis.set_ylim(0, 1)
    by_tokens.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"held-out acceptance at exit {exit_layer} per recipe")
    fig.tight_layout()
    return save_figure(fig, out_png)


def write_curve(run_dir: str | Path) -> Path:
    """`curve.json` and `curve.png` beside the run's metrics.jsonl; returns the PNG's path."""
    curve = read_curve(run_dir)
    write_report(run_dir, "curve", curve)
    return plot_curve(curve, Path(run_dir) / "curve.png", title=f"{Path(run_dir)}: acceptance vs tokens")
