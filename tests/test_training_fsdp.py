"""FSDP on CPU: 2 sharded processes equal 1 plain process at the same global batch, under layer dropout.

accelerate 1.15 cannot shard on a CPU (`accelerate/state.py`, `AcceleratorState.__init__` keeps a FSDP
plugin only for MULTI_GPU-like device types; CPU processes are MULTI_CPU, which is plain DDP: see
docs/scaling.md), so `tests/fsdp_train.py` applies torch's `fully_shard` itself to the loop's own
objective, one FSDP unit per decoder block as `selfspec/recipes/accelerate/fsdp.yaml` asks; the frozen teacher
(`early_exit.teacher: frozen`) goes through the loop's own `place_teacher`, which shards it the same way.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training_loop import free_port

from selfspec import load_tuned
from selfspec.checkpoint import read_meta

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "fsdp_train.py"
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
