"""Training in 16 bits: float32 master weights under bf16 autocast keep a small learning rate's steps,
the checkpoint is saved at the model's dtype, LoRA trains float32 adapters on the 16-bit base, and
activation checkpointing changes nothing but memory."""

import json
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from helpers import tiny_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from selfspec.config import load_config
from selfspec.errors import UserError
from selfspec.training import loop
from selfspec.training.loop import train


@pytest.fixture(autouse=True)
def own_mixed_precision():
    """A process's accelerate state keeps the first mixed precision it was given: these tests run bf16
    on the CPU, the others fp32."""
    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


@pytest.fixture(scope="module")
def bf16_base(tiny_run, tmp_path_factory):
    """The tiny run's 4-layer Llama stored in bf16, as the GPU recipes' checkpoints are: every weight
    is a bf16 value (Hugging Face's init, std 0.02, the magnitude of real models' weights)."""
    path = tmp_path_factory.mktemp("bf16_base") / "model"
    tokenizer = tiny_run["tokenizer"]
    model = tiny_model("llama", num_layers=4, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def gpu_recipe_config(tiny_run, base, out, *extra):
    """gpu_common.yaml's precision and learning rate (bf16 weights, bf16 autocast, lr 2e-5, no
    warm-up) on the tiny model, every weight training."""
    return load_config(None, [
        f"model.name_or_path={base}", f"data.source={tiny_run['corpus']}", f"data.cache_dir={out}/cache",
        "data.block_size=32", "data.max_eval_blocks=4", "optim.batch_size=4", "optim.max_steps=20",
        "optim.warmup_steps=0", "optim.lr=2e-5", "model.dtype=bfloat16", "mixed_precision=bf16",
        "early_exit.layers=2", "early_exit.teacher=self", "eval_every=0", "save_every=0", "exit_layer=2",
        f"output_dir={out}", *extra])


def changed_share(base: Path, tuned: Path, matrices: bool = False) -> float:
    """The share of the weights' elements whose saved (bf16) value differs from the base's; matrices:
    of the blocks' matrices and the LM head only, which every step trains everywhere (an embedding
    row trains only when its token is in the batch; a norm's weights sit at 1.0, where 20 steps of
    2e-5 stay under half a bf16 spacing whatever trains them)."""
    before = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).state_dict()
    after = AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.bfloat16).state_dict()
    names = [k for k in before if not matrices or (before[k].dim() == 2 and "embed" not in k)]
    changed = sum(int((before[k] != after[k]).sum()) for k in names)
    return changed / sum(before[k].numel() for k in names)


def saved_dtypes(model_dir: Path) -> set:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {f.get_slice(name).get_dtype() for name in f.keys()}


