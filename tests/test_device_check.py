"""tools/device_check.py, the check a lent GPU runs, dry-run here at tiny sizes on the emulated CUDA device
(`virtual_cuda`): every stage's code runs and writes its verdicts, so the one call a GPU gets is not
spent on a typo. The numbers are the emulation's (no timing is asserted); the verdicts are real, and a
failed one sets the exit status."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from virtual_cuda import VirtualCuda

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("device_check", ROOT / "tools" / "device_check.py")
device_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_check)


def _verdicts(out: Path, stage: str) -> list[str]:
    return [line for line in (out / "verdicts.txt").read_text().splitlines() if line.startswith(stage)]


def test_the_decoding_stages_dry_run_on_the_emulated_device(tmp_path):
    with VirtualCuda() as device:
        check = device_check.Check(tmp_path, "tiny", emulator=device)
        assert check.device == "cuda" and not check.real_cuda
        for stage in ("env", "lossless", "smoke", "graphs", "shapes"):
            device_check.STAGE_FUNCTIONS[stage](check)
    lossless = _verdicts(tmp_path, "lossless")
    assert [line.split()[1] for line in lossless] == [f"{f}:" for f in device_check.FAMILIES]
    assert all("FAIL" not in line and "NOT" not in line for line in lossless)
    graphs_on = lossless[:4]  # the Llama family's: CUDA graphs
    assert all("graphs: lossless" in line and "sampled equal to the passes as written" in line
               and "a changing batch lossless, 0 captures when it repeats" in line for line in graphs_on)
    # kernel and graph launches counted apart: two graphs a round, the round's bookkeeping beside them
    assert all(" kernel + 2.0 graph launches a round (k=4)" in line for line in graphs_on), graphs_on
    (smoke,) = _verdicts(tmp_path, "smoke")
    assert "FAIL" not in smoke and "equal to the passes as written" in smoke
    assert all(f"{kind} " in smoke for kind in ("run", "verify", "draft_loop", "draft_loop_sampled"))
    assert len(_verdicts(tmp_path, "shapes")) == len(device_check.SHAPES)
    (graphs,) = _verdicts(tmp_path, "graphs")
    assert "k=4 lossless" in graphs and "graph launches a token" in graphs
    assert "emulated CUDA device" in _verdicts(tmp_path, "env")[0]


@pytest.mark.slow
def test_the_training_stages_dry_run_pretraining_the_exit_decoding_and_fsdp(tmp_path):
    """Pretrain, the fine-tune, two decoding paths, the GPU recipes' 20 steps (here 4), tiny, on the CPU
    (accelerate's loop does not run on the emulated device); FSDP2 through `accelerate launch` on one
    gloo process (tests/accelerate_cpu.py keeps accelerate's plugin on the CPU)."""
    check = device_check.Check(tmp_path, "tiny", device="cpu")
    device_check.stage_embedded(check)
    lines = _verdicts(tmp_path, "embedded")
    assert len(lines) == 5 and sum("lossless against graph plain" in line for line in lines) == 2
    assert "(keeps its updates)" in next(line for line in lines if "GPU recipe settings" in line)
    assert all("FAIL" not in line for line in lines)
    device_check.stage_fsdp(check)
    (fsdp,) = _verdicts(tmp_path, "fsdp")
    assert "exit 0, 3 steps" in fsdp and "FSDP2 state written, model saved" in fsdp and "FAIL" not in fsdp


def test_the_driver_refuses_an_unknown_stage_in_one_line(tmp_path, capsys):
    assert device_check.main(["--out", str(tmp_path), "--only", "env,warp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("unknown stage 'warp': choose among env, lossless, smoke, graphs, embedded, fsdp, shapes, "
                   "zero2, hf_compile")


def test_the_stages_run_within_the_budget_and_one_with_no_time_left_is_skipped(tmp_path, monkeypatch):
    """Each stage runs under min(its limit, what is left of the budget): the mission's stages' limits fit
    the budget, which with the wheels' install and the logs' archive keeps one call under 6 minutes (a
    rerun fits in 15); the optional ones (last) run on what they left; a stage with nothing left says so
    in its verdict, a failure for the mission's, not for an optional one."""
    assert device_check.BUDGET <= 6 * 60 - 30
    required = [k for k in device_check.STAGES if k not in device_check.OPTIONAL]
    assert sum(device_check.STAGES[k] for k in required) <= device_check.BUDGET
    assert set(device_check.STAGES) == set(device_check.STAGE_FUNCTIONS) == set(device_check.WORK)
    assert list(device_check.STAGES)[-3:] == ["shapes", "zero2", "hf_compile"]
    assert device_check.main(["--out", str(tmp_path / "run"), "--only", "env", "--tiny"]) == 0
    assert "emulated" not in _verdicts(tmp_path / "run", "env")[0]  # the driver's own process
    monkeypatch.setattr(device_check, "BUDGET", 0)
    assert device_check.main(["--out", str(tmp_path), "--only", "env,zero2", "--tiny"]) == 1
    verdicts = (tmp_path / "verdicts.txt").read_text()
    assert "env       FAIL stage SKIPPED: no time left" in verdicts and "zero2     stage SKIPPED" in verdicts
    assert device_check.main(["--out", str(tmp_path / "opt"), "--only", "zero2", "--tiny"]) == 0  # optional


def test_a_failed_verdict_sets_the_exit_status_and_the_missions_verdicts_print_first(tmp_path, monkeypatch,
                                                                                       capsys):
    """"NOT lossless" in a stage that exits 0 still fails the check; the summary lists the mission's
    verdicts before the optional stages'."""
    def lossless(c):
        c.verdict("lossless", "llama: eager: NOT lossless (early_exit k=4)", ok=False)

    def zero2(c):
        c.verdict("zero2", "skipped: deepspeed does not import here")
    monkeypatch.setattr(device_check, "_run_stage", lambda out, name, size, left: (
        {"lossless": lossless, "zero2": zero2}[name](device_check.Check(out, size)), "ok")[1])
    assert device_check.main(["--out", str(tmp_path), "--only", "zero2,lossless", "--tiny"]) == 1
    printed = capsys.readouterr().out
    summary = printed[printed.index("== the mission =="):]
    assert summary.index("lossless  FAIL llama: eager: NOT lossless") < summary.index("zero2     skipped")
    assert "0 stage(s) and 1 verdict(s) failed" in _verdicts(tmp_path, "total")[0]


def test_the_latency_model_adds_launches_captures_and_each_stages_work(tmp_path, monkeypatch):
    """The dry run's arithmetic on counted stages: (kernel + graph launches) x LAUNCH_SECONDS + captures x
    CAPTURE_SECONDS + the stage's work, each term here large enough that a model without it misses by
    more than its rounding; a mission over `TARGET` is a failure."""
    from selfspec.backends.graphs import CapturedPass

    def lossless(c):
        x = c.move(torch.nn.Linear(2, 2)).weight.detach()
        for _ in range(1000):
            x = x + 1  # one kernel each
        for scale in range(4):  # 4 captures, 50 replays each
            double = CapturedPass(lambda a, s=scale: a * (s + 2), static=(), device=x.device)
            for _ in range(50):
                double(x)
    stages = {name: lossless if name == "lossless" else (lambda c: None) for name in device_check.STAGES}
    monkeypatch.setattr(device_check, "STAGE_FUNCTIONS", stages)
    monkeypatch.setattr(device_check, "LAUNCH_SECONDS", 1e-3)
    monkeypatch.setattr(device_check, "CAPTURE_SECONDS", 0.1)
    assert device_check.main(["--out", str(tmp_path), "--dry-run"]) == 0
    model = json.loads((tmp_path / "model.json").read_text())
    row = {r["stage"]: r for r in model["rows"]}["lossless"]
    assert row["kernel_launches"] >= 1000 + 2 * 4 * 50 and row["graph_launches"] == 4 * 50  # copied in, out
    assert row["captures"] == 4
    kernels, graphs = 1e-3 * row["kernel_launches"], 1e-3 * row["graph_launches"]
    captures = 0.1 * row["captures"]
    assert min(kernels, graphs, captures) > 0.15  # each term above the rounding's 0.05
    modelled = kernels + graphs + captures + row["work_seconds"]
    assert row["modelled_seconds"] == pytest.approx(modelled, abs=0.051)
    mission = [r["modelled_seconds"] for r in model["rows"] if r["stage"] not in device_check.OPTIONAL]
    assert model["mission_seconds"] == pytest.approx(sum(mission), abs=0.01)
    monkeypatch.setattr(device_check, "WORK", {k: (device_check.TARGET, "") for k in device_check.WORK})
    assert device_check.main(["--out", str(tmp_path), "--dry-run"]) == 1


def test_the_zero2_stage_says_why_it_cannot_run_here(tmp_path):
    device_check.stage_zero2(device_check.Check(tmp_path, "tiny", device="cpu"))
    lines = _verdicts(tmp_path, "zero2")
    if importlib.util.find_spec("deepspeed") is None:
        assert len(lines) == 1 and "skipped: deepspeed does not import" in lines[0]
    sys.modules.pop("device_check", None)


def test_a_verdict_spanning_lines_is_one_line_and_the_summary_reads_it(tmp_path, monkeypatch, capsys):
    """An exception's message of several lines in a verdict: folded into one line of verdicts.txt, which
    the summary (a line a verdict) reads without stumbling on the rest."""
    def lossless(c):
        c.verdict("lossless", "llama: FAILED: RuntimeError: CUDA error\n  at line 3\n\nsee the log", ok=False)
    monkeypatch.setattr(device_check, "_run_stage", lambda out, name, size, left: (
        lossless(device_check.Check(out, size)), "ok")[1])
    assert device_check.main(["--out", str(tmp_path), "--only", "lossless", "--tiny"]) == 1
    (line,) = _verdicts(tmp_path, "lossless")
    assert line == "lossless  FAIL llama: FAILED: RuntimeError: CUDA error at line 3 see the log"
    assert "1 verdict(s) failed" in _verdicts(tmp_path, "total")[0]


def test_a_timed_out_stage_takes_the_workers_that_made_a_process_group_of_their_own(tmp_path):
    """torchrun's workers start a process group of their own inside the stage's session: killing the
    stage's group alone left them running; the whole session goes."""
    import os
    import subprocess
    import time

    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
              "preexec_fn=os.setpgrp)\n"
              "print(child.pid, flush=True)\ntime.sleep(60)\n")
    stage = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    worker = int(stage.stdout.readline())
    assert os.getpgid(worker) != stage.pid and os.getsid(worker) == stage.pid
    device_check.kill_session(stage.pid)
    stage.wait(timeout=10)
    for _ in range(100):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
        try:
            os.waitpid(worker, os.WNOHANG)
        except ChildProcessError:
            pass
    else:
        raise AssertionError("the worker outlived its stage")


def test_the_dry_run_fails_a_stage_modelled_past_its_share_of_its_own_limit(tmp_path, monkeypatch, capsys):
    """Each stage's modelled time within 70 % of its own limit, not the total alone: a stage at 90 % of
    its limit fails the dry run even where the total fits; Hugging Face's compile has a stage of its own,
    optional, outside the mission."""
    stages = {name: (lambda c: None) for name in device_check.STAGES}
    monkeypatch.setattr(device_check, "STAGE_FUNCTIONS", stages)
    assert device_check.main(["--out", str(tmp_path), "--dry-run"]) == 0
    assert all(work <= device_check.STAGE_SHARE * device_check.STAGES[name]
               for name, (work, _) in device_check.WORK.items())
    assert "hf_compile" in device_check.OPTIONAL and device_check.WORK["graphs"][0] < 30
    monkeypatch.setattr(device_check, "WORK", {**device_check.WORK, "smoke": (27, "")})  # 90 % of 30 s
    assert device_check.main(["--out", str(tmp_path), "--dry-run"]) == 1
    assert "smoke: modelled 27" in capsys.readouterr().out
