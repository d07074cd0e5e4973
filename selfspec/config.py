"""The configuration schema: dataclasses whose fields are documented where they are defined.

A YAML file is an instance of `RunConfig`; `a.b=value` command-line overrides are applied on top.
Types are checked as the file is read; ranges by each section's `__post_init__`, beside its fields,
so a section built in Python is checked too. Every error is a one-line `ConfigError` that names the
field (dotted from the top of the file), the bad value and what is allowed (an unknown key also
names the closest valid one).

    cfg = load_config("demo_finetune", ["optim.max_steps=100", "early_exit.layers=2:8:2"])
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from . import recipes
from .errors import UserError
from .files import cache_dir


class ConfigError(UserError):
    """A user mistake in a config file or override; its message is one line that says how to fix it."""


class FieldError(ConfigError):
    """A field whose value is out of range, raised by its section's `__post_init__`.

    The message names the field as the section knows it (`lr = -1 is not allowed; ...`);
    `from_dict` re-raises it with the section's dotted place in the file (`optim.lr = ...`).
    """

    def __init__(self, name: str, value: Any, allowed: str):
        super().__init__(f"{name} = {value!r} is not allowed; {allowed}")
        self.name, self.value, self.allowed = name, value, allowed

    def within(self, prefix: str) -> FieldError:
        """The same error, the field named from one level up (`prefix` ends with a dot)."""
        return FieldError(f"{prefix}{self.name}", self.value, self.allowed)


def _check(condition: bool, name: str, value: Any, allowed: str) -> None:
    """FieldError naming `name`, the bad `value` and what is `allowed`, unless `condition` holds."""
    if not condition:
        raise FieldError(name, value, allowed)


@functools.cache
def _choice_fields(section: type) -> dict[str, tuple]:
    """{field: its allowed values} for the fields of dataclass `section` whose type is a `Literal`."""
    hints = typing.get_type_hints(section)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(section)
            if typing.get_origin(hints[f.name]) is Literal}


def _check_choices(section: Any) -> None:
    """FieldError for a `Literal` field of `section` whose value is none of its choices (a section
    built in Python; a config file's values are checked as they are read)."""
    for name, allowed in _choice_fields(type(section)).items():
        value = getattr(section, name)
        _check(value in allowed, name, value, f"choose one of {', '.join(map(repr, allowed))}")


# Allowed values, written once: the schema's fields use these, and the training code reads them
# back with `choices` to check what it is handed directly (Python API, tests).
DepthCurve = Literal["uniform", "linear", "exp"]  # layer dropout D(l) over depth
StepSchedule = Literal["constant", "linear", "exp"]  # layer dropout S(t) over training steps
ExitLoss = Literal["kl", "ce", "both", "argmax"]
ExitScale = Literal["uniform", "linear", "sqrt", "sum_l"]
Curriculum = Literal["none", "rotational", "gradual"]


def choices(literal) -> tuple:
    """The allowed values of a `Literal` type."""
    return typing.get_args(literal)


def check_choice(name: str, value, literal) -> None:
    """UserError naming `name`, the bad value and the allowed ones, unless `value` is one of them."""
    if value not in choices(literal):
        raise UserError(f"{name} must be one of {list(choices(literal))}, got {value!r}")


# ---------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------


@dataclass
class ArchConfig:
    """Architecture of a model trained from scratch (only read when `model.from_scratch` is true)."""

    model_type: Literal["llama"] = "llama"
    """Family of the from-scratch model."""
    hidden_size: int = 256
    """Width D of the residual stream."""
    num_layers: int = 12
    """Number of decoder blocks N."""
    num_heads: int = 8
    """Attention heads per block."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    intermediate_size: int = 688
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = 2048
    """Longest sequence the rotary embedding is set up for."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head (fewer parameters for small models)."""

    def __post_init__(self):
        _check_choices(self)
        _check(self.num_layers >= 2, "num_layers", self.num_layers, "it must be >= 2")
        _check(self.num_heads >= 1, "num_heads", self.num_heads, "it must be >= 1")
        _check(self.num_kv_heads >= 1, "num_kv_heads", self.num_kv_heads, "it must be >= 1")
        _check(self.hidden_size % self.num_heads == 0, "hidden_size", self.hidden_size,
               f"it must be a multiple of num_heads ({self.num_heads})")
        _check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
               f"it must divide num_heads ({self.num_heads})")


