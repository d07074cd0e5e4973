"""The training loop shared by every recipe (pretraining and the self-speculative fine-tune).

One `Accelerator`, one `prepare`, `accelerator.backward`, gradient accumulation, AdamW with warm-up
and cosine decay, clipping, periodic evaluation per candidate exit layer, trackers (JSONL always,
tensorboard, wandb), `save_state` every `save_every` steps and `resume=True` to continue from the
last one, and at the end a saved model directory with `selfspec.json`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, PartialState
from accelerate.tracking import GeneralTracker
from accelerate.utils import set_seed
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

from .. import data as data_lib
from ..checkpoint import CheckpointError, Provenance, read_meta, save_tuned
from ..config import RunConfig, default_exit_layer, to_dict
from ..cpu import has_bf16_units
from ..decoding import DecodeSettings
from ..decoding.draft_head import frequent_tokens
from ..errors import UserError
from ..files import fault_point, write_json_atomic, write_text_atomic
from ..metrics import choose_exit, weight_draft_cost
from ..model import DecoderView
from ..model.exit_adapter import new_exit_adapter
from ..model.loading import build_llama, load_causal_lm, load_tokenizer
from .early_exit import TrimmedVocab
from .features import exit_features
from .launch import check_launch, check_wrap_classes
from .layer_dropout import LayerDropout
from .objective import FrozenTeacher, SelfSpecObjective

STATE_DIR = "state"  # inside output_dir: one accelerate save_state per step-N folder, and LATEST
LATEST = "latest"  # inside STATE_DIR: the name of the newest complete state (written last, atomically)
FINAL_DIR = "model"  # the saved model inside output_dir


class JSONLTracker(GeneralTracker):
    """accelerate tracker that appends one JSON object per `log` call to `<dir>/metrics.jsonl`."""

    name = "jsonl"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str | Path):
        super().__init__()
        self.path = Path(logging_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values: dict):
        write_json_atomic(self.path.parent / "config.json", values)

    def log(self, values: dict, step: int | None = None, **kwargs):
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, **values}, default=float) + "\n")


@dataclass
class TrainResult:
    """What a run produced: where the model is and the last metrics."""

    output_dir: Path
    model_dir: Path
    steps: int
    tokens_seen: int
    seconds: float
    final_metrics: dict = field(default_factory=dict)


def _trackers(cfg: RunConfig, output_dir: Path) -> list:
    trackers = [JSONLTracker("selfspec", output_dir)]
    if "tensorboard" in cfg.log_with:
        trackers.append("tensorboard")
    if "wandb" in cfg.log_with:
        if not wandb_logged_in():
            os.environ.setdefault("WANDB_MODE", "offline")  # no credentials: log to ./wandb, sync later
        trackers.append("wandb")
    return trackers


def wandb_logged_in() -> bool:
    """Whether wandb has credentials, without asking its servers: WANDB_API_KEY, or the entry `wandb
    login` writes to ~/.netrc for its host (WANDB_BASE_URL's, api.wandb.ai by default)."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def _set_cpu_threads(requested: int | None, processes_on_machine: int) -> None:
    """Torch threads of a CPU process: `requested`, else under `accelerate launch` the machine's
    cores split over its processes, else torch's own setting (an in-process caller's choice stays).

    `accelerate launch` exports OMP_NUM_THREADS=1 unless its config says `use_cpu`, which would
    leave half of a 2-core machine idle.
    """
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ  # set for every process `accelerate launch` starts
    if requested is None and not launched:
        return
    torch.set_num_threads(requested or max(1, (os.cpu_count() or 1) // max(1, processes_on_machine)))


def has_accelerator() -> bool:
    """Whether torch sees a GPU (CUDA, MPS or XPU); without one the loop trains on the CPU."""
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return (torch.cuda.is_available() or (mps is not None and mps.is_available())
            or (xpu is not None and xpu.is_available()))


def _mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def build_model_and_tokenizer(cfg: RunConfig, corpus):
    """The model to train (loaded, or created from `cfg.model.arch`) and its tokenizer."""
    if cfg.model.from_scratch:
        tokenizer_dir = cfg.model.tokenizer or (
            data_lib.stdlib_tokenizer_dir(cfg.data.cache_path, cfg.data.tokenizer_vocab_size, cfg.seed)
            if cfg.data.source == "stdlib" else Path(cfg.output_dir) / "tokenizer")
        tokenizer = data_lib.load_or_train_tokenizer(corpus, tokenizer_dir, cfg.data.tokenizer_vocab_size)
        model = build_llama(cfg.model.arch, tokenizer, cfg.model.attn_implementation, seed=cfg.seed)
    else:
        model = load_causal_lm(cfg.model.name_or_path, cfg.model.dtype, cfg.model.attn_implementation)
        tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path)
    return model, tokenizer


def freeze_all_but_draft(model, exit_layer: int) -> None:
    """`trainable: draft`: only blocks [0, exit_layer) keep requires_grad."""
    view = DecoderView(model)
    model.requires_grad_(False)
    for block in view.layers[:exit_layer]:
        block.requires_grad_(True)


def apply_lora(model, cfg: RunConfig, exit_layer: int):
    """Wrap `model` with peft LoRA adapters on `cfg.lora.target_modules` (draft blocks only under
    `trainable: draft`)."""
    from peft import LoraConfig, get_peft_model

    lora = cfg.lora
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in lora.target_modules if m not in present]
    if missing:
        raise UserError(f"lora.target_modules {missing} are not modules of this model; "
                        f"choose from e.g. {sorted(n for n in present if 'proj' in n or 'attn' in n)[:8]}")
    layers = list(range(exit_layer)) if cfg.trainable == "draft" else None
    return get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=list(lora.target_modules),
                                            layers_to_transform=layers, task_type="CAUSAL_LM"))


