"""What an `accelerate launch` config asked for, checked before the loop builds its `Accelerator`.

`accelerate launch --config_file X` hands the config to every process through environment variables
(`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_USE_FSDP`, `FSDP_TRANSFORMER_CLS_TO_WRAP`, `LOCAL_WORLD_SIZE`).
Three mistakes would otherwise end in a traceback far from their cause, or worse in a run that is
not what was asked for, so each becomes one line here:

- DeepSpeed or FSDP without a GPU: accelerate 1.15 keeps neither on a CPU (`accelerate/state.py`:
  DeepSpeed only `and not cpu`, FSDP only for GPU-like device types) and silently runs DDP instead;
  docs/scaling.md gives the lines.
- DeepSpeed without the `deepspeed` package (the optional extra `selfspec[deepspeed]`).
- More processes on a machine than it has GPUs (`num_processes` of a config written for 8 GPUs).
- An FSDP layer class (`fsdp_transformer_layer_cls_to_wrap`) that the model does not have.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from torch import nn

from ..errors import UserError


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").lower() == "true"


def check_launch(has_gpu: bool, gpu_count: int, env: Mapping[str, str] | None = None) -> None:
    """Refuse a launch config this machine cannot run as written (see the module docstring)."""
    env = os.environ if env is None else env
    sharding = "DeepSpeed" if _flag(env, "ACCELERATE_USE_DEEPSPEED") else (
        "FSDP" if _flag(env, "ACCELERATE_USE_FSDP") else None)
    if sharding == "DeepSpeed" and importlib.util.find_spec("deepspeed") is None:
        raise UserError("the accelerate config asks for DeepSpeed (distributed_type: DEEPSPEED) but "
                        "deepspeed is not installed; pip install 'selfspec[deepspeed]'")
    if sharding and not has_gpu:
        raise UserError(f"the accelerate config asks for {sharding}, which accelerate runs on GPUs only (on "
                        f"a CPU it would silently run DDP); use accelerate/ddp.yaml here (docs/scaling.md)")
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    if has_gpu and gpu_count and local > gpu_count:
        raise UserError(f"the accelerate config starts {local} processes on this machine, which has "
                        f"{gpu_count} GPUs; set num_processes to the GPU count (times num_machines)")


def check_wrap_classes(model: nn.Module, env: Mapping[str, str] | None = None) -> None:
    """Refuse FSDP layer classes the model lacks (accelerate would raise only at `prepare`, after the
    data and the model were loaded, and its error names one class, not the model's own)."""
    env = os.environ if env is None else env
    names = [n.strip() for n in env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if n.strip()]
    if not (_flag(env, "ACCELERATE_USE_FSDP") and names):
        return
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        blocks = sorted(n for n in present if n.endswith(("DecoderLayer", "Block")))
        raise UserError(f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which this model "
                        f"does not have; use {', '.join(blocks) or 'its decoder block class'} or leave the "
                        f"field out (the model's own block class is then used)")