@dataclass
class ModelConfig:
    name_or_path: str = "runs/base"
    """A Hugging Face model id or local directory to start from (or to create, with from_scratch)."""
    from_scratch: bool = False
    """Build a new random model from `arch` and the tokenizer instead of loading weights."""
    arch: ArchConfig = field(default_factory=ArchConfig)
    """Architecture for from_scratch models."""
    tokenizer: str | None = None
    """Tokenizer directory or id; None means the one beside the model (from_scratch: the embedded
    tokenizer trained on the corpus, kept under data.cache_dir)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype when loading: auto = float32 on CPU, the checkpoint's dtype on GPU. The tuned
    checkpoint is saved at it."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel used by the Hugging Face blocks."""
    fp32_master_weights: bool = True
    """Under 16-bit mixed precision (`mixed_precision` bf16/fp16, auto on a GPU), hold the trained
    weights of a 16-bit model in float32 (their gradients and AdamW's moments follow), the products
    running at 16 bits under autocast, and round them back to `dtype` when the checkpoint is saved:
    what FSDP and DeepSpeed do anyway. A bf16 weight keeps no update smaller than half its spacing
    (a step of 2e-5 is lost on every |w| >= 0.008), so false, training the 16-bit weights themselves,
    loses most of a small learning rate's steps; it halves the memory of weights, gradients and
    moments (docs/scaling.md). LoRA adapters are float32 either way; frozen weights, the frozen
    teacher among them, stay at `dtype`."""
    gradient_checkpointing: bool = False
    """Activation checkpointing of every decoder block (Hugging Face's, use_reentrant=False): a
    block keeps only its input, and its activations are recomputed in the backward, one more
    forward of the blocks per step. Same losses and gradients."""

    def __post_init__(self):
        _check_choices(self)


@dataclass
class DataConfig:
    source: str = "stdlib"
    """`stdlib` (the embedded corpus), a local file/glob (.txt/.jsonl/.json/.parquet), a save_to_disk
    directory, or a datasets hub name (where a network exists)."""
    text_field: str = "text"
    """Column that holds the text."""
    cache_dir: str | None = None
    """Where built corpora, the embedded tokenizer, packed blocks and exit features are stored and
    reused (default: the user cache directory, `selfspec.files.cache_dir`)."""
    tokenizer_vocab_size: int = 4096
    """Vocabulary size when the embedded tokenizer has to be trained."""
    block_size: int = 256
    """Tokens per packed training block: the longest context the run trains on."""
    short_block_size: int | None = None
    """Mixed lengths: cut `short_fraction` of the training micro-batches into blocks of this many
    tokens (a divisor of `block_size`; none are cut where `block_size` is not longer), the rest
    training on whole blocks. A (B, block_size) batch becomes (B * block_size / short_block_size,
    short_block_size): the same tokens a step, so short and long contexts both keep their acceptance.
    Long blocks alone teach positions past the pretraining's length but give the first positions a
    fraction of the updates (the embedded default tuned on 2,048-token blocks alone accepted less at
    32-token prompts)."""
    short_fraction: float = 0.5
    """Share of micro-batches cut into `short_block_size` blocks, spread evenly over the run."""
    max_train_blocks: int | None = None
    """Cap on training blocks (None: all)."""
    max_eval_blocks: int = 64
    """Validation/test blocks used by periodic evaluation."""
    eval_source: str | None = None
    """Where the validation split comes from when not `source` (null: `source`'s own). For a
    `distill-data` file, whose prompts all come from ShareGPT's train split (so it has no
    validation split of its own): `sharegpt` evaluates on ShareGPT's held-out conversations."""
    keep_truncated: bool = False
    """Train on distilled replies the token limit cut too (`distill-data` marks them `truncated`); by
    default they are left out, since they teach the model to stop mid-answer."""
    distill: dict[str, Any] | None = None
    """Generate `source` before training: the model's own replies (`selfspec distill-data`, resumed
    where a previous run stopped), `source` naming the responses.jsonl they go to. A mapping of
    distill-data's options by name, e.g. `{endpoint: http://127.0.0.1:8000/v1, prompts: sharegpt,
    limit: 256}` (no endpoint: in this process); the model is `model.name_or_path`."""

    def __post_init__(self):
        _check_choices(self)
        _check(self.distill is None or Path(self.source).name == "responses.jsonl", "source", self.source,
               "with data.distill it must name the responses.jsonl the replies go to (DIR/responses.jsonl)")
        _check(self.block_size >= 2, "block_size", self.block_size, "it must be >= 2")
        _check(self.short_block_size is None or (self.short_block_size >= 2 and (
               self.block_size <= self.short_block_size or self.block_size % self.short_block_size == 0)),
               "short_block_size", self.short_block_size,
               f"it must be >= 2 and divide block_size ({self.block_size}), or be at least block_size (no "
               "batch is cut), or null")
        _check(0 <= self.short_fraction <= 1, "short_fraction", self.short_fraction, "it must be in [0, 1]")
        _check(self.tokenizer_vocab_size >= 260, "tokenizer_vocab_size", self.tokenizer_vocab_size,
               "it must be >= 260 (256 bytes plus merges and the end-of-text token)")

    @property
    def cut_length(self) -> int | None:
        """The length `short_fraction` of the batches are cut to: `short_block_size` where it is shorter
        than `block_size` and the fraction is above 0, else None (no batch is cut)."""
        short = self.short_block_size
        return short if short is not None and short < self.block_size and self.short_fraction > 0 else None

    @property
    def cache_path(self) -> Path:
        """`cache_dir`, or the user cache directory when it is unset."""
        return Path(self.cache_dir) if self.cache_dir else cache_dir()


