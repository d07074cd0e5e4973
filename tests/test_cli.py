"""The command line as a table of functions: keyword calls, intermixed flags, user errors apart from bugs,
and every `selfspec ...` command the README shows parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers import tiny_model

from selfspec import cli, commands
from selfspec.checkpoint import read_settings, save_tuned
from selfspec.decoding import DecodeSettings
from selfspec.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_ckpt(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    return save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))


def test_an_internal_error_keeps_its_traceback_while_a_user_error_is_one_line(monkeypatch, capsys):
    def bug(options):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(commands, "layers_report", bug)
    with pytest.raises(ValueError, match="an internal invariant broke"):  # not swallowed into one line
        cli.main(["layers", "some/model"])

    def mistake(options):
        raise UserError("the model directory is missing; pass another one\nsecond line")

    monkeypatch.setattr(commands, "layers_report", mistake)
    assert cli.main(["layers", "some/model"]) == 2
    assert capsys.readouterr().err == "error: the model directory is missing; pass another one\n"


def test_every_command_is_called_with_its_options_made_from_its_flags(monkeypatch):
    seen = []
    monkeypatch.setattr(commands, "gate", lambda options: seen.append(options) or False)
    assert cli.main(["eval", "gate", "--tuned", "a", "--base", "b", "--data", "sharegpt",
                     "--max-blocks", "4"]) == 1
    assert seen == [commands.GateOptions(tuned="a", base="b", data="sharegpt", max_blocks=4)]
    assert (seen[0].max_increase, seen[0].split, seen[0].block_size, seen[0].json_out) == (0.01, "test", 256,
                                                                                         None)


def test_demo_json_runs_the_structured_demo(monkeypatch):
    from selfspec import demo

    seen = {}
    monkeypatch.setattr(demo, "run", lambda options: seen.update(vars(options)) or True)
    assert cli.main(["demo", "--json"]) == 0
    assert seen["structured"] is True and seen["smollm2"] is False


def test_a_flag_between_the_model_and_the_prompt_parses(tiny_ckpt, capsys):
    """The README's `selfspec generate MODEL --chat "..."`: argparse's plain parsing took the prompt for an
    unrecognized argument; the tiny tokenizer has no chat template, which is the error it must reach."""
    assert cli.main(["generate", str(tiny_ckpt), "--chat", "What is the capital of France?"]) == 2
    assert "has no chat template" in capsys.readouterr().err
    assert cli.main(["generate", str(tiny_ckpt), "--max-new-tokens", "4", "--no-eos", "def f(x):"]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")


def test_generate_on_static_passes_prints_what_the_default_passes_print(tiny_ckpt, capsys):
    argv = ["generate", str(tiny_ckpt), "--max-new-tokens", "12", "--no-eos", "--no-stream", "def f(x):"]
    assert cli.main(argv) == 0
    default = capsys.readouterr().out.split("\n[")[0]
    assert cli.main([*argv, "--static-passes", "eager"]) == 0
    assert capsys.readouterr().out.split("\n[")[0] == default
    for backend in ("reference", "cpu_kernels"):  # --backend: the oracle prints the same text
        assert cli.main([*argv, "--backend", backend]) == 0
        assert capsys.readouterr().out.split("\n[")[0] == default
    with pytest.raises(SystemExit):  # argparse's one line
        cli.main([*argv, "--backend", "gpu"])
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_a_benchmark_of_no_prompts_is_a_one_line_error_that_writes_nothing(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "benchmark"
    assert cli.main(["eval", "speedup", "--model", str(tiny_ckpt), "--num-prompts", "0",
                     "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: --num-prompts (0)")
    assert not out.exists()
    assert cli.main(["eval", "sweep", "--model", str(tiny_ckpt), "--num-prompts", "0",
                     "--out", str(out)]) == 2
    assert not out.exists()


def test_an_imported_base_decodes_with_copies_never_slower_than_plain(tmp_path, monkeypatch, tiny_run):
    """An untrained early exit drafts too poorly to pay: the import's default is the copy drafter."""
    from transformers import AutoTokenizer

    from selfspec import load_tuned

    model = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(tiny_run["model"])
    monkeypatch.setattr("selfspec.model.gguf.load_gguf", lambda source: (model, tokenizer, Path("tiny.gguf")))
    out = commands.import_gguf("tiny.gguf", str(tmp_path / "base"))
    settings = read_settings(out)
    assert settings.drafter == "ngram" and settings.exit_layer == 2  # E kept for a later early exit
    gen = load_tuned(out)
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    copied = gen.generate(prompt, max_new_tokens=12, eos_token_id=[])
    plain = gen.generate(prompt, max_new_tokens=12, eos_token_id=[], num_speculations=0, drafter="early_exit")
    assert copied.sequences == plain.sequences and copied.stats.early_exit.drafted == 0