def checkpoint_activations(model) -> None:
    """`model.gradient_checkpointing`: Hugging Face's activation checkpointing on every decoder block,
    non-reentrant. It wraps each block's own `forward`, so the objective's block-by-block calls
    (layer dropout skips a block outside it, the exits read its output) are checkpointed as the
    model's own forward would be, and a block run without autograd (eval, the frozen teacher) is
    not."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def hold_in_fp32(module: torch.nn.Module) -> None:
    """`model.fp32_master_weights`: widen `module`'s trainable 16-bit parameters to float32 in place,
    the master copies that mixed precision updates while autocast runs the products at 16 bits
    (accelerate does the same under FSDP and DeepSpeed). Frozen weights, the frozen teacher among
    them, keep their dtype; LoRA adapters are float32 already."""
    for param in module.parameters():
        if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()


def shard_teacher(teacher: FrozenTeacher, mesh=None, offload_policy=None) -> None:
    """Shard the frozen teacher in place as FSDP2 shards the student (`fully_shard`, from the bottom
    up: every decoder block its own unit, then the teacher as the root, whose unit holds the rest:
    embedding, final norm, head), so that each of n processes holds 1/n of it.

    Its forward all-gathers a unit's weights before the unit runs and frees them after it: the root's
    too (`reshard_after_forward` given, not FSDP's default, which keeps a root's weights for the
    backward; nothing runs backward through the teacher). The gathered weights are the teacher's
    own bits, so its logits are those of the unsharded teacher. No mixed-precision policy: the
    teacher keeps its dtype and computes under the same autocast as unsharded.

    mesh: the student's device mesh (None: FSDP's default, every process); offload_policy: the
    student's (`CPUOffloadPolicy` keeps the shards in host memory)."""
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    kwargs = dict(mesh=mesh, reshard_after_forward=True, offload_policy=offload_policy or OffloadPolicy())
    for block in DecoderView(teacher.model).layers:
        fully_shard(block, **kwargs)
    fully_shard(teacher, **kwargs)


def place_teacher(teacher: FrozenTeacher, accelerator: Accelerator) -> None:
    """The frozen teacher on the run's device: under accelerate's FSDP2 sharded like the student
    (`shard_teacher`, on the mesh and with the offload the student gets), else whole on every process
    (one process, DDP; FSDP1 and DeepSpeed ZeRO-3 shard only the prepared student: docs/scaling.md)."""
    if not accelerator.is_fsdp2:
        teacher.to(accelerator.device)
        return
    mesh = accelerator.torch_device_mesh
    if mesh is not None:  # the dimensions accelerate shards the student over (`fsdp2_prepare_model`)
        mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
    shard_teacher(teacher, mesh, accelerator.state.fsdp_plugin.cpu_offload)


