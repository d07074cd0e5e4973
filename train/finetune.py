"""Self-speculative fine-tune: layer dropout + early-exit losses, full or LoRA, on one CPU or many GPUs.

    accelerate launch train/finetune.py --config configs/demo_finetune.yaml
    accelerate launch --config_file configs/accelerate/ddp.yaml train/finetune.py \
        --config configs/qwen2.5-0.5b_lora.yaml
    accelerate launch train/finetune.py --config configs/demo_finetune.yaml --resume   # continue a run

Any field can be overridden as section.field=value (e.g. early_exit.layers=2:8:2 optim.lr=1e-4).
The tuned model lands in <output_dir>/model with selfspec.json (exit layer, k, config, metrics) and
loads with `selfspec.load_tuned(path)` or plain `AutoModelForCausalLM.from_pretrained(path)`.
"""

from __future__ import annotations

import sys

from selfspec.checkpoint import read_meta
from selfspec.cpu import keep_freed_memory
from selfspec.errors import UserError
from selfspec.training.loop import has_accelerator, train
from selfspec.training.recipe import parse_recipe_args


def main() -> None:
    cfg, args = parse_recipe_args("Self-speculative fine-tune.", "configs/demo_finetune.yaml")
    if not has_accelerator():  # CPU steps allocate (tokens, vocabulary) logits blocks: see selfspec.cpu
        keep_freed_memory()
    try:
        result = train(cfg, resume=args.resume, kind="tuned", overwrite=args.force)
    except UserError as exc:
        sys.exit(f"error: {exc}")
    metrics, exit_layer = result.final_metrics, read_meta(result.model_dir)["exit_layer"]
    agreement = metrics.get(f"val/top1_agreement@{exit_layer}")
    tail = f", top-1 agreement at exit layer {exit_layer}: {agreement:.3f}" if agreement is not None else ""
    print(f"saved {result.model_dir}: {result.steps} steps in {result.seconds / 60:.1f} min, "
          f"validation loss {metrics['val/loss']:.4f}{tail}")


if __name__ == "__main__":
    main()