@dataclass
class LayerDropoutConfig:
    p_max: float = 0.0
    """Skip probability of the deepest block at full schedule, in [0, 1); recipes use 0.15-0.25."""
    depth_curve: DepthCurve = "exp"
    """D(l): how the rate grows with depth (exp is LayerSkip's e^{l ln2/(N-1)} - 1)."""
    schedule: StepSchedule = "constant"
    """S(t): how the rate evolves over training steps."""
    per_sample: bool = False
    """Drop per row (the block still runs; rows are masked) instead of per batch (the block is
    skipped, which saves its compute)."""
    protect_draft_layers: bool = False
    """Never drop the draft blocks [0, exit_layer)."""

    def __post_init__(self):
        _check_choices(self)
        _check(0.0 <= self.p_max < 1.0, "p_max", self.p_max, "it must be in [0, 1)")


@dataclass
class EarlyExitConfig:
    layers: str | int | list[int] | None = None
    """Candidate exit layers: one layer, a list, a slice "start:stop:step", "2,4,6" or "all"; None
    disables the early-exit losses. Layer l is the output of block l-1 (counted like exit_layer)."""
    kind: ExitLoss = "kl"
    """Loss at each exit: KL to the teacher's distribution, CE to the labels, their sum, or CE to
    the teacher's argmax (argmax: the surrogate of greedy acceptance). Soft CE to the teacher has
    KL's gradient (they differ by the teacher's entropy), so kl serves for both."""
    teacher: Literal["self", "frozen"] = "self"
    """self: the detached final layer of the same forward; frozen: the original model run without
    dropout (under LoRA, the base with adapters disabled)."""
    temperature: float = 1.0
    """Distillation temperature for the KL loss."""
    scale: ExitScale = "uniform"
    """Relative weight of the candidate layers (normalised over the active ones)."""
    weight: float = 1.0
    """Weight of the early-exit term against the final layer's CE loss."""
    curriculum: Curriculum = "none"
    """Which candidates are active at a step."""
    rotation_period: int = 2
    """R for the rotational curriculum: every R-th candidate is active, rotating each step."""
    chunk_size: int = 1024
    """Tokens per chunk when computing exit losses (bounds the (tokens, vocab) logits in memory)."""
    token_fraction: float = 1.0
    """Fraction of positions (random, fresh each step) that get exit losses: each exit costs a
    (tokens, vocab) head pass, so this trades gradient noise for step time."""
    draft_vocab_size: int | None = None
    """V': compute the exit losses over the V' most frequent token ids of the training data plus
    one "other" class holding the rest of the mass (a proper divergence; equal to the full loss at
    V' = V). A head pass then costs V'/V, so every position can get the loss. The checkpoint stores
    V' as the draft head's default, so drafts propose from the ids the exit was trained on. None:
    the whole vocabulary."""
    teacher_top_k: int = 8
    """trainable: adapter with cached features: the teacher is stored as its K most likely tokens per
    position, and the exit loss is the soft CE to their renormalised probabilities (kind kl; argmax
    uses the first only)."""
    final_weight: float = 1.0
    """Weight of the final layer's CE loss. 0 trains on the exit losses alone: the blocks after the
    deepest active exit then run without autograd (with `trainable: draft` nothing behind them
    changes, so this is the cheap recipe; the perplexity gate says whether the full model kept)."""
    skip_forced: bool = False
    """Structured output: the exit losses leave out the reply tokens that the reply's grammar forced
    (chat rows with a `json_schema`, as `selfspec distill-data --prompts json-extract` writes them).
    The engine drafts those for free and never asks the exit for them; the final layer's loss keeps
    every target."""

    def __post_init__(self):
        _check_choices(self)
        _check(self.temperature > 0, "temperature", self.temperature, "it must be > 0")
        _check(self.rotation_period >= 1, "rotation_period", self.rotation_period, "it must be >= 1")
        _check(self.chunk_size >= 1, "chunk_size", self.chunk_size, "it must be >= 1")
        _check(self.weight >= 0, "weight", self.weight, "it must be >= 0")
        _check(0 < self.token_fraction <= 1, "token_fraction", self.token_fraction, "it must be in (0, 1]")
        _check(self.final_weight >= 0, "final_weight", self.final_weight, "it must be >= 0")
        _check(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "draft_vocab_size",
               self.draft_vocab_size, "it must be >= 1, or null for the whole vocabulary")
        _check(self.teacher_top_k >= 1, "teacher_top_k", self.teacher_top_k, "it must be >= 1")

    def layer_list(self, num_layers: int) -> list[int]:
        """The candidate exits `layers` as a sorted list of ints in 1..N-1 (`parse_layers`); [] for None."""
        if self.layers is None:
            return []
        return parse_layers([self.layers] if isinstance(self.layers, int) else self.layers, num_layers)