def build_objective(model, cfg: RunConfig, num_layers: int, exit_layer: int,
                    token_counts=None) -> SelfSpecObjective:
    """The training module for `cfg`: layer dropout + early-exit losses around `model`.

    token_counts: (V,) frequencies of the training data, which rank the ids of a trimmed exit loss
    (`early_exit.draft_vocab_size`)."""
    dropout = None
    if cfg.layer_dropout.p_max > 0:
        ld = cfg.layer_dropout
        dropout = LayerDropout(num_layers, ld.p_max, depth=ld.depth_curve, schedule=ld.schedule,
                               total_steps=cfg.optim.max_steps, per_sample=ld.per_sample,
                               protected_layers=exit_layer if ld.protect_draft_layers else 0, seed=cfg.seed)
    ee = cfg.early_exit
    layers = ee.layer_list(num_layers)
    if cfg.trainable == "adapter":
        # The model is frozen and undropped: its own final layer is the frozen teacher.
        ee = dataclasses.replace(ee, teacher="self")
    frozen = None
    if layers and ee.teacher == "frozen" and not cfg.lora.enabled:
        frozen = FrozenTeacher(copy.deepcopy(model)).eval().requires_grad_(False)
    vocab = None
    if layers and ee.draft_vocab_size is not None:
        vocab_size = DecoderView(model).lm_head.weight.shape[0]
        if ee.draft_vocab_size > vocab_size:
            raise UserError(f"early_exit.draft_vocab_size = {ee.draft_vocab_size} exceeds the model's "
                            f"{vocab_size}-token vocabulary; choose at most {vocab_size}, or null")
        if token_counts is None:
            raise ValueError("early_exit.draft_vocab_size needs the training data's token counts")
        vocab = TrimmedVocab(frequent_tokens(token_counts, ee.draft_vocab_size), vocab_size)
    adapter = None
    if cfg.trainable == "adapter":
        if layers != [exit_layer]:
            raise UserError(f"trainable: adapter trains one exit, exit_layer = {exit_layer}: "
                            f"set early_exit.layers to {exit_layer} (it is {ee.layers!r})")
        if cfg.adapter_init_layer is not None and not 0 <= cfg.adapter_init_layer < num_layers:
            raise UserError(f"adapter_init_layer = {cfg.adapter_init_layer} is not a block of the "
                            f"model's {num_layers}; choose 0..{num_layers - 1}, or null for the last")
        last = num_layers - 1 if cfg.adapter_init_layer is None else cfg.adapter_init_layer
        if cfg.adapter_kind == "block" and cfg.adapter_blocks > last + 1:
            raise UserError(f"adapter_blocks = {cfg.adapter_blocks} copies more blocks than the "
                            f"{last + 1} up to block {last}; choose at most {last + 1}")
        adapter = new_exit_adapter(cfg.adapter_kind, model, exit_layer, cfg.adapter_size,
                                   cfg.adapter_init_layer, cfg.adapter_blocks).requires_grad_(True)
    return SelfSpecObjective(model, ee, layers, layer_dropout=dropout, total_steps=cfg.optim.max_steps,
                             frozen_model=frozen, seed=cfg.seed, exit_vocab=vocab, exit_adapter=adapter)


@dataclass
class _Run:
    """What one training run holds while it trains (built by `_setup`)."""

    cfg: RunConfig
    output_dir: Path
    accelerator: Accelerator
    objective: torch.nn.Module  # SelfSpecObjective, wrapped by accelerate
    optimizer: torch.optim.Optimizer
    scheduler: object
    loader: DataLoader
    trainable: list
    tokenizer: object
    train_blocks: object
    val_blocks: object
    exit_layer: int
    token_counts: object  # (V,) token frequencies of the training blocks
    weights_dtype: torch.dtype  # the model's weights as loaded: the checkpoint is saved at it
    feature_seconds: float = 0.0  # computing the exit features (cache_features), 0 when cached already
    step: int = 0  # optimizer steps done
    micro: int = 0  # micro-batches consumed (per process)
    minutes_before: float = 0.0  # the wall-clock minutes of the run before the state it resumed from
    wandb_run_id: str | None = None  # the wandb run this one logs to (a resume continues it)

    @property
    def tokens(self) -> int:
        """Training tokens seen so far, over all processes."""
        optim, data = self.cfg.optim, self.cfg.data
        return self.micro * optim.batch_size * data.block_size * self.accelerator.num_processes

    @property
    def tokens_per_step(self) -> int:
        """Training tokens an optimizer step reads, over all processes."""
        optim, data = self.cfg.optim, self.cfg.data
        return optim.grad_accum * optim.batch_size * data.block_size * self.accelerator.num_processes

    def evaluate(self) -> dict:
        # A 16-bit model is evaluated as it trains, under mixed precision's autocast (the evaluation
        # calls the model past accelerate's wrapper): its float32 master weights (`hold_in_fp32`) or a
        # float32 exit adapter meet 16-bit tensors there. A float32 model stays float32.
        sixteen_bits = self.weights_dtype in (torch.bfloat16, torch.float16)
        with self.accelerator.autocast() if sixteen_bits else nullcontext():
            return evaluate(self.accelerator, self.objective, self.val_blocks,
                            objective_inner(self.objective).exit_layers, self.exit_layer, self.cfg)

    def batches(self):
        """Training batches forever, epoch after epoch, from where `micro` says the run is: dicts of
        input_ids (B, T) and, for chat data, target_mask (B, T), a share of them cut into shorter
        blocks under `data.short_block_size`; or an exit adapter's cached features
        (`training.features`)."""
        batches_per_epoch = len(self.loader)
        data = self.cfg.data
        while True:
            epoch, offset = divmod(self.micro, batches_per_epoch)
            self.loader.set_epoch(epoch)
            epoch_loader = self.accelerator.skip_first_batches(self.loader, offset) if offset else self.loader
            for batch in epoch_loader:
                self.micro += 1
                if data.cut_length and data_lib.is_short_batch(self.micro - 1, data.short_fraction):
                    batch = data_lib.cut_blocks(batch, data.cut_length)
                yield batch


