"""`python -m selfspec` as `accelerate launch` starts it, with accelerate's FSDP plugin kept on CPUs: the
test harness's way to run `accelerate launch --config_file fsdp.yaml -m selfspec train` on gloo.

    accelerate launch --config_file fsdp.yaml tests/accelerate_cpu.py train --config ... [overrides]

accelerate 1.16 keeps an FSDP plugin only for GPU-like device types (`AcceleratorState.__init__`: CPU
processes are MULTI_CPU, which it runs as DDP) and selfspec refuses that launch on a CPU in one line
(`training.launch.check_launch`) rather than let it train unsharded. Here, and only here, both are
lifted: the state becomes FSDP with the plugin accelerate built from the launch config, so `prepare`
shards the objective with `fully_shard` on the gloo process group, as it would on GPUs with NCCL.
Nothing else changes: the rest is the loop users run.
"""

from __future__ import annotations

import os
import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from selfspec.training import loop

_init = AcceleratorState.__init__


def _sharded_on_cpu(self, *args, fsdp_plugin=None, deepspeed_plugin=None, **kwargs):
    """accelerate's own initialisation, then its FSDP or DeepSpeed branch where it declined it for CPUs."""
    _init(self, *args, fsdp_plugin=fsdp_plugin, deepspeed_plugin=deepspeed_plugin, **kwargs)
    if self.distributed_type != DistributedType.MULTI_CPU:
        return
    if fsdp_plugin is not None:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
    elif deepspeed_plugin is not None:
        self.distributed_type = DistributedType.DEEPSPEED
        deepspeed_plugin.set_mixed_precision(self._mixed_precision)
        deepspeed_plugin.select(_from_accelerator_state=True)
        self.deepspeed_plugins = deepspeed_plugin
        self._mixed_precision = "no"  # DeepSpeed's config says the precision
    PartialState._shared_state["distributed_type"] = self.distributed_type


def _check_launch(has_gpu, gpu_count, env=None):
    """selfspec's launch check, told that FSDP runs here."""
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")}
    _check(has_gpu, gpu_count, env)


_check = loop.check_launch

if __name__ == "__main__":
    AcceleratorState.__init__ = _sharded_on_cpu
    loop.check_launch = _check_launch
    sys.argv[0] = "selfspec"
    runpy.run_module("selfspec", run_name="__main__", alter_sys=True)