@dataclass
class LoraSettings:
    enabled: bool = False
    """Train LoRA adapters through peft instead of all weights; merged into the weights on save."""
    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """LoRA scaling numerator."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """Module names that get adapters."""

    def __post_init__(self):
        _check_choices(self)
        _check(self.r >= 1, "r", self.r, "it must be >= 1")
        _check(len(self.target_modules) > 0, "target_modules", self.target_modules,
               "name at least one module")


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    warmup_steps: int = 50
    """Linear warm-up steps before cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor, as a fraction of lr."""
    max_steps: int = 1000
    """Optimizer steps to train."""
    max_minutes: float | None = None
    """Stop early after this wall-clock budget (the schedule still spans max_steps). Off by default:
    budgets are steps, so a run gives the same model on any machine. A model cut short by it is
    saved, but never reused as a cached result of its config."""
    batch_size: int = 16
    """Blocks per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""

    def __post_init__(self):
        _check_choices(self)
        _check(self.lr > 0, "lr", self.lr, "it must be > 0")
        _check(self.max_steps >= 1, "max_steps", self.max_steps, "it must be >= 1")
        _check(self.batch_size >= 1, "batch_size", self.batch_size, "it must be >= 1")
        _check(self.grad_accum >= 1, "grad_accum", self.grad_accum, "it must be >= 1")
        _check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "it must be >= 0")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", self.min_lr_ratio, "it must be in [0, 1]")
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", self.betas,
               "it must be two numbers in [0, 1)")
        _check(self.grad_clip >= 0, "grad_clip", self.grad_clip, "it must be >= 0 (0 disables clipping)")


