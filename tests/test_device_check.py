"""tools/device_check.py, the check a lent GPU runs, dry-run here at tiny sizes on the emulated CUDA device
(`virtual_cuda`): every stage's code runs and writes its verdicts, so the one call a GPU gets is not
spent on a typo. The numbers are the emulation's (no timing is asserted); the verdicts are real."""

import importlib.util
import sys
from pathlib import Path

import pytest
from virtual_cuda import VirtualCuda

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("device_check", ROOT / "tools" / "device_check.py")
device_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_check)


def _verdicts(out: Path, stage: str) -> list[str]:
    return [line for line in (out / "verdicts.txt").read_text().splitlines() if line.startswith(stage)]


def test_the_decoding_stages_dry_run_on_the_emulated_device(tmp_path):
    with VirtualCuda() as device:
        check = device_check.Check(tmp_path, tiny=True, move=device.module)
        assert check.device == "cuda" and not check.real_cuda
        for stage in ("env", "lossless", "shapes", "graphs"):
            device_check.STAGE_FUNCTIONS[stage](check)
    lossless = _verdicts(tmp_path, "lossless")
    assert [line.split()[1] for line in lossless] == [f"{f}:" for f in device_check.FAMILIES]
    assert all("NOT" not in line for line in lossless) and all("static graph: lossless" in line
                                                               for line in lossless[:4])
    assert all("a changing batch lossless, 0 captures when it repeats" in line for line in lossless[:4])
    assert all("sampled equal to the passes as written" in line for line in lossless[:4])
    assert len(_verdicts(tmp_path, "shapes")) == 3
    graphs = _verdicts(tmp_path, "graphs")
    assert len(graphs) == 1 and "k=4 lossless" in graphs[0]
    assert "emulated CUDA device" in _verdicts(tmp_path, "env")[0]


@pytest.mark.slow
def test_the_embedded_stage_dry_runs_pretraining_the_exit_and_decoding(tmp_path):
    """Pretrain, the GPU recipes' 20 steps (here 4), the fine-tune and three decoding paths, tiny, on the
    CPU (accelerate's training loop does not run on the emulated device)."""
    device_check.stage_embedded(device_check.Check(tmp_path, tiny=True, device="cpu"))
    lines = _verdicts(tmp_path, "embedded")
    assert len(lines) == 6 and sum("lossless against its own plain" in line for line in lines) == 3
    assert "(keeps its updates)" in next(line for line in lines if "GPU recipe settings" in line)


def test_the_driver_refuses_an_unknown_stage_in_one_line(tmp_path, capsys):
    assert device_check.main(["--out", str(tmp_path), "--only", "env,warp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "unknown stage 'warp': choose among env, lossless, shapes, graphs, embedded, zero2"


def test_the_stages_run_within_eight_minutes_and_one_with_no_time_left_is_skipped(tmp_path, monkeypatch):
    """Each stage runs under min(its limit, what is left of the budget): the first five's limits fit the 8
    minutes, ZeRO-2 (last) runs on what they left; a stage with nothing left says so in its verdict."""
    assert device_check.BUDGET == 8 * 60
    assert sum(v for k, v in device_check.STAGES.items() if k != "zero2") <= device_check.BUDGET
    assert set(device_check.STAGES) == set(device_check.STAGE_FUNCTIONS)
    assert list(device_check.STAGES)[-1] == "zero2"
    assert device_check.main(["--out", str(tmp_path / "run"), "--only", "env", "--tiny"]) == 0
    assert _verdicts(tmp_path / "run", "env")[-1].startswith("env       stage ok in ")  # its own process
    monkeypatch.setattr(device_check, "BUDGET", 0)
    assert device_check.main(["--out", str(tmp_path), "--only", "env,zero2", "--tiny"]) == 1
    verdicts = (tmp_path / "verdicts.txt").read_text()
    assert "env       stage SKIPPED: no time left" in verdicts and "zero2     stage SKIPPED" in verdicts
    assert device_check.main(["--out", str(tmp_path), "--only", "zero2", "--tiny"]) == 0  # optional


def test_the_zero2_stage_says_why_it_cannot_run_here(tmp_path):
    device_check.stage_zero2(device_check.Check(tmp_path, tiny=True, device="cpu"))
    (line,) = _verdicts(tmp_path, "zero2")
    assert "skipped: " in line and ("deepspeed does not import" in line or "no CUDA device" in line)
    sys.modules.pop("device_check", None)