def train(cfg: RunConfig, resume: bool = False, progress: bool = True, kind: str = "tuned",
          overwrite: bool = False) -> TrainResult:
    """Run one training job described by `cfg`; returns where the saved model is and its metrics.

    resume: continue from the newest complete state in `<output_dir>/state`. Without it, an
    output_dir that holds a previous run is refused unless `overwrite` (whose old logs and states
    are then removed first), so a run is never silently mixed into another's.
    """
    output_dir = Path(cfg.output_dir)
    _claim_output_dir(output_dir, resume, overwrite)
    saved = _saved_progress(output_dir) if resume else {}  # before the model loads: a missing state says so
    run = _setup(cfg, output_dir)
    run.wandb_run_id = _start_trackers(run.accelerator, cfg, saved.get("wandb_run_id"))
    if resume:
        _resume(run)
    max_steps = cfg.optim.max_steps
    bar = tqdm(total=max_steps, initial=run.step, desc="train",
               disable=not (progress and run.accelerator.is_main_process))
    window, last_eval = [], {}  # recent losses and the last evaluation, for the progress bar
    if run.feature_seconds and run.step == 0:  # the curves count the one-time preparation as time spent
        run.accelerator.log({"feature_minutes": run.feature_seconds / 60}, step=0)
    if cfg.eval_every and run.step == 0:  # the curve's origin: the model as it came, on the same split
        run.accelerator.log({**run.evaluate(), "tokens": 0}, step=0)
    stream, start_time = run.batches(), time.perf_counter()
    run.objective.train()
    while run.step < max_steps:
        if cfg.optim.max_minutes and time.perf_counter() - start_time > 60 * cfg.optim.max_minutes:
            run.accelerator.print(f"stopping at step {run.step}: "
                                  f"optim.max_minutes = {cfg.optim.max_minutes} reached")
            break
        step_start = time.perf_counter()
        logs = _train_step(run, stream)  # its values read back: the step's work is done
        logs["step_seconds"] = time.perf_counter() - step_start
        logs["tokens_per_second"] = run.tokens_per_step / logs["step_seconds"]
        if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < max_steps:
            last_eval = run.evaluate()
            logs.update(last_eval)
            run.objective.train()
        # wall clock: the per-minute curves (not a budget), continued over a resume
        logs["minutes"] = run.minutes_before + (time.perf_counter() - start_time) / 60
        run.accelerator.log(logs, step=run.step)
        window = (window + [logs["loss"]])[-20:]
        bar.set_postfix(_progress_postfix(window, last_eval, run.exit_layer))
        bar.update(1)
        if cfg.save_every and run.step % cfg.save_every == 0 and run.step < max_steps:
            save_state(run.accelerator, output_dir / STATE_DIR, run.step,
                       {"minutes": logs["minutes"], "wandb_run_id": run.wandb_run_id})
    bar.close()
    return _finish(run, kind, seconds=time.perf_counter() - start_time)


def _setup(cfg: RunConfig, output_dir: Path) -> _Run:
    """Accelerator, data, model, objective, optimizer and schedule, prepared for this run."""
    accelerator = _accelerator(cfg, output_dir)
    model, tokenizer, train_blocks, val_blocks = _data_and_model(cfg, accelerator)
    view = DecoderView(model)
    num_layers, limit = view.num_layers, view.max_positions
    if limit is not None and cfg.data.block_size > limit:
        raise UserError(f"data.block_size = {cfg.data.block_size} exceeds the model's {limit} positions; "
                        f"set data.block_size <= {limit}")
    exit_layer = cfg.exit_layer or default_exit_layer(num_layers)
    if exit_layer > num_layers:
        raise UserError(f"exit_layer = {exit_layer} is larger than the model's {num_layers} layers")
    weights_dtype = view.dtype
    if cfg.model.gradient_checkpointing:
        checkpoint_activations(model)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg, exit_layer)
    elif cfg.trainable == "draft":
        freeze_all_but_draft(model, exit_layer)
    elif cfg.trainable == "adapter":
        model.requires_grad_(False)
    # Token frequencies of the training data: the ranking of a trimmed exit loss and draft head.
    token_counts = data_lib.count_tokens(train_blocks, view.lm_head.weight.shape[0])
    objective = build_objective(model, cfg, num_layers, exit_layer, token_counts)
    # after the objective: the frozen teacher it copied stays at the loaded dtype
    if cfg.model.fp32_master_weights and accelerator.mixed_precision in ("bf16", "fp16"):
        hold_in_fp32(objective)
    check_wrap_classes(model)
    feature_seconds = 0.0
    if cfg.trainable == "adapter" and cfg.cache_features:
        feature_start = time.perf_counter()
        train_blocks = _cached_features(cfg, accelerator, model, train_blocks, exit_layer)
        feature_seconds = time.perf_counter() - feature_start
    if objective.frozen_model is not None:
        place_teacher(objective.frozen_model, accelerator)
    objective, optimizer, loader, scheduler, trainable = _prepared(cfg, accelerator, objective, train_blocks)
    return _Run(cfg, output_dir, accelerator, objective, optimizer, scheduler, loader, trainable, tokenizer,
                train_blocks, val_blocks, exit_layer, token_counts, weights_dtype,
                feature_seconds=feature_seconds)


