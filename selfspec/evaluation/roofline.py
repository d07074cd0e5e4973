"""Roofline: how far decoding is from this machine's memory bandwidth.

A decode step of a small model reads every weight once and does little arithmetic per byte, so its
physical limit is bytes ÷ memory bandwidth. This report measures

- the bandwidth: a large read (a sum over a tensor far larger than the caches; timed in the rotation
  of the passes below, so that both see the same machine) and a large copy (read + write), medians
  of repeats;
- the bytes a pass reads: the weights of the blocks it runs, the final norm and LM head, and the KV
  cache of those blocks at the given context (the embedding reads one row: negligible);
- the time of the passes the engine runs, through the engine's own blocks (`DecoderView`, the fast
  path where it applies) on a cache holding `context` positions: a plain step (1 position through
  all N blocks + head), a draft step (1 position through blocks [0, E) + head) and a verification of
  m = 1..8 positions (blocks [E, N) + head on m positions), plus a whole-model pass of m positions.
  Every repeat visits every pass, the order rotating; each time is a median (`timing.measure_passes`,
  which the doctor times too).

Each pass is given as a fraction of its limit (limit ÷ measured time: 1 means at the bandwidth) and
in plain steps. The cost model and the sweep assume a verification of k + 1 positions costs about
one plain step: the `verify` rows say what it costs here.

Then the round profile (`rounds.py`): the engine decodes a few prompts with plain decoding and with
the early exit at E and the checkpoint's k (or `--num-speculations`), and each part of a round (the
passes, and what sits between them) is given in µs and in plain steps.

    selfspec eval roofline --model runs/smollm2/base --exit-layer 10
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..checkpoint import resolve_settings
from ..cpu import sync_device
from ..decoding.cache import KVCache
from ..errors import UserError
from ..model.pages import empty_on_huge_pages
from ..model.view import DecoderView
from .options import RooflineOptions
from .prompts import read_prompts
from .report import publish, pyplot, save_figure
from .results import RooflineReport
from .rounds import round_profile
from .rounds import to_markdown as profile_markdown
from .timing import LoadedCheckpoint, interleaved_rates, load_checkpoint, make_runner, measure_passes


def _median_seconds(fn, repeats: int, device) -> float:
    times = []
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(megabytes: int = 512, repeats: int = 9, device="cpu") -> dict:
    """Bytes/s of a large read (sum of a float32 tensor) and a large copy (read + write), medians
    after one untimed pass each. `megabytes` should dwarf the last-level cache."""
    numel = megabytes * 2**20 // 4
    if torch.device(device).type == "cpu":  # on the pages the weights lie on (`pages.onto_huge_pages`)
        source, target = empty_on_huge_pages(numel).fill_(1.0), empty_on_huge_pages(numel)
    else:
        source = torch.ones(numel, dtype=torch.float32, device=device)
        target = torch.empty_like(source)
    nbytes = source.numel() * source.element_size()
    source.sum(), target.copy_(source)  # touch the pages before timing
    read = _median_seconds(lambda: source.sum(), repeats, device)
    copy = _median_seconds(lambda: target.copy_(source), repeats, device)
    return {"bytes": nbytes, "read_bytes_per_second": nbytes / read,
            "copy_bytes_per_second": 2 * nbytes / copy}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def pass_bytes(view: DecoderView, start: int, end: int, context: int) -> int:
    """Bytes one pass of blocks [start, end) + final norm + LM head reads at `context` cached positions:
    the blocks' and the head's weights (a tied head counts once) and those blocks' keys and values."""
    weights = _nbytes(p for i in range(start, end) for p in view.layers[i].parameters())
    weights += _nbytes([*view.final_norm.parameters(), *view.lm_head.parameters()])
    return weights + (end - start) * kv_bytes_per_layer(view, context)


def kv_bytes_per_layer(view: DecoderView, context: int) -> int:
    """Keys + values one block holds for `context` positions (batch 1), from a one-token probe."""
    cache = KVCache(view.num_layers, 1, 1)
    ids = torch.zeros(1, 1, dtype=torch.long, device=view.device)
    positions = view.default_positions(ids)
    cache.set_positions(positions, [0])
    with torch.inference_mode():
        view.run_layers(view.embed(ids, positions), 0, 1, cache, positions, kv_length=1, aligned=True)
    return context * (_nbytes([cache.keys[0], cache.values[0]]))


