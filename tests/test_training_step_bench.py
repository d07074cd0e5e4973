"""tools/benchmark_training_step.py on the tiny model: both variants, LoRA included, in a few seconds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from selfspec.config import load_config
from selfspec.evaluation.train_cost import time_variants

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("benchmark_training_step",
                                                  REPO / "tools" / "benchmark_training_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overrides(tiny_run, out, *extra):
    return [f"model.name_or_path={tiny_run['model']}", "data.block_size=16", "optim.batch_size=2",
            "exit_layer=2", "early_exit.layers=1:4", f"output_dir={out}", *extra]


def test_lora_config_times_both_variants_and_writes_the_report(script, tiny_run, tmp_path, monkeypatch):
    # The memory figures come from fresh processes; here a stand-in, so that the test stays in-process.
    monkeypatch.setattr(script, "peak_memory_subprocess", lambda path, args, variant: 1 << 20)
    argv = ["--config", "demo_finetune", "--repeats", "1", "--warmup", "1",
            *overrides(tiny_run, tmp_path, "lora.enabled=true", "lora.r=4")]
    result = script.main(argv)
    assert result["time_ratio"] > 0 and result["memory_ratio"] == 1.0 and result["lora"]["r"] == 4
    assert json.loads((tmp_path / "train_cost.json").read_text())["batch"] == [2, 16]


def test_the_lora_model_trains_only_its_adapters(script, tiny_run, tmp_path, capsys):
    cfg = load_config(None, overrides(tiny_run, tmp_path, "lora.enabled=true", "trainable=draft",
                                      "early_exit.draft_vocab_size=64"))
    model = script.load_model(cfg, "cpu")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    # trainable: draft puts the adapters on the draft blocks [0, exit_layer) only
    assert trainable and all("lora_" in n and (".layers.0." in n or ".layers.1." in n) for n in trainable)
    batch = script.random_batch(model, cfg, "cpu")
    timing = time_variants(model, cfg, batch, repeats=1, warmup=0)  # the trimmed exit loss too
    assert timing["plain_s"] > 0 and timing["selfspec_s"] > 0
    # the probe each memory process runs (its figure means something only in a fresh process)
    script.main(["--config", "demo_finetune", "--measure-memory", "selfspec",
                 *overrides(tiny_run, tmp_path, "lora.enabled=true")])
    assert isinstance(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak_bytes"], int)