def _accelerator(cfg: RunConfig, output_dir: Path) -> Accelerator:
    """The run's `Accelerator` (its launch checked, the seed set, the CPU threads and DeepSpeed's
    clipping set from the recipe)."""
    check_launch(has_accelerator(), torch.cuda.device_count())
    plugin_kwargs = []
    if cfg.layer_dropout.p_max > 0 and not cfg.layer_dropout.per_sample:
        # A block skipped for the whole batch leaves its parameters without gradient on that step;
        # DDP must be told, or it waits forever for their all-reduce.
        plugin_kwargs.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    accelerator = Accelerator(
        # cpu: so that `accelerate launch --multi_gpu --num_processes 2` runs gloo DDP on CPUs
        cpu=not has_accelerator(), gradient_accumulation_steps=cfg.optim.grad_accum,
        mixed_precision=_mixed_precision(cfg.mixed_precision),
        log_with=_trackers(cfg, output_dir), project_dir=str(output_dir), kwargs_handlers=plugin_kwargs,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed,
                                                  non_blocking=torch.cuda.is_available()))
    set_seed(cfg.seed)
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None:  # the recipe's clipping, not accelerate's fixed 1.0 for a config's "auto"
        deepspeed.deepspeed_config["gradient_clipping"] = cfg.optim.grad_clip
    reduce_gradients_in_fp32(getattr(accelerator.state, "fsdp_plugin", None))
    if accelerator.device.type == "cpu":
        _set_cpu_threads(cfg.cpu_threads, int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
        if accelerator.mixed_precision == "bf16" and has_bf16_units() is False:
            accelerator.print("warning: mixed_precision bf16 on a CPU without bf16 units is emulated and "
                              "many times slower than fp32; set mixed_precision=no on this machine")
    return accelerator


def reduce_gradients_in_fp32(fsdp_plugin) -> None:
    """Under FSDP with mixed precision, reduce gradients in fp32 while the passes compute in bf16/fp16:
    accelerate's policy for a launch config's `mixed_precision` reduces in that dtype too, which sums
    the processes' gradients in 8 (bf16) mantissa bits. Nothing without FSDP or mixed precision."""
    import dataclasses

    policy = getattr(fsdp_plugin, "mixed_precision_policy", None)
    if policy is not None and getattr(policy, "reduce_dtype", None) not in (None, torch.float32):
        fsdp_plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)


def _data_and_model(cfg: RunConfig, accelerator: Accelerator) -> tuple:
    """(model, tokenizer, training blocks, validation blocks), made by the main process first (the
    others then read its caches)."""
    with accelerator.main_process_first():
        corpus = data_lib.load_corpus(cfg.data.source, cfg.data.text_field, cache_dir=cfg.data.cache_path,
                                      seed=cfg.seed, keep_truncated=cfg.data.keep_truncated)
        model, tokenizer = build_model_and_tokenizer(cfg, corpus)
        data = cfg.data
        skip_forced = cfg.early_exit.skip_forced
        train_blocks = data_lib.pack_split(corpus["train"], tokenizer, data.block_size, data.text_field,
                                           max_blocks=data.max_train_blocks, cache_dir=data.cache_path,
                                           skip_forced=skip_forced)
        held_out = corpus if data.eval_source is None else data_lib.load_corpus(
            data.eval_source, data.text_field, cache_dir=data.cache_path, seed=cfg.seed)
        val_blocks = data_lib.pack_split(held_out["validation"], tokenizer, data.block_size, data.text_field,
                                         max_blocks=data.max_eval_blocks, cache_dir=data.cache_path,
                                         skip_forced=skip_forced)
    return model, tokenizer, train_blocks, val_blocks


def _cached_features(cfg: RunConfig, accelerator: Accelerator, model, train_blocks, exit_layer: int):
    """The training blocks as the frozen model's exit states and teacher (`exit_features`): the model is
    frozen, so they are the same every epoch."""
    ee = cfg.early_exit
    with accelerator.main_process_first():
        cache_dir = None if cfg.model.from_scratch else cfg.data.cache_path
        features = exit_features(model.to(accelerator.device), train_blocks, cfg.model.name_or_path,
                                 exit_layer, 1 if ee.kind == "argmax" else ee.teacher_top_k,
                                 ee.temperature, cache_dir, batch_size=cfg.optim.batch_size,
                                 progress=accelerator.is_local_main_process)
    if "draft_mask" in train_blocks.column_names:  # the features do not depend on it: joined after
        features = datasets.concatenate_datasets(
            [features.with_format(None), train_blocks.select_columns(["draft_mask"]).with_format(None)],
            axis=1).with_format("torch")
    return features