@dataclass
class RunConfig:
    """One training run: pretraining from scratch or the self-speculative fine-tune."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """What to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """What to train on."""
    layer_dropout: LayerDropoutConfig = field(default_factory=LayerDropoutConfig)
    """Stochastic depth during training."""
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    """Losses at candidate exit layers."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """Parameter-efficient fine-tuning."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    output_dir: str = "runs/finetune"
    """Where checkpoints, logs and the final model go."""
    seed: int = 0
    """Seed for weights init, data order, layer dropout."""
    exit_layer: int | None = None
    """E: the draft runs blocks [0, E). None: `default_exit_layer` (half the depth, rounded down)."""
    trainable: Literal["all", "draft", "adapter"] = "all"
    """Which weights train: all of them; only the draft blocks [0, exit_layer) (the later blocks,
    the final norm, the LM head and the embeddings stay as they are; with LoRA, adapters go on the
    draft blocks only); or `adapter`: none of the model's, only a small exit adapter at exit_layer
    that the draft reads (model/exit_adapter.py), so every output token stays the model's own."""
    adapter_kind: Literal["mlp", "block"] = "mlp"
    """trainable: adapter: a position-wise residual MLP, or a decoder block of the model's own family
    with attention and a KV cache of its own (model/exit_adapter.py)."""
    adapter_size: int | None = None
    """Hidden width H of the exit adapter's MLP (adapter_kind: mlp). None: twice the model's width."""
    adapter_init_layer: int | None = None
    """adapter_kind: block: the model block (0-based) it starts as a copy of. None: the last block,
    whose output the final norm and head were trained on."""
    adapter_blocks: int = 1
    """adapter_kind: block: how many blocks the exit block stacks, copies of the model's blocks
    ending at adapter_init_layer (2: blocks N-2 and N-1 by default). Each adds one block to the
    draft's cost."""
    cache_features: bool = True
    """trainable: adapter: compute the exit's hidden states and the teacher's top K once, before
    training (training/features.py), and train on them every epoch: a step then runs the adapter and
    the head only. false: run the frozen model in every step."""
    num_speculations: int = 4
    """k written into selfspec.json as the default draft length."""
    choose_exit: bool = False
    """After training, pick E among the candidate exits (and k) by the cost model, E(k, α)/(1 + k·c),
    with α the validation agreement at each exit and c the share of the weights its draft reads,
    and write them into selfspec.json instead of exit_layer / num_speculations (the table of every
    candidate goes there too, as exit_choice)."""
    eval_every: int = 100
    """Evaluate on the validation split every this many steps (0: only at the end)."""
    save_every: int = 200
    """accelerate save_state every this many steps (0: never)."""
    log_with: list[str] = field(default_factory=lambda: ["jsonl"])
    """Trackers: any of jsonl (always written), tensorboard, wandb (offline without WANDB_API_KEY)."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """auto: bf16 on GPUs that support it, else fp32."""
    cpu_threads: int | None = None
    """Torch threads per process on CPU. None: the machine's cores split over its processes (plain
    `accelerate launch` would leave one thread per process)."""

    def __post_init__(self):
        _check_choices(self)
        _check(self.exit_layer is None or self.exit_layer >= 1, "exit_layer", self.exit_layer,
               "it must be >= 1 (the number of blocks the draft runs)")
        _check(self.num_speculations >= 0, "num_speculations", self.num_speculations, "it must be >= 0")
        _check(self.eval_every >= 0 and self.save_every >= 0, "eval_every/save_every",
               (self.eval_every, self.save_every), "they must be >= 0")
        _check(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads", self.cpu_threads,
               "it must be >= 1, or null for all cores")
        _check(self.adapter_size is None or self.adapter_size >= 1, "adapter_size", self.adapter_size,
               "it must be >= 1, or null for twice the model's width")
        _check(self.adapter_blocks >= 1, "adapter_blocks", self.adapter_blocks, "it must be >= 1")
        _check(not self.choose_exit or self.early_exit.layers is not None, "choose_exit", self.choose_exit,
               "it picks among the candidate exits: set early_exit.layers, or choose_exit=false")
        if self.trainable == "adapter":
            _check(self.layer_dropout.p_max == 0, "layer_dropout.p_max", self.layer_dropout.p_max,
                   "trainable: adapter trains on the frozen model, which layer dropout would change; "
                   "set it to 0")
            _check(not self.lora.enabled, "lora.enabled", self.lora.enabled,
                   "trainable: adapter keeps every block frozen, so a LoRA on them cannot train; "
                   "set it to false")
            _check(not self.cache_features or self.early_exit.kind in ("kl", "argmax"), "early_exit.kind",
                   self.early_exit.kind, "cached features hold the teacher, not the data's labels: "
                   "use kl or argmax, or cache_features: false")
            _check(not self.cache_features or self.data.cut_length is None, "data.short_block_size",
                   self.data.short_block_size, "cached features were computed over whole blocks, so "
                   "cutting them shorter cannot shorten their context: set it to null (or "
                   "data.short_fraction: 0), or cache_features: false")
        _check(self.model.fp32_master_weights or not (self.mixed_precision == "fp16"
                                                       and self.model.dtype == "float16"),
               "model.fp32_master_weights", self.model.fp32_master_weights,
               "fp16 mixed precision scales the loss, and its scaler cannot unscale float16 "
               "gradients: keep the float32 master weights (true), or use bf16")
        known = {"jsonl", "tensorboard", "wandb"}
        bad = [t for t in self.log_with if t not in known]
        _check(not bad, "log_with", bad, f"choose from {', '.join(sorted(known))}")


# ---------------------------------------------------------------------------------------------------
# Loading, overrides, validation
# ---------------------------------------------------------------------------------------------------

T = typing.TypeVar("T")


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 numbers: `2:8:2` stays a string (YAML 1.1 reads it as the base-60
    integer 7682) and `1e-3` is a float (YAML 1.1 wants `1.0e-3`)."""


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Loader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBER_TAGS]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(0|[1-9][0-9_]*)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$"
               r"|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def load_config(path: str | Path | None, overrides: list[str] = (), schema: type[T] = RunConfig) -> T:
    """Read a YAML file (or start from defaults when None), apply `a.b=value` overrides, validate.

    `path` is a file, or the name of a shipped recipe (`selfspec.recipes`: `demo_finetune`). A file
    may start from another: `base: other.yaml` (a path relative to the file) loads that one first,
    and this file's fields replace its fields, section by section.
    """
    data = _read_yaml(_recipe_file(path)) if path is not None else {}
    for item in overrides:
        _apply_override(data, item)
    return from_dict(schema, data)


