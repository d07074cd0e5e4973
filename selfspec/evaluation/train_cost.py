"""What layer dropout + early-exit losses cost per training step, against a plain fine-tune step.

Both variants run the same model, batch and AdamW update. Time: warm-up, then interleaved repeats
(plain, selfspec, plain, ...) so that machine noise hits both alike, then medians. Memory: each
variant runs in its own fresh process; the figure is the peak resident memory during the steps
above the resident memory just before them (on CUDA, peak allocated bytes instead).
"""

from __future__ import annotations

import copy
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from ..config import RunConfig, default_exit_layer
from ..cpu import sync_device
from ..model import DecoderView
from ..model import num_layers as count_layers
from ..training.loop import build_objective
from ..training.objective import SelfSpecObjective


def make_objective(model, cfg: RunConfig, variant: str,
                   batch: torch.Tensor | None = None) -> SelfSpecObjective:
    """`plain`: final-layer CE only. `selfspec`: layer dropout + early-exit losses as in `cfg`.

    batch: (B, T) ids whose counts rank the ids of a trimmed exit loss (`draft_vocab_size`); which
    ids they are does not change the cost of a step."""
    if variant == "plain":
        return SelfSpecObjective(model)
    num_layers = count_layers(model)
    counts = None
    if batch is not None:
        vocab_size = DecoderView(model).lm_head.weight.shape[0]
        counts = torch.bincount(batch.flatten().cpu(), minlength=vocab_size).numpy()  # (V,)
    return build_objective(model, cfg, num_layers, cfg.exit_layer or default_exit_layer(num_layers), counts)


def _step(objective, optimizer, batch, step: int) -> None:
    out = objective(batch, step=step)
    out["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_variants(model, cfg: RunConfig, batch: torch.Tensor, repeats: int = 20, warmup: int = 3) -> dict:
    """Median seconds per training step of `plain` and `selfspec`, measured interleaved in this process."""
    runs = {}
    for variant in ("plain", "selfspec"):
        objective = make_objective(copy.deepcopy(model), cfg, variant, batch).train()
        optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-5)
        runs[variant] = (objective, optimizer, [])
    for i in range(warmup + repeats):
        for objective, optimizer, times in runs.values():
            sync_device(batch.device)
            start = time.perf_counter()
            # The step index advances, so per-batch layer dropout draws a different set of skipped
            # blocks each repeat and the median reflects its expected saving.
            _step(objective, optimizer, batch, step=i)
            sync_device(batch.device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    medians = {v: statistics.median(times) for v, (_, _, times) in runs.items()}
    return {"plain_s": medians["plain"], "selfspec_s": medians["selfspec"],
            "time_ratio": medians["selfspec"] / medians["plain"], "repeats": repeats}


def peak_memory_in_this_process(model, cfg: RunConfig, batch: torch.Tensor, variant: str,
                                steps: int = 4) -> int:
    """Peak bytes used by `steps` training steps of `variant` above what was in use before them."""
    objective = make_objective(model, cfg, variant, batch).train()
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-5)
    if batch.device.type == "cuda":
        sync_device(batch.device)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for step in range(steps):
            _step(objective, optimizer, batch, step)
        return torch.cuda.max_memory_allocated() - before
    # CPU: ru_maxrss (KiB on Linux) is a high-water mark for the whole process, so each variant
    # must run in a fresh process that has done nothing big before (see `peak_memory_subprocess`).
    # The figure includes what the first step allocates for good (AdamW state), alike for both.
    before = _current_rss()
    for step in range(steps):
        _step(objective, optimizer, batch, step)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def _current_rss() -> int:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * resource.getpagesize()


def peak_memory_subprocess(script: str, args: list[str], variant: str) -> int:
    """Run `script --measure-memory VARIANT args...` in a fresh interpreter; it prints the bytes as JSON."""
    proc = subprocess.run([sys.executable, script, *args, "--measure-memory", variant], capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
