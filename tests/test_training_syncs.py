"""A training step's syncs on the emulated CUDA device (`virtual_cuda`): the loop's own step
(`training.loop._train_step`: the objective's forward, backward, clipping, AdamW, the logged values)
waits for the device a bounded number of times per micro-batch, whatever the model's depth.

The batches are given on the device, as accelerate's prepared loader hands them over (its copy is
queued from pinned memory: `loop._prepared` asks for `pin_memory` and `non_blocking` on a GPU)."""

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from helpers import tiny_model
from virtual_cuda import VirtualCuda

from selfspec.config import load_config
from selfspec.training import loop


def _step_syncs(overrides: list[str], layers: int, accum: int, monkeypatch) -> tuple[float, float]:
    """(reads, uploads) per micro-batch over 3 optimizer steps of `_train_step` on the emulated device."""
    cfg = load_config("demo_finetune", ["model.name_or_path=unused", "optim.batch_size=2", "exit_layer=2",
                                        f"optim.grad_accum={accum}", *overrides])
    model = tiny_model("llama", num_layers=layers)
    AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.setattr(Accelerator, "device", property(lambda self: torch.device("cuda")))
    try:
        with VirtualCuda() as device:
            device.module(model)
            return _counted_steps(device, cfg, model, layers, accum)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _counted_steps(device, cfg, model, layers: int, accum: int) -> tuple[float, float]:
    objective = loop.build_objective(model, cfg, layers, cfg.exit_layer)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
    run = SimpleNamespace(cfg=cfg, accelerator=accelerator, objective=objective.train(), trainable=params,
                          optimizer=optimizer, scheduler=scheduler, step=0, tokens=0)
    ids = torch.randint(0, 96, (6 * accum, 2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    stream = iter({"input_ids": batch} for batch in ids)
    loop._train_step(run, stream)  # the first step: optimizer state made
    before = (device.host_reads, device.host_uploads)
    for _ in range(3):
        loop._train_step(run, stream)
    micro = 3 * accum
    return (device.host_reads - before[0]) / micro, (device.host_uploads - before[1]) / micro


@pytest.mark.parametrize("dropout", ["per_batch", "per_sample"])
def test_a_training_step_waits_for_the_device_a_bounded_number_of_times(dropout, monkeypatch):
    """Layer dropout (every block may be skipped), exit losses on a random 30 % of the positions at
    three exits, clipping: one host read an optimizer step (the logged values), whatever its
    micro-batches, and no upload that waits, at 4 blocks as at 8. The loop waited 10.7 times a
    micro-batch at 4 blocks and 16.7 at 8 (two `bool`s of the layer dropout's draws a block, moved to
    the device first; the exit loss's weights and its count of targets read back; the draws, the
    weights and the sampled positions sent up from pageable memory: 3 waiting uploads)."""
    overrides = ["layer_dropout.p_max=0.5", f"layer_dropout.per_sample={dropout == 'per_sample'}",
                 "layer_dropout.protect_draft_layers=false", "early_exit.layers=1:4",
                 "early_exit.token_fraction=0.3", "optim.grad_clip=0.5"]
    for layers, accum in ((4, 1), (8, 2)):
        reads, uploads = _step_syncs(overrides, layers, accum, monkeypatch)
        assert reads * accum <= 1 and uploads == 0, (layers, accum, reads, uploads)