def _recipe_file(path: str | Path) -> Path:
    """The YAML file `--config` names: a path, or a shipped recipe's name."""
    found = recipes.find(path)
    if found is None:
        near = recipes.closest(str(path))
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        raise ConfigError(f"config {str(path)!r} is neither a file nor a shipped recipe{hint}; pass a YAML "
                          f"file, or a name that `selfspec recipes` lists")
    return found


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The mapping in a YAML config file, its `base:` chain merged in."""
    if not path.is_file():
        where = f" (the base of {str(seen[-1])!r})" if seen else ""
        raise ConfigError(f"config file {str(path)!r}{where} does not exist; "
                          f"pass an existing YAML file to --config")
    if path.resolve() in seen:
        chain = " -> ".join(map(str, seen))
        raise ConfigError(f"config file {str(path)!r} is its own base (through {chain}); "
                          f"remove the loop of base: fields")
    try:
        data = _yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of fields at the top level")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"base in {str(path)!r} must be a path to another YAML file, got {base!r}")
    return _merge(_read_yaml(path.parent / base, (*seen, path.resolve())), data)


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`: sections merge field by field, any other value replaces."""
    merged = dict(base)
    for key, value in top.items():
        both_sections = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merge(base[key], value) if both_sections else value
    return merged


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.field=value, e.g. optim.lr=1e-4")
    # YAML parses the value: numbers, booleans, null and [lists] come out typed.
    value = _yaml(raw) if raw.strip() else ""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
    node[parts[-1]] = value