def _prepared(cfg: RunConfig, accelerator: Accelerator, objective, train_blocks) -> tuple:
    """(objective, optimizer, loader, scheduler) prepared by the accelerator, and the trainable
    parameters; the layer dropout's draws registered for checkpointing."""
    # pinned on a GPU: accelerate's copy of each batch (`non_blocking`, `_accelerator`) is then queued
    # like a kernel rather than waiting for the device
    loader = DataLoader(train_blocks, batch_size=cfg.optim.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(cfg.seed),
                        pin_memory=accelerator.device.type == "cuda")
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)
    # accelerate steps a prepared scheduler once per process for every optimizer step (its convention
    # for per-process schedules), so the schedule is laid out in process-steps.
    scale = accelerator.num_processes
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=cfg.optim.warmup_steps * scale,
        num_training_steps=cfg.optim.max_steps * scale, min_lr_rate=cfg.optim.min_lr_ratio)
    objective, optimizer, loader, scheduler = accelerator.prepare(objective, optimizer, loader, scheduler)
    # What `prepare` made: FSDP2 replaces every parameter (its shards), so the list to clip is read here.
    trainable = [p for p in objective.parameters() if p.requires_grad]
    register_fsdp_forward_method(objective_inner(objective), "exit_metrics")  # a no-op unless FSDP2
    dropout = objective_inner(objective).layer_dropout
    if dropout is not None:
        dropout.synchronize()  # rank 0's draws on every rank, whatever seed a machine was given
        accelerator.register_for_checkpointing(dropout)
    if len(loader) == 0:
        raise UserError(f"the training split has fewer than optim.batch_size = {cfg.optim.batch_size} "
                        f"blocks; lower optim.batch_size or data.block_size")
    return objective, optimizer, loader, scheduler, trainable


def _saved_progress(output_dir: Path) -> dict:
    """The newest complete state's progress.json ({step, minutes, wandb_run_id}), or a one-line error."""
    state_dir = output_dir / STATE_DIR
    saved = latest_state(state_dir)
    if saved is None:
        raise UserError(f"--resume: no saved state in {state_dir}; run without --resume to start fresh")
    return json.loads((saved / "progress.json").read_text())


def _start_trackers(accelerator: Accelerator, cfg: RunConfig, wandb_run_id: str | None) -> str | None:
    """Start the run's trackers; a resumed run logs on into the wandb run it saved the id of. Returns the
    wandb run's id (None without wandb, and on the processes that do not log)."""
    kwargs = {"wandb": {"id": wandb_run_id, "resume": "allow"}} if wandb_run_id else {}
    accelerator.init_trackers("selfspec", config=_flat(to_dict(cfg)), init_kwargs=kwargs)
    if "wandb" not in cfg.log_with or not accelerator.is_main_process:
        return wandb_run_id
    return accelerator.get_tracker("wandb", unwrap=True).id


def _resume(run: _Run) -> None:
    """Load the newest complete state; the step, the data position and the wall clock continue from it,
    and metrics.jsonl loses the rows logged after it (the resumed run logs those steps again)."""
    saved = latest_state(run.output_dir / STATE_DIR)
    run.accelerator.load_state(str(saved))
    progress = json.loads((saved / "progress.json").read_text())
    run.step = progress["step"]
    run.minutes_before = progress.get("minutes", 0.0)
    run.micro = run.step * run.cfg.optim.grad_accum  # micro-batches already consumed
    metrics = run.output_dir / "metrics.jsonl"
    if run.accelerator.is_main_process and metrics.is_file():
        rows = metrics.read_text().splitlines(keepends=True)
        kept = [row for row in rows if row.strip() and (json.loads(row).get("step") or 0) <= run.step]
        write_text_atomic(metrics, "".join(kept))
    run.accelerator.wait_for_everyone()


def _train_step(run: _Run, stream) -> dict:
    """One optimizer step over `grad_accum` micro-batches; its logged values (means over processes)."""
    cfg, accelerator = run.cfg, run.accelerator
    sums = {}  # device tensors: read back once per step, not once per micro-batch and key
    dropped = []  # the layer dropout's applied rates, host floats (every rank draws alike)
    for _ in range(cfg.optim.grad_accum):
        batch = next(stream)
        with accelerator.accumulate(run.objective):
            out = run.objective(**batch, step=run.step)
            accelerator.backward(out["loss"])
            fault_point(f"mid_step:{run.step + 1}")  # gradients computed, no update yet
            if accelerator.sync_gradients and cfg.optim.grad_clip > 0:
                # DeepSpeed clips inside its step (gradient_clipping) and reports the norm as a float, or
                # None before its first step
                norm = accelerator.clip_grad_norm_(run.trainable, cfg.optim.grad_clip)
                if norm is not None:
                    sums["grad_norm"] = torch.as_tensor(norm).detach()
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
        for key, value in out.items():
            sums[key] = sums.get(key, 0.0) + value.detach() / cfg.optim.grad_accum
        rate = objective_inner(run.objective).applied_dropout
        dropped += [] if rate is None else [rate]
    # Logged values are means over all processes (one small all-reduce a step): under DDP the
    # curve is the global batch's, the same as one process with that batch.
    values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=accelerator.device)
                          for v in sums.values()])
    logs = dict(zip(sums, accelerator.reduce(values, reduction="mean").tolist()))
    run.step += 1
    if dropped:
        logs["layer_dropout"] = sum(dropped) / len(dropped)
    logs["lr"] = run.scheduler.get_last_lr()[0]
    logs["tokens"] = run.tokens
    return logs


