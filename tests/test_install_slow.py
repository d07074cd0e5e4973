"""The installed wheel, as a newcomer gets it: `pip install .` (not editable) into a fresh virtual
environment, then from an empty directory a tiny pretrain, fine-tune, gate, sweep and generate, and a
plain Hugging Face directory decoded with copies.

Slow (minutes): run with `python -m pytest -m slow`. The environment sees the packages of the one the
tests run in (torch, transformers, pip, setuptools and wheel: the `dev` extra), so nothing is downloaded;
selfspec itself comes only from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TINY = ["model.arch.num_layers=4", "optim.batch_size=4", "data.max_eval_blocks=4", "eval_every=0",
        "save_every=0", "log_with=[jsonl]"]


def _outputs(folder: str, names: list[str]) -> set[str]:
    """What `shutil.copytree` leaves out of the source's copy: the checkout's outputs (runs, build and
    wandb at its root, data/generated) and caches anywhere."""
    root, data = Path(folder) == REPO, Path(folder) == REPO / "data"
    return {n for n in names if n in (".git", "__pycache__") or n.endswith(".egg-info")
            or (root and n in ("runs", "build", "wandb")) or (data and n == "generated")}


def test_the_wheel_trains_and_generates_from_an_empty_directory(tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    # without a pip of its own: the tests' environment's pip, setuptools and wheel install into it. That
    # environment's packages by a path file, not `--system-site-packages` (the interpreter's own, which a
    # fresh machine's tests' venv does not install into); its .pth files are not read, so its editable
    # selfspec is not seen
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_packages = next((venv / "lib").glob("python*/site-packages"))
    (site_packages / "tests-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python, selfspec = venv / "bin" / "python", venv / "bin" / "selfspec"
    # A copy of the source: pip builds in the tree, and a stale build/ there could leak into the wheel.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=_outputs)
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              str(source)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    work.mkdir()

    def run(*argv):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        proc = subprocess.run([str(a) for a in argv], cwd=work, capture_output=True, text=True, timeout=900,
                              env=env)
        assert proc.returncode == 0, (argv, proc.stderr[-3000:])
        return proc.stdout

    where = run(python, "-c", "import selfspec; print(selfspec.__file__)")
    assert Path(where.strip()).is_relative_to(venv)  # the wheel's copy, not the checkout
    # every config of the checkout's configs/ ships inside the package, found from an empty directory
    listed = run(selfspec, "recipes")
    configs = REPO / "configs"
    assert all(p.relative_to(configs).with_suffix("").as_posix() in listed for p in configs.rglob("*.yaml"))
    assert run(selfspec, "recipes", "--path", "accelerate/fsdp").strip().startswith(str(venv))
    run(selfspec, "pretrain", "--config", "embedded_base", *TINY, "optim.max_steps=4", "--output-dir",
        "runs/base")
    run(selfspec, "train", "--config", "demo_finetune", "model.name_or_path=runs/base/model",
        "early_exit.layers=1:4", "exit_layer=2", *TINY, "optim.max_steps=3", "--output-dir", "runs/tuned")
    run(selfspec, "eval", "gate", "--tuned", "runs/tuned/model", "--base", "runs/base/model",
        "--max-increase", "10", "--max-blocks", "4")  # a 3-step tune moves far: the gate runs, loosely
    run(selfspec, "eval", "sweep", "--model", "runs/tuned/model", "--exit-layers", "2", "--ks", "2",
        "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--confirm", "0", "--write-back",
        "--out", "runs/sweep")
    text = run(selfspec, "generate", "runs/tuned/model", "def f(x):", "--max-new-tokens", "8", "--no-stream")
    assert text.strip()
    # a plain Hugging Face directory (no selfspec.json) decodes with copies
    plain = work / "runs" / "plain"
    shutil.copytree(work / "runs" / "base" / "model", plain)
    (plain / "selfspec.json").unlink()
    assert run(selfspec, "generate", str(plain), "def f(x):", "--max-new-tokens", "8", "--no-stream").strip()
    assert sorted(p.name for p in work.iterdir()) == ["runs"]  # nothing else lands in the directory
    assert sorted(p.name for p in (work / "runs").iterdir()) == ["base", "plain", "sweep", "tuned"]