def from_dict(schema: type[T], data: dict, prefix: str = "") -> T:
    """Build dataclass `schema` from a nested mapping, checking keys and value types."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key {name!r}{hint}")
        kwargs[key] = _coerce(hints[key], value, name)
    try:
        return schema(**kwargs)  # its __post_init__ checks the ranges that types alone cannot express
    except FieldError as exc:
        raise exc.within(prefix) from None


def _coerce(hint: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a section (a mapping of fields), got {value!r}")
        return from_dict(hint, value, prefix=f"{name}.")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, name)
            except ConfigError:
                pass
        allowed = " or ".join(_describe(o) for o in options)
        raise ConfigError(f"{name} = {value!r} is not allowed; expected {allowed}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{name} = {value!r} is not allowed; "
                              f"choose one of {', '.join(map(repr, allowed))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping of names to values, got {value!r}")
        return dict(value)
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list of {_describe(item_hint)}, got {value!r}")
        return [_coerce(item_hint, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise ConfigError(f"{name} = {value!r} is not allowed; expected {_describe(hint)}")


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if typing.get_origin(hint) is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if hint is type(None):
        return "null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(hint, str(hint))


# ---------------------------------------------------------------------------------------------------
# Layer lists (early_exit.layers, --exit-layers)
# ---------------------------------------------------------------------------------------------------

def check_layer(layer: object, num_layers: int, top: int) -> int:
    """`layer` when it is an int in [1, top]; a UserError naming the allowed range otherwise."""
    # bool is an int subclass; True as a layer is a config mistake, not layer 1.
    if not isinstance(layer, int) or isinstance(layer, bool) or not 1 <= layer <= top:
        raise UserError(
            f"early-exit layer must be an int in [1, {top}] (num_layers={num_layers}), got {layer!r}"
        )
    return layer


def parse_layers(spec: str | Sequence[int], num_layers: int) -> list[int]:
    """Parse the early-exit candidate layers into a sorted list of unique ints in 1..N-1.

    ``spec`` is a sequence of ints, or a string:

    - ``"all"``: every candidate 1..N-1;
    - a slice ``"start:stop:step"``: ``range(start, stop, step)``, where a missing start means 1, a
      missing stop means N (exclusive: the final layer N has its own loss) and a missing step 1,
      e.g. ``"::2"`` with N = 8 gives [1, 3, 5, 7] and ``"4:"`` gives [4, 5, 6, 7];
    - a comma list ``"2,4,6"`` (a single ``"3"`` too).

    Raises UserError naming the bad value and the allowed range, or when nothing is selected.
    """
    if num_layers < 2:
        raise UserError(f"num_layers must be >= 2 to have early-exit candidates, got {num_layers}")
    top = num_layers - 1
    if isinstance(spec, str):
        text = spec.strip()
        if text == "all":
            layers: list[object] = list(range(1, num_layers))
        elif ":" in text:
            parts = [p.strip() for p in text.split(":")]
            if len(parts) > 3:
                raise UserError(f"early-exit layer slice must be 'start:stop:step', got {spec!r}")
            parts += [""] * (3 - len(parts))
            try:
                start, stop, step = (
                    int(p) if p else d for p, d in zip(parts, (1, num_layers, 1), strict=True)
                )
            except ValueError:
                raise UserError(
                    f"early-exit layer slice must hold ints as 'start:stop:step', got {spec!r}"
                ) from None
            if step == 0:
                raise UserError(f"early-exit layer slice step must be non-zero, got {spec!r}")
            layers = list(range(start, stop, step))
        else:
            layers = []
            for token in text.split(","):
                try:
                    layers.append(int(token.strip()))
                except ValueError:
                    raise UserError(f"early-exit layer must be an int in [1, {top}] "
                                    f"(num_layers={num_layers}), got {token.strip()!r}") from None
    else:
        layers = list(spec)
    result = sorted({check_layer(layer, num_layers, top) for layer in layers})
    if not result:
        raise UserError(
            f"early-exit layers {spec!r} select no layer in [1, {top}] (num_layers={num_layers})"
        )
    return result


def default_exit_layer(num_layers: int) -> int:
    """E when a config leaves `exit_layer` unset: half the depth, rounded down (at least 1)."""
    return max(1, num_layers // 2)


def to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (for selfspec.json and trackers)."""
    return dataclasses.asdict(cfg)