def test_a_bf16_run_at_the_gpu_recipes_lr_keeps_its_updates_in_fp32_master_weights(tiny_run, bf16_base,
                                                                                    tmp_path):
    """20 steps of lr 2e-5 move a bf16 weight by less than half its spacing each (|w| > 0.008):
    trained in bf16 itself the steps round away (on the embedded default 16.3 % of the weights moved),
    in float32 master weights they add up as in float32 training, and the saved bf16 checkpoint
    differs from the base almost everywhere. One batch, seen every step: the gradient's direction
    holds from step to step, as a real model's does over a few steps, so the steps add up."""
    one_batch = "data.max_train_blocks=4"
    result = train(gpu_recipe_config(tiny_run, bf16_base, tmp_path / "master", one_batch), progress=False)
    assert saved_dtypes(result.model_dir) == {"BF16"}
    assert json.loads((result.model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    share = changed_share(bf16_base, result.model_dir, matrices=True)
    # the old behaviour, which stays behind the switch: most steps are lost
    plain = train(gpu_recipe_config(tiny_run, bf16_base, tmp_path / "plain", one_batch,
                                    "model.fp32_master_weights=false"), progress=False)
    assert saved_dtypes(plain.model_dir) == {"BF16"}
    plain_share = changed_share(bf16_base, plain.model_dir, matrices=True)
    assert share >= 0.9 and plain_share < 0.5, (share, plain_share)
    # float32 training of the same weights, rounded to bf16 at the end: the same share, all weights
    AcceleratorState._reset_state()  # a process keeps its first mixed precision otherwise
    fp32 = train(gpu_recipe_config(tiny_run, bf16_base, tmp_path / "fp32", one_batch, "model.dtype=float32",
                                   "mixed_precision='no'"), progress=False)
    assert changed_share(bf16_base, result.model_dir) == pytest.approx(
        changed_share(bf16_base, fp32.model_dir), abs=0.02)


def bytes_per_parameter(setup: "loop._Run") -> dict:
    """Bytes per parameter after one step, as `_setup` built the run: the trained parameters with
    their gradients and AdamW's states, per trained parameter; the frozen ones (a LoRA's base) and
    the frozen teacher, per model parameter."""
    objective = loop.objective_inner(setup.objective)
    trained = setup.trainable
    frozen = [p for p in objective.model.parameters() if not p.requires_grad]
    teacher = [] if objective.frozen_model is None else list(objective.frozen_model.parameters())
    states = [t for state in setup.optimizer.state.values() for t in state.values()
              if torch.is_tensor(t) and t.dim() > 0]

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    n_trained = sum(p.numel() for p in trained)
    n_model = n_trained + sum(p.numel() for p in frozen)
    return {"weights": size(trained) / n_trained, "gradients": size(p.grad for p in trained) / n_trained,
            "optimizer": size(states) / n_trained, "frozen": size(frozen) / n_model,
            "teacher": size(teacher) / n_model, "trained_share": n_trained / n_model}


@pytest.mark.parametrize("mode, extra, expected", [
    ("fp32 master", [], {"weights": 4, "gradients": 4, "optimizer": 8, "frozen": 0, "teacher": 2}),
    ("pure bf16", ["model.fp32_master_weights=false"],
     {"weights": 2, "gradients": 2, "optimizer": 4, "frozen": 0, "teacher": 2}),
    ("lora", ["lora.enabled=true", "lora.r=4"],
     {"weights": 4, "gradients": 4, "optimizer": 8, "teacher": 0}),
])
def test_memory_per_parameter_of_each_precision_mode(tiny_run, bf16_base, tmp_path, mode, extra, expected):
    """What each mode holds (docs/scaling.md's table): per trained parameter, float32 master weights
    4 + 4 + 8 bytes, bf16 weights 2 + 2 + 4, LoRA's float32 adapters 4 + 4 + 8; per model parameter,
    a bf16 frozen teacher (2) for a full fine-tune, none under LoRA, whose bf16 base (2) is its
    teacher."""
    cfg = gpu_recipe_config(tiny_run, bf16_base, tmp_path, "optim.max_steps=1", "early_exit.teacher=frozen",
                            *extra)
    setup = loop._setup(cfg, tmp_path)
    try:
        stream = setup.batches()
        loop._train_step(setup, stream)  # AdamW's states exist after a step
        out = setup.objective(**next(stream), step=1)
        setup.accelerator.backward(out["loss"])  # the gradients, which a step sets to None at its end
        measured = bytes_per_parameter(setup)
    finally:
        setup.accelerator.end_training()
    for key, value in expected.items():
        assert measured[key] == pytest.approx(value, abs=1e-9), (mode, measured)
    if mode == "lora":  # the base: bf16, all but the adapters' share
        assert measured["frozen"] == pytest.approx(2 * (1 - measured["trained_share"]))
    else:
        assert measured["trained_share"] == 1


def test_lora_on_a_bf16_base_saves_its_merged_weights_in_bf16(tiny_run, bf16_base, tmp_path):
    result = train(gpu_recipe_config(tiny_run, bf16_base, tmp_path, "lora.enabled=true", "lora.r=4",
                                     "optim.max_steps=2", "early_exit.teacher=frozen", "optim.lr=1e-2"),
                   progress=False)
    assert saved_dtypes(result.model_dir) == {"BF16"}
    assert changed_share(bf16_base, result.model_dir) > 0


def test_fp16_without_master_weights_is_refused_in_one_line():
    with pytest.raises(UserError, match="model.fp32_master_weights = False is not allowed; fp16"):
        load_config(None, ["model.dtype=float16", "mixed_precision=fp16", "model.fp32_master_weights=false"])


def test_activation_checkpointing_recomputes_the_blocks_and_gives_the_same_losses(tiny_run, tmp_path):
    """fp32, layer dropout and exit losses on: the same losses step by step with and without it (layer
    dropout draws outside the blocks, so a recomputed block runs as it ran), and the blocks really
    are run again in the backward."""
    def run(out, *extra):
        cfg = load_config(None, [
            f"model.name_or_path={tiny_run['model']}", f"data.source={tiny_run['corpus']}",
            f"data.cache_dir={out}/cache", "data.block_size=32", "data.max_eval_blocks=4",
            "optim.batch_size=4", "optim.max_steps=3", "optim.warmup_steps=1", f"output_dir={out}",
            "early_exit.layers=all", "layer_dropout.p_max=0.3", "layer_dropout.per_sample=true",
            "early_exit.teacher=frozen", "eval_every=0", "save_every=0", "exit_layer=2", *extra])
        setup = loop._setup(cfg, Path(out))
        calls = []
        model = loop.objective_inner(setup.objective).model
        # a pre-hook: the recompute stops as soon as it has what the backward needs, before the
        # MLP returns
        hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
        stream = setup.batches()
        setup.objective.train()
        try:
            losses = [loop._train_step(setup, stream)["loss"] for _ in range(3)]
        finally:
            hook.remove()
            setup.accelerator.end_training()
        return losses, len(calls), model

    plain, plain_calls, _ = run(tmp_path / "plain")
    checkpointed, calls, model = run(tmp_path / "checkpointed", "model.gradient_checkpointing=true")
    assert checkpointed == pytest.approx(plain, rel=1e-5)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    # block 0 is never dropped (the depth curve starts at 0): one forward per micro-batch, and with
    # checkpointing one more in each backward
    assert plain_calls == 3 and calls == 6


def test_fsdp_reduces_gradients_in_fp32_under_bf16_mixed_precision():
    """accelerate's FSDP2 policy for `mixed_precision: bf16` (the fsdp.yaml recipe) reduces gradients in
    bf16; the loop keeps the passes in bf16 and moves the reduction to fp32, and leaves a policy without
    mixed precision (and no plugin) alone."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16  # accelerate's own choice
    loop.reduce_gradients_in_fp32(plugin)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    plain = FullyShardedDataParallelPlugin(fsdp_version=2)
    loop.reduce_gradients_in_fp32(plain)
    loop.reduce_gradients_in_fp32(None)
    assert plain.mixed_precision_policy is None


@pytest.mark.parametrize("tied", [True, False])
def test_the_objective_hands_accelerate_the_models_tie_and_embeddings(tied):
    """accelerate's FSDP2 preparation re-ties a head that its meta-device loading untied through the
    prepared module's `tie_weights`, and shards the embeddings it names: the objective's are the model's."""
    from selfspec.training.objective import SelfSpecObjective

    model = tiny_model("llama", tie_word_embeddings=tied)
    model.tie_weights()
    objective = SelfSpecObjective(model)
    assert objective.get_input_embeddings() is model.get_input_embeddings()
    assert objective.get_output_embeddings() is model.get_output_embeddings()
    objective.to(torch.device("meta"))  # what accelerate does to every rank's module before sharding
    objective.to_empty(device="cpu")
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied by the move
    objective.tie_weights()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