def _progress_postfix(window: list[float], last_eval: dict, exit_layer: int) -> dict:
    postfix = {"loss": f"{sum(window) / len(window):.3f}"}
    key = f"val/top1_agreement@{exit_layer}"
    if key in last_eval:
        postfix[f"agree@{exit_layer}"] = f"{last_eval[key]:.3f}"
    return postfix


def _finish(run: _Run, kind: str, seconds: float) -> TrainResult:
    """Final evaluation, then the model, tokenizer, token counts and selfspec.json into
    `<output_dir>/model`."""
    cfg, accelerator, objective = run.cfg, run.accelerator, run.objective
    final = run.evaluate()
    accelerator.log({**final, "tokens": run.tokens}, step=run.step)
    model_dir = run.output_dir / FINAL_DIR
    accelerator.wait_for_everyone()
    saved, state_dict, adapter_state = _weights_to_save(run)
    choice = exit_choice(objective_inner(objective), final) if cfg.choose_exit else None
    exit_layer = choice["exit_layer"] if choice else run.exit_layer
    if choice:
        accelerator.print(f"exit chosen on the validation split: E = {exit_layer}, "
                          f"k = {choice['num_speculations']}, predicted {choice['predicted_speedup']:.2f}x")
    if accelerator.is_main_process:
        k = choice["num_speculations"] if choice else cfg.num_speculations
        settings = DecodeSettings(exit_layer=exit_layer, num_speculations=k,
                                  draft_vocab_size=cfg.early_exit.draft_vocab_size)
        provenance = Provenance(
            kind=kind, base_model=None if cfg.model.from_scratch else cfg.model.name_or_path,
            training=to_dict(cfg), exit_choice=choice,
            token_counts_source=f"training data ({cfg.data.source}, train split)",
            metrics={**final, "steps": run.step, "tokens_seen": run.tokens,
                     "train_seconds": round(seconds, 1),
                     "feature_seconds": round(run.feature_seconds, 1),
                     "processes": accelerator.num_processes,
                     # ZeRO-3 leaves each rank's parameters empty: count the gathered weights
                     "parameters": (sum(v.numel() for v in state_dict.values()) if state_dict
                                    else sum(p.numel() for p in saved.parameters()))})
        save_tuned(model_dir, saved, run.tokenizer, state_dict=state_dict, settings=settings,
                   provenance=provenance, token_counts=run.token_counts,
                   dtype=run.weights_dtype,  # float32 master copies (ours, FSDP's) rounded back
                   exit_adapter=accelerator.unwrap_model(objective).exit_adapter, adapter_state=adapter_state)
    accelerator.wait_for_everyone()  # every rank may read the saved model after this (finetune.py does)
    accelerator.end_training()
    return TrainResult(run.output_dir, model_dir, run.step, run.tokens, seconds, final)


def _weights_to_save(run: _Run) -> tuple:
    """(model, its state dict or None, the exit adapter's or None): what the main process saves.

    Under FSDP and ZeRO-3 each rank holds only a shard, and `get_state_dict` gathers the full weights on
    the main process (every rank takes part; ZeRO-3 through DeepSpeed's own consolidation, which
    zero3.yaml's zero3_save_16bit_model turns on). LoRA is merged by peft from modules: under FSDP2 a
    plain copy of the model on the main process holds the gathered weights for it (its own modules hold
    shards); under DDP and one process the model itself (sharded LoRA under ZeRO-3 is not supported)."""
    cfg, accelerator, objective = run.cfg, run.accelerator, run.objective
    model = accelerator.unwrap_model(objective).model
    if cfg.lora.enabled and not accelerator.is_fsdp2:
        return model, None, None
    full = accelerator.get_state_dict(objective)
    if not accelerator.is_main_process:
        return model, None, None
    weights = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    adapter = {k[len("exit_adapter."):]: v for k, v in full.items() if k.startswith("exit_adapter.")}
    if not cfg.lora.enabled:
        return model, weights, adapter or None
    with torch.device("meta"):  # no memory: the gathered tensors are assigned to it
        plain = apply_lora(AutoModelForCausalLM.from_config(model.get_base_model().config), cfg,
                           run.exit_layer)
    plain.load_state_dict(weights, assign=True)
    return plain, None, adapter or None


def exit_choice(objective: SelfSpecObjective, metrics: dict) -> dict:
    """`metrics.choose_exit` over the candidate exits, α from the validation agreement in `metrics`
    and c from the weights each draft reads (the trimmed head's V' rows when the loss had them)."""
    view = objective.view
    blocks = [sum(p.numel() for p in block.parameters()) for block in view.layers]
    head = view.lm_head.weight.numel()
    vocab = objective.exit_vocab
    draft_head = head if vocab is None else vocab.token_ids.numel() * view.lm_head.weight.shape[1]
    acceptance = {e: metrics[f"val/top1_agreement@{e}"] for e in objective.exit_layers}
    return choose_exit(acceptance, {e: weight_draft_cost(e, blocks, head, draft_head) for e in acceptance})


