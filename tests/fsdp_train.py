"""A few training steps of selfspec's objective under torch's FSDP2 (`fully_shard`), for the slow FSDP test.

accelerate 1.15 cannot shard on CPU (docs/scaling.md, "What runs on a CPU"), so this script does what
`accelerate launch --config_file fsdp.yaml` would do, with torch directly: the same objective
(`training.loop.build_objective` from a shipped recipe), every decoder block its own FSDP unit and the
objective the root, gloo collectives.

    torchrun --nproc_per_node 2 tests/fsdp_train.py MODEL_DIR OUT [--steps 4] [--resume-at 2] [overrides...]
    python tests/fsdp_train.py MODEL_DIR OUT --plain     # the reference: one process, no FSDP

Every process takes its share of the same global batch (rows rank::world of GLOBAL_BATCH rows). The plain
reference sums the gradient as 2 FSDP processes do (`_plain_step`), so that rounding cannot tell them
apart: AdamW's first step moves a weight by lr * g / (|g| + eps), so a gradient near eps (1e-8) turns a
rounding difference of 1e-10 into 1e-5 in the weight, and how the rounding falls depends on the CPU's
kernels (AVX2 or AVX-512). OUT gets
`losses.json` (the step losses, the mean over processes), `blocks-<rank>.json` (the blocks each step ran
on that process), with `early_exit.teacher=frozen` `teacher-<rank>.json` (the frozen teacher, sharded
like the student by the loop's `place_teacher`: the parameter elements this process holds, the
total, and whether its logits equal the unsharded teacher's), `model/` (a full checkpoint through
`save_tuned`) and, with --save-at N, the sharded state at step N in `state-N/` (torch.distributed.checkpoint),
which --resume-at N loads before step N + 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from selfspec.config import load_config
from selfspec.decoding import DecodeSettings
from selfspec.model import DecoderView
from selfspec.model.loading import load_causal_lm, load_tokenizer
from selfspec.training.loop import build_objective, place_teacher

GLOBAL_BATCH = 4  # rows per optimizer step, over all processes
BLOCK = 32  # tokens per row
RECIPE = "demo_finetune"
COMMON = ["early_exit.layers=2:4", "early_exit.token_fraction=1.0", "layer_dropout.p_max=0.3",
          "layer_dropout.per_sample=false", "exit_layer=2", "optim.warmup_steps=0"]


def batches(vocab: int, steps: int) -> torch.Tensor:
    """(steps, GLOBAL_BATCH, BLOCK) token ids, the same on every process."""
    return torch.randint(0, vocab, (steps, GLOBAL_BATCH, BLOCK), generator=torch.Generator().manual_seed(7))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--plain", action="store_true", help="one process without FSDP (the reference)")
    parser.add_argument("--shares", type=int, default=2,
                        help="--plain: the processes whose sums the reference repeats")
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume-at", type=int, default=0)
    parser.add_argument("--seed-per-rank", action="store_true",
                        help="rank r is given seed 1000 r (synchronize must make its draws rank 0's)")
    args, overrides = parser.parse_known_args(argv)
    world, rank = 1, 0
    if not args.plain:
        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    if args.seed_per_rank:
        overrides.append(f"seed={1000 * rank}")
    cfg = load_config(RECIPE, [f"model.name_or_path={args.model}", f"optim.max_steps={args.steps}",
                               *COMMON, *overrides])
    torch.manual_seed(cfg.seed)
    model = load_causal_lm(args.model, "float32", "sdpa")
    view = DecoderView(model)
    objective = build_objective(model, cfg, view.num_layers, cfg.exit_layer)
    teacher = objective.frozen_model  # early_exit.teacher=frozen: a copy of the model, sharded below
    data = batches(view.lm_head.weight.shape[0], args.steps)
    probe = data[0, rank::world]
    if teacher is not None:
        with torch.no_grad():
            unsharded = teacher(probe)  # this process's first rows through the whole teacher
    if not args.plain:
        from torch.distributed.fsdp import fully_shard

        objective.layer_dropout.synchronize()  # every rank draws rank 0's blocks
        for block in view.layers:  # the units fsdp.yaml names (fsdp_transformer_layer_cls_to_wrap)
            fully_shard(block)
        fully_shard(objective)
        if teacher is not None:
            place_teacher(teacher, _accelerate_fsdp2(world))  # the loop's own placement: `shard_teacher`
    else:
        for block in view.layers:  # the autograd node fully_shard puts on each unit's inputs
            block.register_forward_pre_hook(_through_one_node, with_kwargs=True)
    ran = {}  # step -> the blocks this process ran on its (first) share (layer dropout skips the others)
    current = {"step": 0, "share": 0}

    def record(index: int) -> None:
        if current["share"] == 0:
            ran.setdefault(current["step"], []).append(index)

    for index, block in enumerate(view.layers):
        block.register_forward_pre_hook(lambda *_, i=index: record(i))
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    start = 0
    if args.resume_at:
        _load_state(objective, optimizer, args.out / f"state-{args.resume_at}")
        start = args.resume_at
    losses = {}
    objective.train()
    for step in range(start, args.steps):
        current["step"] = step + 1
        if args.plain:
            loss = _plain_step(objective, data[step], step, args.shares, current)
        else:
            rows = data[step, rank::world]  # this process's share of the global batch
            loss = objective(rows, step=step)["loss"]
            loss.backward()  # FSDP2 averages the gradients over the processes in its reduce-scatter
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses[step + 1] = mean.item()
        if args.save_at == step + 1:
            _save_state(objective, optimizer, args.out / f"state-{step + 1}")
    _save_model(objective, model, args, cfg, rank)
    (args.out / f"blocks-{rank}.json").write_text(json.dumps(ran))
    if teacher is not None:
        _report_teacher(teacher, probe, unsharded, args.out / f"teacher-{rank}.json")
    if rank == 0:
        (args.out / "losses.json").write_text(json.dumps(losses))
    if not args.plain:
        dist.destroy_process_group()
        # Every output is written: leave without the interpreter's finalization. In it, a gloo worker
        # thread that still releases the last all-gather's tensors must take the GIL to drop their Python
        # objects, which a finalizing interpreter refuses by ending the thread, and the C++ unwind through
        # the work's destructor aborts the process ("terminate called without an active exception",
        # a core's backtrace: ~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit; 5 of
        # 147 resumed runs of this worker; pytorch#179291 describes it).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _plain_step(objective, batch: torch.Tensor, step: int, shares: int, current: dict) -> torch.Tensor:
    """One step's gradient summed as `shares` FSDP processes sum it: a backward of loss / shares on each
    process's rows (r::shares) in rank order, which adds (g_0 + g_1) / 2 as the reduce-scatter does (the
    halving is exact); each share takes the step's one layer-dropout draw, as every rank draws it from
    the same generator state. Returns the mean loss over the shares, as the processes log it.

    One backward over all the rows would sum them inside each product instead: the same gradient up
    to rounding, which AdamW can blow up (see the module docstring)."""
    dropout = objective.layer_dropout
    state = dropout.generator.get_state()
    total = torch.zeros(())
    for share in range(shares):
        current["share"] = share
        dropout.generator.set_state(state)
        loss = objective(batch[share::shares], step=step)["loss"]
        (loss / shares).backward()
        total += loss.detach()
    current["share"] = 0
    return total / shares


class _Identity(torch.autograd.Function):
    """The inputs, through one autograd node (as FSDP2's `RegisterPostBackwardFunction`)."""

    @staticmethod
    def forward(ctx, *inputs: torch.Tensor):
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads


def _through_one_node(module, args, kwargs):
    """A block's forward pre-hook for the plain reference: its inputs that need a gradient pass
    through one autograd node, as `fully_shard` passes a unit's inputs. Their gradient, used inside
    the block and by an exit loss outside it, is then summed in FSDP's order: the block's uses first."""
    if not torch.is_grad_enabled():
        return None
    grad = [(key, value) for key, value in [*enumerate(args), *kwargs.items()]
            if torch.is_tensor(value) and value.requires_grad]
    if not grad:
        return None
    args, kwargs = list(args), dict(kwargs)
    for (key, _), value in zip(grad, _Identity.apply(*(value for _, value in grad))):
        if isinstance(key, int):
            args[key] = value
        else:
            kwargs[key] = value
    return tuple(args), kwargs


def _accelerate_fsdp2(world: int) -> SimpleNamespace:
    """What `place_teacher` reads of an `Accelerator` under fsdp.yaml (FSDP2), which accelerate 1.16 will
    not build on a CPU: a device mesh over the processes with accelerate's name for the sharded
    dimension, and the plugin's offload policy (none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import OffloadPolicy

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    return SimpleNamespace(is_fsdp2=True, torch_device_mesh=mesh,
                           parallelism_config=SimpleNamespace(fsdp_dim_names=["dp_shard_cp"]),
                           state=SimpleNamespace(fsdp_plugin=SimpleNamespace(cpu_offload=OffloadPolicy())))


def _report_teacher(teacher, probe: torch.Tensor, unsharded: torch.Tensor, path: Path) -> None:
    """What this process's teacher holds after training, its forwards done: the parameter elements
    stored here (a shard's, `to_local`) and the teacher's total; and whether its logits on `probe`
    are, to the bit, those the whole teacher gave before sharding."""
    from torch.distributed.tensor import DTensor

    params = list(teacher.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    with torch.no_grad():
        logits = teacher(probe)
    path.write_text(json.dumps({"local_elements": local, "total_elements": sum(p.numel() for p in params),
                                "sharded": any(isinstance(p, DTensor) for p in params),
                                "logits_equal": torch.equal(logits, unsharded)}))


def _save_state(objective, optimizer, path: Path) -> None:
    """The sharded state: each process writes its own shards (torch.distributed.checkpoint), plus the
    layer dropout's generator (the same on every rank after `synchronize`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(objective, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        torch.save(objective.layer_dropout.state_dict(), path / "layer_dropout.pt")
    dist.barrier()


def _load_state(objective, optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(objective, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(objective, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    objective.layer_dropout.load_state_dict(torch.load(path / "layer_dropout.pt", weights_only=False))


def _save_model(objective, model, args, cfg, rank: int) -> None:
    """A full checkpoint (`save_tuned`) from the gathered weights: every process takes part in the
    gather, the first one writes."""
    from selfspec.checkpoint import Provenance, save_tuned

    state_dict = None
    if not args.plain:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(objective, options=options)
        state_dict = {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}
    if rank == 0:
        save_tuned(args.out / "model", model, load_tokenizer(args.model), state_dict=state_dict,
                   settings=DecodeSettings(exit_layer=cfg.exit_layer, num_speculations=2),
                   provenance=Provenance(metrics={"processes": int(os.environ.get("WORLD_SIZE", 1))}))


if __name__ == "__main__":
    main(sys.argv[1:])