def test_the_curve_legend_sits_outside_the_acceptance_axes(tmp_path, monkeypatch):
    from selfspec.evaluation import curves

    boxes, save = [], curves.save_figure

    def check_and_save(fig, path):
        fig.canvas.draw()
        axes = fig.axes[0]
        boxes.append((axes.get_legend().get_window_extent(), axes.get_window_extent()))
        return save(fig, path)

    monkeypatch.setattr(curves, "save_figure", check_and_save)
    curve = {"tokens": [0, 100, 200], "perplexity": [9.0, 8.0, 7.5],
             "exits": {2: {"top1_agreement": [0.1, 0.5, 0.9], "expected_acceptance": [0.2, 0.5, 0.8]}}}
    curves.plot_curve(curve, tmp_path / "curve.png")
    ((legend, axes),) = boxes
    assert not legend.overlaps(axes)  # it once sat on the acceptance curves
    assert (tmp_path / "curve.png").stat().st_size > 0


def readme_commands() -> list[list[str]]:
    """Every `selfspec ...` command in the README's code blocks, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("selfspec "):
                    found.append(shlex.split(part)[1:])
    return found


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(argv[:2]))
def test_every_command_the_readme_shows_parses(argv):
    _, table = cli._parser()
    words = tuple(argv[:2]) if argv[0] == "eval" else tuple(argv[:1])
    assert words in table, argv
    args = table[words].parse_intermixed_args(argv[len(words):])  # SystemExit on a flag that is not there
    assert callable(args.func)


def test_the_readme_shows_commands():
    assert len(readme_commands()) >= 10


def test_the_sweep_searches_eta_and_writes_it_back(tiny_ckpt, tmp_path, capsys):
    from helpers import sharp_llama

    from selfspec.evaluation.options import SweepGrid
    from selfspec.evaluation.sweep import overlap_applies, run_sweep, to_markdown
    from selfspec.evaluation.timing import LoadedCheckpoint

    grid = SweepGrid(ks=(2,), drafters=("early_exit", "hybrid"), stop_belows=(0.0, 0.5), max_new_tokens=8,
                     repeats=1, warmup=0)
    report = run_sweep(LoadedCheckpoint(sharp_llama(), DecodeSettings()), [[5, 17, 33, 2, 11, 8]], [1], grid,
                       progress=False)
    etas = sorted({(row["drafter"], row["stop_below"]) for row in report["grid"]})
    assert etas == [("early_exit", 0.0), ("early_exit", 0.5), ("hybrid", 0.0), ("hybrid", 0.5)]
    assert report["all_identical_to_plain"]
    assert sum(row["stopped_below_eta"] for row in report["grid"] if row["stop_below"]) > 0
    assert "early_exit, E = 1, k = 2, η = 0.5" in to_markdown(report)
    # the grid measures each early-exit and hybrid cell with its rounds overlapped too, where that runs
    overlapped = {row["drafter"] for row in report["grid"] if row["overlap"]}
    assert overlapped == ({"early_exit", "hybrid"} if overlap_applies("cpu", False) else set())
    out = tmp_path / "sweep"
    assert cli.main(["eval", "sweep", "--model", str(tiny_ckpt), "--exit-layers", "2", "--ks", "2",
                     "--stop-belows", "0,0.4", "--max-new-tokens", "4", "--repeats", "1", "--warmup", "0",
                     "--num-prompts", "1", "--prompts", str(_prompt_file(tmp_path)), "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["generate", str(tiny_ckpt), "def f(x):", "--stop-below", "1.5"]) == 2
    assert "stop_below (η) must be a number in [0, 1)" in capsys.readouterr().err
    assert cli.main(["eval", "sweep", "--model", str(tiny_ckpt), "--stop-belows", "high"]) == 2
    assert "comma list of numbers" in capsys.readouterr().err



def test_overlap_and_fused_reach_the_decode_from_the_flags_and_load_tuned(tiny_ckpt, capsys):
    """`--overlap` / `--no-overlap`, `--no-fused` and `load_tuned(overlap=, fused=)` set
    `DecodeSettings.overlap` and `fused` (stdout the same text either way, the settings on stderr say
    which); a checkpoint without the fields is not overlapped and fused."""
    from selfspec import load_tuned

    assert load_tuned(tiny_ckpt, overlap=True).settings.overlap and not load_tuned(tiny_ckpt).settings.overlap
    assert not load_tuned(tiny_ckpt, fused=False).settings.fused and load_tuned(tiny_ckpt).settings.fused
    texts = []
    for flag, said in (("--overlap", "overlapped"), ("--no-overlap", None),
                       ("--no-fused", "rounds from Python")):
        assert cli.main(["generate", str(tiny_ckpt), "def f(x):", "--max-new-tokens", "12", "--no-eos",
                         flag]) == 0
        out, err = capsys.readouterr()
        texts.append(out)
        assert said is None and "overlapped" not in err or said in err
    assert texts[0] == texts[1] == texts[2]

def _prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("def f(x):\n")
    return path


def test_a_sweep_that_retimes_after_long_prompts_judges_each_repeat_by_both(tiny_ckpt, capsys):
    """`confirm_context`: a re-timed cell's speedup per repeat is the geometric mean of its speedups after
    the short and the long prompts (the medians of each beside it); too long for the model: one line."""
    import math

    from helpers import sharp_llama

    from selfspec.evaluation.options import SweepGrid
    from selfspec.evaluation.sweep import _confirmed_speedups, run_sweep, to_markdown
    from selfspec.evaluation.timing import LoadedCheckpoint, Timings

    # three repeats of two batches (a short prompt, a long one), 10 tokens each; seconds per repeat
    seconds = {"plain": [(1.0, 1.0)] * 3, "cell": [(0.5, 2.0), (0.8, 1.25), (1.0, 0.5)]}
    timed = Timings(seconds={n: [list(r) for r in v] for n, v in seconds.items()},
                    tokens={n: [[10, 10] for _ in v] for n, v in seconds.items()})
    # speedups: short 2, 1.25, 1; long 0.5, 0.8, 2; their geometric means 1, 1, 1.41
    out = _confirmed_speedups(timed, "cell", "plain", [0], [1])
    assert math.isclose(out["speedup"], 1.0) and math.isclose(out["speedup_short"], 1.25)
    assert math.isclose(out["speedup_long"], 0.8)
    alone = _confirmed_speedups(timed, "cell", "plain", [0])
    assert "speedup_long" not in alone and math.isclose(alone["speedup"], 1.25)

    grid = SweepGrid(ks=(1, 2), max_new_tokens=6, repeats=1, warmup=0, confirm=1, confirm_repeats=2)
    report = run_sweep(LoadedCheckpoint(sharp_llama(), DecodeSettings()), [[5, 17, 33, 2, 11, 8]], [1], grid,
                       progress=False, long_prompts=[[(7 * i) % 64 for i in range(48)]])
    assert report["confirmed"] and all(row["identical_to_plain"] and row["speedup_long"] > 0
                                       for row in report["confirmed"])
    assert report["confirm_context"] == 48
    assert "Re-timed after prompts of 48 tokens too" in to_markdown(report)
    assert cli.main(["eval", "sweep", "--model", str(tiny_ckpt), "--confirm-context", "100000"]) == 2
    assert "--confirm-context 100000 plus --max-new-tokens" in capsys.readouterr().err
    assert cli.main(["eval", "sweep", "--model", str(tiny_ckpt), "--confirm-context", "-1"]) == 2
    assert "--confirm-context must be >= 0" in capsys.readouterr().err
    assert cli.main(["eval", "sweep", "--model", str(tiny_ckpt), "--confirm-context", "64",
                     "--confirm", "0"]) == 2
    assert "pass --confirm 1 or more" in capsys.readouterr().err


def test_a_sweep_whose_table_eta_cuts_every_round_still_reports():
    """At η = 0.999 no draft is sure enough: the table's cells have nothing to predict from (NaN)."""
    import math

    from helpers import sharp_llama

    from selfspec.evaluation.options import SweepGrid
    from selfspec.evaluation.sweep import run_sweep, to_markdown
    from selfspec.evaluation.timing import LoadedCheckpoint

    grid = SweepGrid(ks=(2,), stop_belows=(0.999, 0.0), drafters=("early_exit", "early_exit"),
                     max_new_tokens=6, repeats=1, warmup=0)
    report = run_sweep(LoadedCheckpoint(sharp_llama(), DecodeSettings()), [[5, 17, 33, 2, 11, 8]], [1], grid,
                       progress=False)
    cut = [row for row in report["grid"] if row["stop_below"] == 0.999]
    assert len(report["grid"]) == 2 and math.isnan(cut[0]["predicted_speedup"])  # drafters deduplicated
    assert "| 1 | 0 |" in to_markdown(report)


