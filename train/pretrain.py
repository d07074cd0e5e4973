"""Pretrain the embedded default base model from scratch on the Python standard library corpus.

    accelerate launch train/pretrain.py --config configs/embedded_base.yaml
    python train/pretrain.py                      # same, single process
    accelerate launch train/pretrain.py optim.max_steps=50 output_dir=runs/base-smoke   # a quick try

Builds (and reuses) the corpus and the byte-level BPE tokenizer under data/generated/, trains a
Llama-architecture model with the shared loop, and saves it to <output_dir>/model with its size,
steps, tokens seen and validation loss in selfspec.json. A second run with the same config reuses
the saved model instead of training again (--force retrains).
"""

from __future__ import annotations

import sys

from selfspec.checkpoint import read_meta
from selfspec.cpu import keep_freed_memory
from selfspec.errors import UserError
from selfspec.training.loop import has_accelerator, train_or_reuse
from selfspec.training.recipe import parse_recipe_args


def main() -> None:
    cfg, args = parse_recipe_args("Pretrain the embedded base model.", "configs/embedded_base.yaml")
    if not has_accelerator():  # CPU steps allocate (tokens, vocabulary) logits blocks: see selfspec.cpu
        keep_freed_memory()
    try:
        model_dir, reused = train_or_reuse(cfg, kind="base", force=args.force, resume=args.resume)
    except UserError as exc:
        sys.exit(f"error: {exc}")
    m = read_meta(model_dir)["metrics"]
    print(f"{'reused' if reused else 'saved'} {model_dir}: {m['parameters']:,} parameters, "
          f"{m['steps']} steps, {m['tokens_seen']:,} tokens, {m['train_seconds'] / 60:.1f} min, "
          f"validation loss {m['val/loss']:.4f}")


if __name__ == "__main__":
    main()
