"""tools/gpu_check.sh, checked without a GPU: bash reads it, and every selfspec command in it parses."""

import os
import re
import shlex
import subprocess
from pathlib import Path

from selfspec import cli

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.sh"


def script_commands() -> list[list[str]]:
    """The words after `selfspec` of each command in the script, continuation lines joined."""
    found = []
    for line in SCRIPT.read_text().replace("\\\n", " ").splitlines():
        match = re.match(r"\s*(?:if\s+)?(?:timeout\s+\d+\s+)?selfspec\s+(.*)", line)
        if match:
            command = re.split(r"\s(?:>|2>|\|\||;)", match.group(1))[0]  # up to its redirection
            found.append(shlex.split(command))
    return found


def test_bash_reads_the_script():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_selfspec_command_in_the_script_parses():
    commands = script_commands()
    assert [argv[:2] for argv in commands] == [["train", "--config"], ["eval", "gate"], ["eval", "speedup"],
                                               ["eval", "serve-load"], ["eval", "speedup"]]
    _, table = cli._parser()
    for argv in commands:
        words = tuple(argv[:2]) if argv[0] == "eval" else tuple(argv[:1])
        args = table[words].parse_intermixed_args(argv[len(words):])  # SystemExit on a flag not there
        assert callable(args.func), argv
    speedup = cli._parser()[1][("eval", "speedup")]
    methods = speedup.parse_intermixed_args(commands[2][2:]).methods.split(",")
    assert speedup.parse_intermixed_args(commands[4][2:]).static_passes == "compile"
    serve = cli._parser()[1][("eval", "serve-load")].parse_intermixed_args(commands[3][2:])
    assert serve.dtype == "float32" and serve.concurrency == "1,8"  # row independence is an fp32 claim
    assert {"plain", "early_exit", "ngram", "hybrid", "hf_greedy", "hf_early_exit"} <= set(methods)


def test_without_cuda_it_stops_at_once_with_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == ["device     FAIL: no CUDA device (torch.cuda.is_available() "
                                                "is False); this script checks the GPU recipes"]