def test_generate_under_a_json_schema_exits_1_when_the_reply_is_cut(tiny_ckpt, tmp_path, capsys):
    """`selfspec generate --json-schema FILE`: the reply follows the schema; one cut by --max-new-tokens
    before the schema is complete is reported on stderr with exit code 1; bad flags exit 2."""
    import json

    schema = tmp_path / "flag.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"], "additionalProperties": False}))
    assert cli.main(["generate", str(tiny_ckpt), "def f(x):", "--json-schema", str(schema),
                     "--max-new-tokens", "32", "--no-stream"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.split("def f(x):", 1)[1].strip()) in ({"ok": True}, {"ok": False})
    assert cli.main(["generate", str(tiny_ckpt), "def f(x):", "--json-schema", str(schema),
                     "--max-new-tokens", "2"]) == 1
    assert "does not complete its grammar within --max-new-tokens 2" in capsys.readouterr().err
    assert cli.main(["generate", str(tiny_ckpt), "x", "--json-schema", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["generate", str(tiny_ckpt), "x", "--regex", "a(", "--max-new-tokens", "2"]) == 2
    assert "does not compile" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: the constraint flags exclude each other
        cli.main(["generate", str(tiny_ckpt), "x", "--regex", "a", "--grammar", "g.lark"])


def test_a_sweep_after_long_prompts_stores_a_pick_that_greedy_decodes_switch_to(tiny_ckpt, tmp_path, capsys):
    """`--context L`: the grid after L-token prompts from the corpus; its write-back goes under
    `formats["context@T"]`, T the geometric mean of L and the short prompts' length, and a greedy decode of
    the loaded checkpoint switches to it at T tokens of context while the checkpoint's own settings stay."""
    import json

    from helpers import assert_shape

    from selfspec import load_tuned
    from selfspec.checkpoint import read_meta
    from selfspec.decoding import context_key
    from selfspec.evaluation.results import SweepReport
    from selfspec.evaluation.sweep import write_back_fastest

    out = tmp_path / "sweep"
    assert cli.main(["eval", "sweep", "--model", str(tiny_ckpt), "--exit-layers", "1,2", "--ks", "1",
                     "--drafters", "early_exit", "--num-prompts", "2", "--prompt-tokens", "16",
                     "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0", "--confirm", "0",
                     "--context", "64", "--out", str(out)]) == 0
    report = json.loads((out / "sweep.json").read_text())
    assert_shape(report, SweepReport)
    assert report["context"] == 64 and report["from_tokens"] == 32  # √(16 · 64)
    assert "the pick for greedy decodes from 32 tokens of context on" in (out / "sweep.md").read_text()
    pick = DecodeSettings(exit_layer=1, num_speculations=1)
    entry = {"drafter": "early_exit", "settings": pick.to_json(), "speedup": 1.4, "low": 1.2, "high": 1.6,
             "coverage": 0.9, "identical_to_plain": True}
    assert write_back_fastest(str(tiny_ckpt), {"best": entry, "fastest_per_drafter": {"early_exit": entry},
                                               "context": 64}, out / "sweep.json",
                              constraint_kind=context_key(32))
    assert "for greedy decodes from 32 tokens of context on" in capsys.readouterr().out
    assert read_meta(tiny_ckpt)["formats"]["context@32"]["context"] == 64
    generator = load_tuned(tiny_ckpt)
    assert generator.settings == DecodeSettings(exit_layer=2, num_speculations=3)
    short = generator.generate([[5, 17, 33, 2, 11]], max_new_tokens=12, eos_token_id=[])
    long = generator.generate([[(7 * i) % 50 for i in range(40)]], max_new_tokens=12, eos_token_id=[])
    assert short.stats.exit_layer == 2 and long.stats.exit_layer == 1
    assert write_back_fastest(str(tiny_ckpt), {"best": entry, "fastest_per_drafter": {"early_exit": entry}},
                              out / "sweep.json", constraint_kind=context_key(48))  # a new pick replaces it
    assert [k for k in read_meta(tiny_ckpt)["formats"] if k.startswith("context@")] == ["context@48"]
    for flags, said in ((["--context", "-1"], "--context must be >= 0"),
                        (["--context", "128", "--confirm-context", "64"], "leave out --confirm-context"),
                        (["--context", "128", "--temperature", "0.8"], "leave out --temperature"),
                        (["--context", "100000"], "--context 100000 plus --max-new-tokens"),
                        (["--context", "64", "--prompt-tokens", "64"], "must exceed --prompt-tokens 64")):
        assert cli.main(["eval", "sweep", "--model", str(tiny_ckpt), *flags]) == 2
        assert said in capsys.readouterr().err, flags
