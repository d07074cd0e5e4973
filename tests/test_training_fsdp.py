"""FSDP on CPU: 2 sharded processes equal 1 plain process at the same global batch, under layer dropout.

accelerate 1.16 does not shard on a CPU (`accelerate/state.py`, `AcceleratorState.__init__` keeps a FSDP
plugin only for MULTI_GPU-like device types; CPU processes are MULTI_CPU, which is plain DDP: see
docs/scaling.md). Two ways around it, both on gloo:
- `selfspec train` itself under `accelerate launch --config_file fsdp.yaml`, through
  `tests/accelerate_cpu.py`, which keeps accelerate's FSDP plugin on CPUs (the test harness only): the
  loop's `prepare`, clipping, evaluation, state and saving as on GPUs;
- `tests/fsdp_train.py`, which applies torch's `fully_shard` itself to the loop's own objective, one
  FSDP unit per decoder block as `configs/accelerate/fsdp.yaml` asks, and reports what each
  process holds of the frozen teacher (`early_exit.teacher: frozen`, sharded by the loop's own
  `place_teacher`).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training_loop import free_port

from selfspec import load_tuned
from selfspec.checkpoint import read_meta
from selfspec.recipes import find

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "fsdp_train.py"
LAUNCHED = REPO / "tests" / "accelerate_cpu.py"  # `python -m selfspec`, accelerate's FSDP kept on CPUs
FROZEN = "early_exit.teacher=frozen"  # the recipe's teacher is `self`: a frozen copy is what FSDP must shard


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _torchrun(*args) -> None:
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
          "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER), *map(str, args)])


@pytest.mark.slow
def test_two_fsdp_processes_equal_one_plain_process_and_resume_bit_for_bit(tiny_run, tmp_path):
    """Rank 1 is even given another seed: `LayerDropout.synchronize` makes it skip rank 0's blocks. The
    exits learn from a frozen teacher, which each process holds one shard of (its parameter elements
    sum to the teacher's, 28,816 of 57,632 each) and whose logits are the unsharded teacher's bits.

    Tolerance: losses within rel 1e-5, final weights within atol 1e-5; the resume from the sharded state
    at step 2 ends on the uninterrupted run's bits. The plain run sums its gradient as the 2 processes
    do (`fsdp_train._plain_step`), so on one CPU the two agree to the bit. A backward over all 4 rows
    at once rounded otherwise, and AdamW's lr * g / (|g| + eps) made a 1e-10 rounding difference in a
    gradient near eps 1.4e-5 in a weight on AVX-512 kernels (4 data seeds of 10 past 1e-5).
    """
    model = tiny_run["model"]
    plain, sharded, resumed = tmp_path / "plain", tmp_path / "fsdp", tmp_path / "resumed"
    _run([sys.executable, str(WORKER), str(model), str(plain), "--plain", FROZEN])
    _torchrun(model, sharded, "--save-at", 2, "--seed-per-rank", FROZEN)

    one = json.loads((plain / "losses.json").read_text())
    two = json.loads((sharded / "losses.json").read_text())
    assert sorted(one) == sorted(two) == ["1", "2", "3", "4"]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step

    # Every rank ran the blocks the plain process ran, and layer dropout did skip some.
    ran = json.loads((plain / "blocks-0.json").read_text())
    for rank in (0, 1):
        assert json.loads((sharded / f"blocks-{rank}.json").read_text()) == ran, rank
    assert any(len(blocks) < 4 for blocks in ran.values()), ran

    # The frozen teacher is sharded like the student, its forwards done: each process holds only its
    # shard, and its logits are the whole teacher's to the bit.
    whole = json.loads((plain / "teacher-0.json").read_text())
    assert not whole["sharded"] and whole["local_elements"] == whole["total_elements"]
    shards = [json.loads((sharded / f"teacher-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(s["sharded"] and s["logits_equal"] for s in shards), shards
    assert all(s["total_elements"] == whole["total_elements"] for s in shards), shards
    assert sum(s["local_elements"] for s in shards) == whole["total_elements"], shards
    assert all(s["local_elements"] < whole["total_elements"] for s in shards), shards

    reference = load_file(plain / "model" / "model.safetensors")
    start = load_file(model / "model.safetensors")
    assert max(float((reference[n] - start[n]).abs().max()) for n in reference) > 100 * 1e-5  # it trained
    full = load_file(sharded / "model" / "model.safetensors")  # gathered from the shards: every tensor
    assert set(full) == set(reference)
    for name, value in full.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)
    assert read_meta(sharded / "model")["metrics"]["processes"] == 2
    generator = load_tuned(sharded / "model", device="cpu")
    assert generator.settings.exit_layer == 2

    # Resume from the sharded state at step 2 (each rank reads its shards): the same bits at step 4.
    resumed.mkdir()
    (resumed / "state-2").symlink_to(sharded / "state-2", target_is_directory=True)
    _torchrun(model, resumed, "--resume-at", 2, "--seed-per-rank", FROZEN)
    assert sorted(json.loads((resumed / "losses.json").read_text())) == ["3", "4"]
    again = load_file(resumed / "model" / "model.safetensors")
    for name, value in full.items():
        assert torch.equal(again[name], value), name


# `optim.grad_clip` 0.1 bites on every step (the gradients' norms are 0.3 to 1.1): a clip that
# missed the parameters would show in the weights; every other batch cut into 8-token blocks, as the
# recipe cuts its 2,048-token blocks into 256
LOOP = ["data.block_size=32", "data.short_block_size=8", "data.max_eval_blocks=4", "optim.max_steps=4",
        "optim.warmup_steps=1", "optim.grad_clip=0.1", "early_exit.layers=2:4",
        "early_exit.token_fraction=1.0", "layer_dropout.p_max=0.3", "layer_dropout.per_sample=false",
        "exit_layer=2", "eval_every=2", "save_every=2", "log_with=[jsonl]"]


def _selfspec_train(out: Path, processes: int, data: list[str], *extra: str, resume: bool = False,
                    launch: str = "fsdp") -> None:
    """`selfspec train --config demo_finetune` on one plain process, or as `accelerate launch
    --config_file <launch>.yaml -m selfspec train` on `processes` gloo processes, at a global batch of 4."""
    args = ["train", "--config", "demo_finetune", *data, *LOOP, f"optim.batch_size={4 // processes}",
            f"output_dir={out}", *extra, *(["--resume"] if resume else [])]
    if processes == 1:
        _run([sys.executable, "-m", "selfspec", *args])
        return
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          str(find(f"accelerate/{launch}")), "--num_processes", str(processes), "--mixed_precision", "no",
          "--main_process_port", str(free_port()), str(LAUNCHED), *args])


def _curve(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], key): r[key] for r in rows for key in ("loss", "grad_norm", "val/loss") if key in r}


def _tied_copy(model_dir: Path, out: Path) -> Path:
    """`model_dir`'s model with its head tied to its embedding (as every real target ties: Llama-3.2,
    SmolLM2, Qwen2.5, the embedded default), saved into `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, tie_word_embeddings=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("launch, trainable", [
    ("fsdp", ["early_exit.teacher=frozen"]),  # every weight, and a frozen teacher sharded like the student
    ("fsdp", ["tied"]),  # a tied head and embedding, through accelerate's meta-device loading
    ("fsdp", ["lora.enabled=true"]),
    ("fsdp", ["trainable=draft"]),  # blocks [0, E) only
    # no block skipped: ZeRO-2's flat partitions give a skipped block a zero gradient, which AdamW's
    # momentum then moves, where torch's AdamW leaves a parameter without gradient alone (docs/scaling.md)
    ("zero2", ["layer_dropout.p_max=0"]),
], ids=["fsdp-full", "fsdp-tied", "fsdp-lora", "fsdp-draft", "zero2-full"])
def test_selfspec_train_sharded_through_accelerate_equals_one_process_and_resumes_bit_for_bit(
        tiny_run, tmp_path, launch, trainable):
    """`accelerate launch --config_file fsdp.yaml -m selfspec train` (and zero2.yaml, where DeepSpeed is
    installed: `pip install 'selfspec[deepspeed]'`) on 2 CPU processes: accelerate's FSDP2 shards the
    objective, DeepSpeed ZeRO-2 its optimizer state (each process writes its own shard of the state),
    and the run equals one plain process at the same global batch: losses, clipped gradient norms and
    validation losses within rel 1e-5, the saved weights (LoRA merged) within atol 1e-5. Its state at
    step 2, resumed on 2 processes, ends on the uninterrupted run's bits.

    The loop used to clip the parameter list it collected before `prepare`, which FSDP2 replaces: a
    full fine-tune then raised in accelerate's `clip_grad_norm_` (an `eq` of a Tensor and a DTensor)
    and LoRA and `trainable: draft` clipped nothing (a norm of 0); its evaluation read the root unit's
    weights past FSDP (an embedding of a DTensor), and LoRA's merge on the main process alone waited
    for the other ranks' all-gathers."""
    if launch == "zero2" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'selfspec[deepspeed]')")
    model = tiny_run["model"]
    if trainable == ["tied"]:
        model, trainable = _tied_copy(model, tmp_path / "tied"), []
    data = [f"model.name_or_path={model}", f"data.source={tiny_run['corpus']}",
            f"data.cache_dir={tmp_path}/cache"]
    plain, sharded, resumed = tmp_path / "plain", tmp_path / "sharded", tmp_path / "resumed"
    _selfspec_train(plain, 1, data, *trainable)
    _selfspec_train(sharded, 2, data, *trainable, launch=launch)
    state = sharded / "state" / "step-00000002"
    shards = ([p.name for p in (state / "pytorch_model_fsdp_0").glob("*.distcp")] if launch == "fsdp"
              else [p.name for p in (state / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt")])
    assert len(shards) == 2, shards  # one per process
    assert read_meta(sharded / "model")["metrics"]["processes"] == 2

    one, two = _curve(plain), _curve(sharded)
    assert set(one) == set(two) and {(s, "grad_norm") for s in (1, 2, 3, 4)} <= set(one)
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    reference, start = (load_file(d / "model.safetensors") for d in (plain / "model", model))
    assert max(float((reference[n] - start[n]).abs().max()) for n in reference) > 100 * 1e-5  # it trained
    full = load_file(sharded / "model" / "model.safetensors")
    assert set(full) == set(reference)  # a tied head saves no weight of its own, sharded or not
    for name, value in full.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)

    shutil.copytree(sharded, resumed, ignore=shutil.ignore_patterns("model"))
    (resumed / "metrics.jsonl").write_text("")
    _selfspec_train(resumed, 2, data, *trainable, resume=True, launch=launch)
    assert {k for k in _curve(resumed) if k[1] == "loss"} == {(3, "loss"), (4, "loss")}
    again = load_file(resumed / "model" / "model.safetensors")
    for name, value in full.items():
        assert torch.equal(again[name], value), name