def roofline(view: DecoderView, exit_layer: int, context: int = 256, positions=range(1, 9), repeats: int = 15,
             warmup: int = 3, bandwidth_megabytes: int = 512) -> RooflineReport:
    """The report (see the module docstring) as a dict."""
    n = view.num_layers
    if not 1 <= exit_layer < n:
        raise UserError(f"--exit-layer {exit_layer} is not in 1..{n - 1}")
    if context < 1 or repeats < 1 or not positions or min(positions) < 1:
        raise UserError(f"--context ({context}), --repeats ({repeats}) and every position count "
                        f"({list(positions)}) must be >= 1")
    limit = view.max_positions
    if limit is not None and context + max(positions) > limit:
        raise UserError(f"--context {context} + {max(positions)} positions exceed the model's {limit}")
    bandwidth = measure_bandwidth(bandwidth_megabytes, device=view.device)
    # The read that sets the limit runs in the passes' rotation: a shared machine's bandwidth drifts
    # by a third within minutes, and a limit measured apart from the passes would mis-state them.
    source = torch.ones(bandwidth["bytes"] // 4, device=view.device)
    passes = measure_passes(view, exit_layer, context, positions, repeats, warmup,
                            probes={"read": lambda: source.sum()})
    bandwidth["read_bytes_per_second"] = bandwidth["bytes"] / passes.pop("read")["seconds"]
    rate = bandwidth["read_bytes_per_second"]
    plain = passes["plain"]["seconds"]
    for row in passes.values():
        start, end = row["blocks"]
        row["bytes"] = pass_bytes(view, start, end, context)
        row["limit_seconds"] = row["bytes"] / rate
        row["fraction_of_bandwidth"] = row["limit_seconds"] / row["seconds"]
        row["plain_steps"] = row["seconds"] / plain
    return {"num_layers": n, "exit_layer": exit_layer, "context": context, "repeats": repeats,
            "device": str(view.device), "dtype": str(view.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "bandwidth": bandwidth, "passes": passes}


def to_markdown(report: dict) -> str:
    bw = report["bandwidth"]
    lines = [f"# Roofline ({report['num_layers']} layers, E = {report['exit_layer']}, context "
             f"{report['context']})", "",
             f"{report['device']} {report['dtype']}, {report['threads']} threads; memory bandwidth: read "
             f"{bw['read_bytes_per_second'] / 1e9:.1f} GB/s, "
             f"copy {bw['copy_bytes_per_second'] / 1e9:.1f} GB/s "
             f"(median of repeats over {bw['bytes'] / 2**20:.0f} MiB, the read interleaved with the passes); "
             f"passes: median of {report['repeats']} interleaved repeats.", "",
             "| pass | blocks | positions | MB read | limit ms | measured ms | of the limit | plain steps |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in report["passes"].items():
        start, end = row["blocks"]
        lines.append(f"| {name} | [{start}, {end}) | {row['positions']} | {row['bytes'] / 1e6:.1f} | "
                     f"{row['limit_seconds'] * 1e3:.2f} | {row['seconds'] * 1e3:.2f} | "
                     f"{row['fraction_of_bandwidth']:.0%} | {row['plain_steps']:.2f} |")
    if report.get("round_profile"):
        lines += ["", profile_markdown(report["round_profile"]).rstrip()]
    return "\n".join(lines) + "\n"


def measure_round_profile(checkpoint: LoadedCheckpoint, prompts: list, *, max_new_tokens: int = 64,
                          repeats: int = 3, warmup: int = 1) -> dict:
    """The round profile (`rounds.round_profile`) of plain decoding and of the early exit at the
    checkpoint's settings, decoding `prompts` greedily at batch 1, interleaved over `repeats` after
    `warmup`."""
    run = make_runner(checkpoint, max_new_tokens=max_new_tokens, profile=True)
    methods = ("plain", "early_exit")
    timings = interleaved_rates(methods, run, [[p] for p in prompts], repeats, warmup, run.device)
    return round_profile({m: timings.run_stats(m) for m in methods})


def plot(report: dict, path: str | Path) -> Path:
    """Cost of a pass (in plain steps) against the positions it carries: the verification and a
    whole-model pass, measured, with the bandwidth limit of each."""
    plt = pyplot()

    passes = report["passes"]
    plain = passes["plain"]["seconds"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for prefix, label in (("verify", f"verification, blocks [{report['exit_layer']}, N)"),
                          ("full", "whole model")):
        rows = [passes["plain"]] if prefix == "full" else []
        rows += [row for name, row in passes.items() if name.startswith(prefix + "_")]
        xs = [row["positions"] for row in rows]
        line, = ax.plot(xs, [row["seconds"] / plain for row in rows], marker="o", label=f"{label}, measured")
        ax.plot(xs, [row["limit_seconds"] / plain for row in rows], linestyle="--", color=line.get_color(),
                label=f"{label}, bandwidth limit")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("positions in the pass")
    ax.set_ylabel("cost (measured plain steps)")
    ax.set_title(f"{report['num_layers']} layers, {report['dtype']}, context {report['context']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def run(options: RooflineOptions) -> RooflineReport:
    """`selfspec eval roofline`: measure the model `options.model`; print the table, write roofline.json,
    roofline.md and roofline.png into `options.out`. E and k default to the checkpoint's. The round
    profile decodes `num_prompts` prompts (`prompts.read_prompts`: `prompts` or `corpus`)
    `profile_repeats` times (0: no profile)."""
    model = options.model
    settings, _, counts = resolve_settings(model, exit_layer=options.exit_layer,
                                           num_speculations=options.num_speculations)
    if settings.exit_layer is None:
        raise UserError(f"--exit-layer is required: {model} has no selfspec.json")
    early_exit = settings.override(drafter="early_exit")
    checkpoint = load_checkpoint(model, early_exit, None, counts, device=options.device, dtype=options.dtype)
    report = roofline(DecoderView(checkpoint.model), settings.exit_layer, options.context,
                      range(1, options.max_positions + 1), options.repeats, options.warmup)
    if options.profile_repeats:
        prompts = read_prompts(checkpoint.tokenizer, options.prompts, options.corpus, options.num_prompts)
        report["round_profile"] = measure_round_profile(checkpoint, prompts,
                                                        max_new_tokens=options.max_new_tokens,
                                                        repeats=options.profile_repeats)
        report["round_profile"]["settings"] = early_exit.to_json()
    report["model"] = model
    publish(options.out, "roofline", report, to_markdown(report), plot)
    return report


__all__ = ["kv_bytes_per_layer", "measure_bandwidth", "pass_bytes", "plot", "roofline",
           "run", "to_markdown"]
