"""`selfspec train` and `selfspec pretrain`: a recipe (shipped name or YAML path) plus `a.b=value`
overrides, run by the shared loop; one process, or many under `accelerate launch -m selfspec train`.

    selfspec pretrain --config embedded_base
    selfspec train --config demo_finetune optim.max_steps=100 --output-dir runs/try
    accelerate launch --config_file "$(selfspec recipes --path accelerate/ddp)" -m selfspec train \\
        --config qwen2.5-0.5b_lora
"""

from __future__ import annotations

import logging
import os
import sys

from ..checkpoint import read_meta
from ..config import load_config
from .loop import train, train_or_reuse


def _config(config: str, overrides: list[str], output_dir: str | None):
    """The run config: the recipe, its overrides, then --output-dir (which wins over both)."""
    return load_config(config, [*overrides, *([f"output_dir={output_dir}"] if output_dir else [])])


def _main_process() -> bool:
    """Whether this is the run's main process: the one that reports. Only it reads the saved model back:
    on several machines the others may not hold it (each has its own disk)."""
    from accelerate import PartialState

    return PartialState().is_main_process


def _leave_if_distributed() -> None:
    """The processes of a multi-process run (`WORLD_SIZE` > 1, as `accelerate launch` sets it) leave at once
    once every output is written, without the interpreter's finalization: in it, a gloo worker thread
    that still releases the last collective's tensors must take the GIL to drop their Python objects,
    which a finalizing interpreter refuses by ending the thread, and the C++ unwind through the work's
    destructor aborts the process ("terminate called without an active exception", pytorch#179291): a
    run whose model was saved exited non-zero (1 of 6 two-process FSDP runs in a CI, 2026-12-07;
    `tests/fsdp_train.py` leaves the same way). Every rank is past its last write already (`train`
    waits for all before it ends the process group). A single process returns as usual."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def finetune(config: str, overrides: list[str], resume: bool, force: bool, output_dir: str | None) -> None:
    """Self-speculative fine-tune: layer dropout and early-exit losses, all weights, LoRA or the exit
    block; the tuned model lands in `<output_dir>/model` with its selfspec.json. A recipe with
    `data.distill` generates its data first (`distill_first`)."""
    cfg = _config(config, overrides, output_dir)
    distill_first(cfg)
    result = train(cfg, resume=resume, kind="tuned", overwrite=force)
    if _main_process():
        metrics, exit_layer = result.final_metrics, read_meta(result.model_dir)["exit_layer"]
        agreement = metrics.get(f"val/top1_agreement@{exit_layer}")
        tail = "" if agreement is None else f", top-1 agreement at exit layer {exit_layer}: {agreement:.3f}"
        print(f"saved {result.model_dir}: {result.steps} steps in {result.seconds / 60:.1f} min, "
              f"validation loss {metrics['val/loss']:.4f}{tail}")
    _leave_if_distributed()


def distill_first(cfg) -> None:
    """The recipe's `data.distill`: the model's own replies into `data.source` (in this process or through
    the endpoint it names, resumed where a previous run stopped), on the main process while the others
    wait; nothing without it."""
    if cfg.data.distill is None:
        return
    from accelerate import PartialState

    from ..data.distill_job import distill_data, recipe_options

    options = recipe_options(cfg.data, cfg.model.name_or_path)  # a bad key fails on every process
    state = PartialState()
    if state.is_main_process:
        distill_data(options)
    state.wait_for_everyone()


def pretrain(config: str, overrides: list[str], resume: bool, force: bool, output_dir: str | None) -> None:
    """Pretrain a base model from scratch (the embedded default); a second run with the same config
    reuses the saved model unless `force`."""
    cfg = _config(config, overrides, output_dir)
    model_dir, reused = train_or_reuse(cfg, kind="base", force=force, resume=resume)
    if _main_process():
        m = read_meta(model_dir)["metrics"]
        print(f"{'reused' if reused else 'saved'} {model_dir}: {m['parameters']:,} parameters, "
              f"{m['steps']} steps, {m['tokens_seen']:,} tokens, {m['train_seconds'] / 60:.1f} min, "
              f"validation loss {m['val/loss']:.4f}")
    _leave_if_distributed()
