"""Training cost of selfspec: a layer-dropout + early-exit step vs a plain fine-tune step, same batch.

    python tools/benchmark_training_step.py --config demo_finetune
    python tools/benchmark_training_step.py --config demo_finetune early_exit.curriculum=none

Prints the median step times (interleaved repeats after warm-up) and the peak-memory ratio (each
variant in its own process), and writes them to <output_dir>/train_cost.json. Targets: time ratio
<= 1.05, memory ratio <= 1.15. With `lora.enabled` both variants train the same LoRA adapters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from selfspec.config import ConfigError, RunConfig, default_exit_layer, load_config
from selfspec.evaluation.train_cost import peak_memory_in_this_process, peak_memory_subprocess, time_variants
from selfspec.files import write_json_atomic
from selfspec.model import num_layers
from selfspec.model.loading import load_causal_lm


def load_model(cfg: RunConfig, device: str):
    """The model as the fine-tune trains it: with LoRA adapters (at cfg's exit layer) when `lora.enabled`."""
    model = load_causal_lm(cfg.model.name_or_path, cfg.model.dtype, device=device)
    if cfg.lora.enabled:
        from selfspec.training.loop import apply_lora

        model = apply_lora(model, cfg, cfg.exit_layer or default_exit_layer(num_layers(model)))
    return model


def random_batch(model, cfg: RunConfig, device: str) -> torch.Tensor:
    """(batch_size, block_size) random token ids: the cost of a step does not depend on which tokens
    they are, and the memory probe must not load a corpus before measuring."""
    return torch.randint(0, model.config.vocab_size, (cfg.optim.batch_size, cfg.data.block_size),
                         generator=torch.Generator().manual_seed(0)).to(device)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="demo_finetune")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant first")
    parser.add_argument("--measure-memory", choices=["plain", "selfspec"], help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(cfg, device)
    batch = random_batch(model, cfg, device)
    if args.measure_memory:
        print(json.dumps({"peak_bytes": peak_memory_in_this_process(model, cfg, batch, args.measure_memory)}))
        return None

    timing = time_variants(model, cfg, batch, repeats=args.repeats, warmup=args.warmup)
    cli = [__file__, "--config", args.config, *args.overrides]
    memory = {v: peak_memory_subprocess(cli[0], cli[1:], v) for v in ("plain", "selfspec")}
    result = {**timing, "plain_peak_bytes": memory["plain"], "selfspec_peak_bytes": memory["selfspec"],
              "memory_ratio": memory["selfspec"] / memory["plain"], "device": device,
              "batch": list(batch.shape), "layer_dropout": vars(cfg.layer_dropout),
              "early_exit": vars(cfg.early_exit), "lora": vars(cfg.lora) if cfg.lora.enabled else None}
    print(f"step time  plain {timing['plain_s'] * 1e3:.0f} ms   selfspec {timing['selfspec_s'] * 1e3:.0f} ms"
          f"   ratio {timing['time_ratio']:.3f} (target <= 1.05)")
    mib = {v: memory[v] / 2**20 for v in memory}
    print(f"peak mem   plain {mib['plain']:.0f} MiB   selfspec {mib['selfspec']:.0f} MiB"
          f"   ratio {result['memory_ratio']:.3f} (target <= 1.15)")
    write_json_atomic(Path(cfg.output_dir) / "train_cost.json", result)
    return result


if __name__ == "__main__":
    main()