def train_or_reuse(cfg: RunConfig, kind: str = "tuned", force: bool = False, resume: bool = False,
                   progress: bool = True) -> tuple[Path, bool]:
    """Train unless `<output_dir>/model` already holds a model trained with exactly this config.

    Returns (model_dir, reused)."""
    model_dir = Path(cfg.output_dir) / FINAL_DIR
    if not (force or resume):
        try:
            meta = read_meta(model_dir)
            # A run cut short by optim.max_minutes has the config but not the model it describes.
            complete = meta.get("metrics", {}).get("steps") == cfg.optim.max_steps
            if _trains_alike(meta.get("training") or {}, to_dict(cfg)) and complete:
                return model_dir, True
        except CheckpointError:
            pass
    # this function owns output_dir by its config: a different config (or force) retrains over it
    return train(cfg, resume=resume, progress=progress, kind=kind, overwrite=True).model_dir, False


def _trains_alike(a: dict, b: dict) -> bool:
    """Two runs' configs equal in what they train: where the caches live does not count, and a field
    added to the config since a run was stored counts at its default (what that run trained with)."""
    if not a or not b:  # a run that stored no config is never taken for another
        return False
    defaults = to_dict(RunConfig())

    def filled(stored, default):
        """`stored` with the fields it lacks taken from `default`, section by section."""
        if not (isinstance(stored, dict) and isinstance(default, dict)):
            return stored
        return {**default, **{key: filled(value, default.get(key)) for key, value in stored.items()}}

    def result_fields(training: dict) -> dict:
        run = filled(training, defaults)
        data = run.get("data")
        return {**run, "data": {k: v for k, v in data.items() if k != "cache_dir"} if isinstance(data, dict)
                else data}
    return result_fields(a) == result_fields(b)


def objective_inner(objective) -> SelfSpecObjective:
    """The SelfSpecObjective inside DDP/FSDP wrappers."""
    return objective.module if hasattr(objective, "module") else objective


def save_state(accelerator: Accelerator, state_dir: Path, step: int, progress: dict | None = None) -> None:
    """accelerate save_state into `state/step-N`, its step counter (and `progress`: the run's minutes, its
    wandb run's id) in progress.json, then the pointer `state/latest`.

    The pointer is written last and atomically, and older states are removed only after it, so a
    process killed at any moment leaves `latest` naming a complete state: the previous one while a
    save is under way, a half-written folder never.
    """
    target = state_dir / f"step-{step:08d}"
    if accelerator.is_main_process and target.exists():  # left half-written by a killed run
        shutil.rmtree(target)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(target))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json_atomic(target / "progress.json", {"step": step, **(progress or {})})
        fault_point(f"saving:{step}")  # state written, `latest` not yet moved
        write_text_atomic(state_dir / LATEST, target.name + "\n")
        fault_point(f"saved:{step}")
        for old in state_dir.glob("step-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def latest_state(state_dir: Path) -> Path | None:
    """The newest complete state in `state_dir` (what `latest` names, if it holds its step), or None."""
    pointer = state_dir / LATEST
    if not pointer.is_file():
        return None
    target = state_dir / pointer.read_text().strip()
    return target if (target / "progress.json").is_file() else None


def _claim_output_dir(output_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to start a fresh run over a previous one (unless `overwrite`, which clears its logs and
    states)."""
    candidates = (output_dir / FINAL_DIR, output_dir / STATE_DIR, output_dir / "metrics.jsonl")
    previous = [p for p in candidates if p.exists()]
    if resume or not previous:
        return
    if not overwrite:
        raise UserError(f"{output_dir} holds a previous run ({', '.join(p.name for p in previous)}); "
                        f"pass --resume to continue it, --force to replace it, or choose another output_dir")
    if PartialState().is_main_process:
        for path in previous:
            if path.name != FINAL_DIR:  # the model is replaced atomically at the end, never deleted first
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    PartialState().wait_for_everyone()


def evaluate(accelerator, objective, val_blocks, exit_layers, exit_layer, cfg) -> dict:
    """Validation metrics per candidate layer (and the final layer), averaged over all processes."""
    ids, mask = data_lib.block_tensors(val_blocks)
    rows = slice(accelerator.process_index, None, accelerator.num_processes)
    layers = sorted(set(exit_layers) | {exit_layer})
    metrics = functools.partial(objective_inner(objective).exit_metrics, ids[rows], layers, exit_layer,
                                cfg.optim.batch_size, accelerator.reduce)
    report = metrics(None if mask is None else mask[rows])
    num_layers = max(report)
    out = {"val/loss": report[num_layers]["loss"], "val/perplexity": report[num_layers]["perplexity"]}
    drafted = data_lib.draft_mask(val_blocks)
    if drafted is not None:  # the exits on the tokens they will draft (a grammar forces the rest)
        drafted_report = metrics(drafted[rows])
    for layer in layers:
        if layer == num_layers:
            continue
        for key in ("loss", "top1_agreement", "expected_acceptance"):
            out[f"val/{key}@{layer}"] = report[layer][key]
            if drafted is not None:
                out[f"val/drafted/{key}@{layer}"] = drafted_report[layer][key]
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested config -> flat {a/b: value} with tracker-friendly values (lists become strings)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out

