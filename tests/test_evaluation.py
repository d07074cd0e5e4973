"""Per-exit-layer metrics, the perplexity gate and the CLI's one-line errors."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_shape, tiny_model

from selfspec.agreement import exit_layer_metrics
from selfspec.checkpoint import load_tuned, read_settings
from selfspec.cli import main
from selfspec.decoding import DecodeSettings, RoundCosts
from selfspec.errors import UserError
from selfspec.evaluation.context_costs import COPY_LENGTHS, MEASURED_ROUNDS
from selfspec.evaluation.exits import format_exit_table
from selfspec.evaluation.perplexity import perplexity, perplexity_gate
from selfspec.evaluation.results import SweepReport
from selfspec.evaluation.sweep import settings_of


def test_exit_metrics_match_a_direct_computation():
    model = tiny_model("llama", num_layers=4)
    blocks = torch.randint(0, 96, (5, 12), generator=torch.Generator().manual_seed(0))
    report = exit_layer_metrics(model, blocks, batch_size=2)
    assert sorted(report) == [1, 2, 3, 4]
    with torch.no_grad():
        states = model(blocks, output_hidden_states=True).hidden_states
        final = model(blocks).logits
        exit2 = model.lm_head(model.model.norm(states[2]))
    ce = F.cross_entropy(exit2[:, :-1].flatten(0, 1), blocks[:, 1:].flatten())
    agree = (exit2[:, :-1].argmax(-1) == final[:, :-1].argmax(-1)).double().mean()
    overlap = torch.minimum(exit2.softmax(-1), final.softmax(-1)).sum(-1)[:, :-1].mean()
    assert report[2]["loss"] == pytest.approx(ce.item(), rel=1e-5)
    assert report[2]["top1_agreement"] == pytest.approx(agree.item(), abs=1e-9)
    assert report[2]["expected_acceptance"] == pytest.approx(overlap.item(), rel=1e-5)
    assert report[4]["top1_agreement"] == 1.0 and report[4]["expected_acceptance"] == pytest.approx(1.0)
    assert report[4]["perplexity"] == pytest.approx(math.exp(report[4]["loss"]))
    assert "| 2 | 50% |" in format_exit_table(report)


def test_exit_agreement_with_a_draft_vocabulary_is_the_trimmed_drafts():
    from selfspec.model import DecoderView

    model = tiny_model("llama", num_layers=4, seed=0)
    blocks = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    ids = torch.arange(0, 96, 2)  # the even ids
    report = exit_layer_metrics(model, blocks, [2], draft_vocab=ids)
    full = exit_layer_metrics(model, blocks, [2])
    view = DecoderView(model)
    hidden = view.run_layers(view.embed(blocks), 0, 2)
    exit_logits, final = view.exit_logits(hidden)[:, :-1], view(blocks)[:, :-1]
    trimmed = ids[exit_logits[..., ids].argmax(-1)]  # (B, T-1): the trimmed draft's pick
    assert report[2]["top1_agreement"] == pytest.approx((trimmed == final.argmax(-1)).float().mean().item())
    assert report[2]["loss"] == pytest.approx(full[2]["loss"])  # the exit's own CE stays the full one
    assert report[4] == full[4]


def test_gate_passes_identical_models_and_fails_a_damaged_one():
    base = tiny_model("llama", num_layers=4, seed=0)
    blocks = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    same = perplexity_gate(base, base, blocks)
    assert same.passed and same.relative_change == 0.0
    damaged = tiny_model("llama", num_layers=4, seed=0)
    with torch.no_grad():
        damaged.lm_head.weight.mul_(3.0)  # sharper, wrong logits: a higher perplexity on random text
    result = perplexity_gate(damaged, base, blocks, max_increase=0.01)
    assert result.tuned_perplexity == pytest.approx(perplexity(damaged, blocks)[0])
    assert result.relative_change > 0.01 and not result.passed and result.tokens == 4 * 15
    assert result.summary().startswith("FAIL")


def test_the_gate_on_chat_data_counts_only_the_assistant_tokens():
    base = tiny_model("llama", num_layers=4, seed=0)
    blocks = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 8:] = True
    damaged = tiny_model("llama", num_layers=4, seed=0)
    with torch.no_grad():
        damaged.lm_head.weight.mul_(3.0)
    result = perplexity_gate(damaged, base, blocks, target_mask=mask)
    assert result.tokens == 2 * 8  # positions 7..14 predict the targets 8..15
    logits = damaged(blocks).logits[:, 7:15]  # (2, 8, V): the positions that predict tokens 8..15
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks[:, 8:].flatten())
    assert result.tuned_perplexity == pytest.approx(math.exp(ce.item()), rel=1e-5)


def test_cli_user_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["layers", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no model at") and "\n" not in err
    assert main(["eval", "gate", "--tuned", str(tmp_path), "--base", str(tmp_path)]) == 2


def test_cli_speedup_and_generate_on_a_tiny_checkpoint(tiny_run, tmp_path, capsys):
    import json

    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import save_tuned

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nimport os\n")
    assert main(["eval", "speedup", "--model", str(ckpt), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--repeats", "1", "--warmup", "0", "--methods", "plain,early_exit",
                 "--out", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "benchmark.json").read_text())
    assert report["settings"]["early_exit"]["exit_layer"] == 2 and report["greedy_outputs_identical"]
    assert report["methods"]["early_exit"]["tokens_per_second"] > 0
    capsys.readouterr()
    assert main(["generate", str(ckpt), "def f(x):", "--max-new-tokens", "5", "--num-speculations", "2"]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")


@pytest.fixture
def tiny_ckpt(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import save_tuned

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    return save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))


def test_cli_generate_uses_the_checkpoints_k_and_streams_what_it_returns(tiny_ckpt, capsys, monkeypatch):
    from selfspec import commands as cli
    from selfspec.decoding import SelfSpecGenerator

    used = []
    original = SelfSpecGenerator.generate

    def spy(self, *args, **kwargs):
        used.append(self.settings.num_speculations if kwargs.get("num_speculations") is None
                    else kwargs["num_speculations"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SelfSpecGenerator, "generate", spy)
    assert main(["generate", str(tiny_ckpt), "def f(x):", "--max-new-tokens", "8", "--no-eos"]) == 0
    captured = capsys.readouterr()
    assert used == [3] and "k = 3" in captured.err  # the checkpoint's selfspec.json, not "auto"
    (text,) = cli.generate(cli.GenerateOptions(model=str(tiny_ckpt), max_new_tokens=8, no_eos=True,
                                               no_stream=True), ["def f(x):"])
    capsys.readouterr()
    assert captured.out.rstrip("\n") == ("def f(x):" + text).rstrip("\n")


def test_cli_generate_runs_a_prompt_file_as_one_batch_with_stops(tiny_ckpt, tmp_path, capsys):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "def f(x):"}\n{"text": "import os"}\n')
    assert main(["generate", str(tiny_ckpt), "--prompts", str(jsonl), "--max-new-tokens", "6",
                 "--no-eos"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):") and "\n---\nimport os" in out
    from selfspec import commands as cli

    options = cli.GenerateOptions(model=str(tiny_ckpt), max_new_tokens=20, no_eos=True, no_stream=True)
    texts = cli.generate(options, ["def f(x):", "import os"])
    stop = texts[0][2:5]  # a string the first row produces: it must end that row right there
    cut = cli.generate(dataclasses.replace(options, stop=(stop,)), ["def f(x):"])[0]
    assert cut == texts[0][:texts[0].find(stop)]  # the row's text ends before its stop string


@pytest.mark.parametrize("argv, message", [
    (["--num-speculations", "window2"], "num_speculations 'window2' is not allowed; pass an integer k >= 0"),
    (["--num-speculations", "-1"], "num_speculations '-1' is not allowed"),
    (["--prompts", "missing.txt"], "pass one prompt or --prompts FILE"),
    ([""], "a prompt is empty"),
    (["x", "--chat"], "has no chat template; drop --chat"),
])
def test_cli_generate_bad_input_is_one_line(tiny_ckpt, capsys, argv, message):
    args = ["generate", str(tiny_ckpt), *argv]
    if "--prompts" not in argv and argv[0].startswith("--"):
        args.insert(2, "def f(x):")
    elif "--prompts" in argv:
        args.insert(2, "def f(x):")  # a prompt and a file: one of them too many
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n")
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("error: ") and message in last


def test_cli_generate_without_a_tokenizer_says_so(tiny_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import save_tuned

    ckpt = save_tuned(tmp_path / "bare", AutoModelForCausalLM.from_pretrained(tiny_run["model"]),
                      settings=DecodeSettings(exit_layer=2))
    assert main(["generate", str(ckpt), "def f(x):"]) == 2
    assert "has no tokenizer; save one beside the model" in capsys.readouterr().err


def test_cli_sweep_measures_the_grid_plots_and_writes_back_the_best(tiny_run, tmp_path, capsys):
    import json

    import numpy as np
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import read_meta, save_tuned

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    counts = np.arange(model.config.vocab_size)[::-1].copy()  # token 0 the most frequent
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3), token_counts=counts)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nimport os\n")
    out = tmp_path / "sweep"
    assert main(["eval", "sweep", "--model", str(ckpt), "--prompts", str(prompts), "--exit-layers", "1:4",
                 "--ks", "1,auto", "--drafters", "early_exit,hybrid,ngram", "--min-ngrams", "1,2",
                 "--draft-vocab-sizes", "0,64", "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0",
                 "--out", str(out), "--write-back", "--cost-lengths", "16,48"]) == 0
    report = json.loads((out / "sweep.json").read_text())
    assert_shape(report, SweepReport)
    cells = sorted((r["drafter"], r["exit_layer"], str(r["num_speculations"]), r["draft_vocab_size"],
                    r["ngram"]["min_ngram"]) for r in report["grid"])
    early = [(e, k, v) for e in (1, 2, 3) for v in (0, 64) for k in ("1", "auto")]
    # every cell derives from the checkpoint's settings (E = 2, k = 3, min_ngram 2): the copy drafter
    # keeps them
    assert cells == sorted([("early_exit", e, k, v, 2) for e, k, v in early]
                           + [("hybrid", e, k, v, n) for e, k, v in early for n in (1, 2)]
                           + [("ngram", 2, "3", 0, 1), ("ngram", 2, "3", 0, 2)])
    assert report["all_identical_to_plain"]
    assert all(0.0 <= report["per_exit_layer"][e][v]["acceptance_rate"] <= 1.0 for e in ("1", "2", "3")
               for v in ("0", "64"))
    markdown = (out / "sweep.md").read_text()
    assert (out / "sweep.png").stat().st_size > 0 and "| E | V' | α | α kept | c | k=1 | k=auto |" in markdown
    assert "| ngram, min_ngram = 2 |" in markdown and set(report["fastest_per_drafter"]) == {
        "early_exit", "hybrid", "ngram"}
    # the re-timed cells: each drafter's 3 fastest of the grid (ngram has 2), each with its interval, and
    # each drafter's fastest with its rounds from Python too (unless overlapped: only a compiled call runs it)
    best, confirmed = report["best"], report["confirmed"]
    lossless = sorted((r for r in report["grid"] if r["identical_to_plain"]), key=lambda r: -r["speedup"])
    retimed = [DecodeSettings.from_json(c["settings"]) for c in confirmed]
    own_three = [[x for x in lossless if x["drafter"] == d][:3] for d in ("early_exit", "hybrid", "ngram")]
    twins = [settings_of(own[0]).override(fused=False) for own in own_three if not own[0]["overlap"]]
    assert sorted(map(str, retimed)) == sorted([str(settings_of(r)) for own in own_three for r in own]
                                               + list(map(str, twins)))
    # the best is the fastest of the drafters' picks (`select_fastest`, tested on injected timings below)
    picks = report["fastest_per_drafter"].values()
    assert len(confirmed) == 8 + len(twins) and best == max(picks, key=lambda row: row["speedup"])
    assert all(c["low"] <= c["speedup"] <= c["high"] and c["coverage"] == pytest.approx(0.9375)
               for c in confirmed)  # 5 repeats: the min and max, 94%
    assert all(r["speedup_spread"][0] <= r["speedup"] <= r["speedup_spread"][1] for r in report["grid"])
    assert "| setting | grid | re-timed | interval |" in markdown
    # the doctor's checklist in one paragraph: the table's fastest early-exit cell, each drafter's fastest
    assert report["diagnosis"].startswith("Why it is (not) faster: Acceptance: ") and "Verdict: " in markdown
    assert report["diagnosis"] in markdown and "\n" not in report["diagnosis"]
    # The checkpoint holds what the write-back rule (tested on fixed reports below) says for this report:
    # the fastest setting when it beats plain decoding by more than the noise, else the checkpoint's own.
    stored = [c for c in confirmed if c["low"] > 1.0]
    own = DecodeSettings(exit_layer=2, num_speculations=3).to_json()
    expected = stored[0]["settings"] if stored else own
    assert read_settings(ckpt).to_json() == expected
    assert ("sweep" in read_meta(ckpt)) == bool(stored)
    # the round's costs by context length, measured at the stored settings' exit, which load_tuned reads
    costs = read_meta(ckpt)["round_costs"]["cpu"]
    stored_settings = read_settings(ckpt)
    assert costs["lengths"] == [16, 48] and [r["length"] for r in report["round_costs"]] == [16, 48]
    assert (costs["exit_layer"], costs["draft_vocab_size"]) == (stored_settings.exit_layer,
                                                                stored_settings.draft_vocab_size)
    assert all(c > 0 for c in costs["draft"]) and all(s >= 0 for s in costs["verify_slope"])
    # a whole round of each 1..k drafts (k at least 2, at most 4) at every length (timings: their shape)
    k = min(max(stored_settings.num_speculations, 2), MEASURED_ROUNDS)
    assert len(costs["rounds"]) == 2 and all(len(r) == k and min(r) > 0 for r in costs["rounds"])
    # rounds of copies, at every length, of 1, 2, 4, 8 and max_copy copies (fewer where max_copy is lower)
    max_copy = stored_settings.ngram.max_copy
    assert costs["copy_lengths"] == sorted({j for j in COPY_LENGTHS if j < max_copy} | {max_copy})
    assert [len(r) for r in costs["copy_rounds"]] == [len(costs["copy_lengths"])] * 2
    assert load_tuned(str(ckpt)).round_costs == RoundCosts.from_json(costs)


def _entry(settings: DecodeSettings, speedup: float, low: float | None = None) -> dict:
    """A sweep report's "best" / "fastest_per_drafter" entry (its interval's low end `low`, by default
    just under the median)."""
    low = speedup - 0.05 if low is None else low
    return {"settings": settings.to_json(), "speedup": speedup, "tokens_per_second": 1.0, "low": low,
            "high": speedup + 0.05, "coverage": 0.94, "drafter": settings.drafter}


def test_the_interval_of_paired_speedups_is_distribution_free_and_noise_is_not_a_win():
    from selfspec.evaluation.paired import beats_plain, median_interval, paired_speedups
    from selfspec.evaluation.sweep import select_fastest

    assert paired_speedups([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    five = median_interval([1.10, 0.97, 1.30, 1.02, 1.05])
    assert (five["speedup"], five["low"], five["high"]) == (1.05, 0.97, 1.30)
    assert five["coverage"] == pytest.approx(1 - 2 / 32) and five["spread"] == [0.97, 1.30]
    nine = median_interval([1.0 + i / 100 for i in range(9)])  # j = 2: 1 - 2·(1 + 9)/512 = 96%
    assert (nine["low"], nine["high"], nine["coverage"]) == (1.01, 1.07, pytest.approx(1 - 20 / 512))
    three = median_interval([1.2, 1.3, 1.25])  # too few for 90%: the min and max at 75%
    assert (three["low"], three["coverage"]) == (1.2, 0.75)
    # Injected timings: a grid whose every cell runs at plain's speed, with noise. One cell's median
    # looks fastest (1.03) but its interval holds 1; a cell steadily at 1.20 beats plain.
    rng = np.random.default_rng(0)
    plain = list(1000 * (1 + rng.normal(0, 0.03, 5)))
    noisy = median_interval(paired_speedups([p * r for p, r in zip(plain, [1.03, 0.96, 1.08, 1.03, 0.99])],
                                            plain))
    steady = median_interval(paired_speedups([p * r for p, r in zip(plain, [1.19, 1.21, 1.20, 1.18, 1.22])],
                                             plain))
    assert noisy["speedup"] == pytest.approx(1.03) and not beats_plain(noisy)
    assert steady["low"] == pytest.approx(1.18) and beats_plain(steady)
    rows = [{"drafter": "early_exit", **noisy}, {"drafter": "hybrid", **steady},
            {"drafter": "early_exit", **median_interval([1.1, 1.12, 1.15, 1.11, 1.13])}]
    best, fastest = select_fastest(rows)
    assert best is rows[1] and fastest == {"hybrid": rows[1], "early_exit": rows[2]}
    assert select_fastest([]) == (None, {})


def test_of_cells_the_repeats_cannot_order_the_sweep_picks_the_shortest_draft():
    """A drafter's cells whose medians lie inside its fastest cell's interval: the shortest k wins; a cell
    below that interval does not, however short its k; an adaptive k counts as the longest."""
    from selfspec.evaluation.paired import median_interval
    from selfspec.evaluation.sweep import select_fastest

    def cell(drafter, k, ratios):
        return {"drafter": drafter, "settings": {"num_speculations": k}, **median_interval(ratios)}

    k3 = cell("early_exit", 3, [1.65, 1.80, 1.90, 2.10, 2.87])  # fastest median, a wide interval
    k2 = cell("early_exit", 2, [1.62, 1.70, 1.81, 2.00, 2.90])  # inside it
    k1 = cell("early_exit", 1, [1.50, 1.55, 1.60, 1.62, 1.64])  # median below its low end: out
    auto = cell("early_exit", "auto", [1.70, 1.75, 1.85, 1.95, 2.00])
    copies = cell("ngram", 4, [1.40, 1.45, 1.50, 1.55, 1.60])
    best, fastest = select_fastest([k3, k1, auto, k2, copies])
    assert fastest == {"early_exit": k2, "ngram": copies} and best is k2
    # a steady fastest cell (a narrow interval) keeps its place over a shorter k that trails it
    steady = cell("early_exit", 3, [1.95, 1.96, 1.97, 1.98, 1.99])
    assert select_fastest([steady, k2])[1]["early_exit"] is steady


def test_the_re_timing_takes_each_drafters_fastest_cells_not_the_leaders_only():
    """Injected grid medians: copies lead the grid, so the grid's three fastest are all copy cells; the
    early exit's luckiest grid cell (1.34, a noisy one) is not its best. Each drafter's own three
    fastest are re-timed, so the steady early-exit cell (1.30 on the grid) gets its re-timing too."""
    from selfspec.evaluation.sweep import confirm_candidates

    def cells(drafter, speedups):
        return [{"drafter": drafter, "speedup": s, "cell": f"{drafter[0]}{i}"}
                for i, s in enumerate(speedups)]

    grid = cells("hybrid", [1.46, 1.39, 1.36, 1.35]) + cells("early_exit", [1.34, 1.30, 1.12, 1.0])
    grid += cells("ngram", [1.2])
    picked = [row["cell"] for row in confirm_candidates(grid[::-1], 3)]
    assert sorted(picked) == ["e0", "e1", "e2", "h0", "h1", "h2", "n0"]
    assert [c for c in picked if c[0] == "e"] == ["e0", "e1", "e2"]  # fastest first within a drafter
    assert sorted(row["cell"] for row in confirm_candidates(grid, 1)) == ["e0", "h0", "n0"]



def test_each_drafters_fastest_is_re_timed_with_its_rounds_from_python_too():
    """`DecodeSettings.fused`: whether a lone row's rounds run many in one compiled call pays by drafter and
    model, so the re-timing takes each drafter's fastest cell both ways (not an overlapped one, which
    runs only in a compiled call); the field travels through the report's rows and selfspec.json."""
    from selfspec.evaluation.sweep import settings_of, with_python_rounds

    rows = [{**DecodeSettings(drafter=d, exit_layer=2, num_speculations=k, overlap=o).to_json(), "cell": c}
            for d, k, o, c in (("hybrid", 2, False, "h0"), ("hybrid", 3, False, "h1"),
                               ("early_exit", 2, True, "e0"), ("early_exit", 3, False, "e1"))]
    out = with_python_rounds(rows)
    assert out[:4] == rows and [(r["cell"], r["fused"]) for r in out[4:]] == [("h0", False)]
    settings = settings_of(out[4])
    assert not settings.fused and "rounds from Python" in settings.describe()
    assert DecodeSettings.from_json(settings.to_json()) == settings
    assert settings_of({"drafter": "hybrid"}).fused  # a report from before the field: fused
    with pytest.raises(UserError, match="fused must be true or false"):
        DecodeSettings(fused=1)


def test_the_grid_runs_each_early_exit_and_hybrid_cell_both_ways_where_overlap_applies():
    """`DecodeSettings.overlap` (verification beside the next round's drafts) wins or loses by how much a
    pass slows on one thread: the grid measures each early-exit and hybrid cell with and without it;
    copies have no early-exit drafts to make ahead. The setting travels through the report's rows."""
    from selfspec.evaluation.sweep import grid_settings, settings_of

    base = DecodeSettings(exit_layer=3)
    grid = grid_settings(base, [2, 3], [1, 2], ("early_exit", "hybrid", "ngram"), [0], [2],
                         overlaps=(False, True))
    cells = [(s.drafter, s.exit_layer, s.num_speculations, s.overlap) for s in grid[1:]]
    assert len(cells) == len(set(cells)) == 2 * 4 + 2 * 4 + 1
    assert {c[3] for c in cells if c[0] != "ngram"} == {False, True}
    assert [c[3] for c in cells if c[0] == "ngram"] == [False]
    assert len(grid_settings(base, [2], [1], ("early_exit",), [0], [2])) == 2  # one way: rounds in turn
    # a checkpoint whose sweep stored rounds from Python still has every cell timed in one call first
    stored = base.override(fused=False)
    assert all(s.fused for s in grid_settings(stored, [2], [1], ("early_exit", "hybrid"), [0], [2],
                                              overlaps=(False, True)))
    row = grid[2].to_json()
    assert settings_of(row) == grid[2] and settings_of(row).overlap and "overlapped" in grid[2].describe()
    old = {key: value for key, value in row.items() if key in ("drafter", "exit_layer")}
    assert settings_of(old) == DecodeSettings(exit_layer=2)  # a report from before the field: off
    with pytest.raises(UserError, match="overlap must be true or false"):
        DecodeSettings(overlap="yes")


def test_the_sweep_plot_draws_the_cost_model_from_rounds_in_turn_when_overlapped_cells_are_faster(tmp_path):
    """Overlapped cells have no cost-model prediction (their c is not a draft step's): the plot's
    early-exit line and its prediction come from the table's cells even where an overlapped one wins."""
    from selfspec.evaluation.sweep import plot

    cell = DecodeSettings(exit_layer=3, num_speculations=2)
    report = {"per_exit_layer": {"3": {}}, "table_stop_below": 0.0, "grid": [
        {**cell.to_json(), "speedup": 1.2, "predicted_speedup": 1.3},
        {**cell.override(overlap=True).to_json(), "speedup": 1.6}]}
    assert plot(report, tmp_path / "sweep.png").is_file()

def test_the_write_back_skips_a_median_win_inside_the_noise(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import fastest_settings, read_meta, save_tuned
    from selfspec.evaluation.sweep import write_back_fastest

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    own = DecodeSettings(exit_layer=2, num_speculations=3)
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"], settings=own)
    lucky = _entry(DecodeSettings(exit_layer=3, num_speculations=4), 1.04, low=0.98)  # fastest median, noise
    steady = _entry(DecodeSettings("ngram", 2, 3), 1.02, low=1.01)
    assert write_back_fastest(str(ckpt), {"best": lucky, "fastest_per_drafter": {"early_exit": lucky,
                                                                                  "ngram": steady}},
                              tmp_path / "sweep.json")
    assert read_settings(ckpt) == DecodeSettings("ngram", 2, 3)  # the one that beats plain beyond noise
    assert set(fastest_settings(ckpt)) == {"ngram"}
    assert read_meta(ckpt)["sweep"]["interval"] == [1.01, 1.07]
    assert not write_back_fastest(str(ckpt), {"best": lucky, "fastest_per_drafter": {"early_exit": lucky}},
                                  tmp_path / "sweep.json")


def test_the_benchmark_times_the_sweeps_cells_again_and_says_whether_the_stored_one_holds(tiny_run, tmp_path,
                                                                                          capsys):
    """The write-back keeps every re-timed cell; `eval speedup --candidates` times them beside the methods,
    marks each drafter's stored cell and gives its speed ÷ the best cell's there."""
    import json

    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import save_tuned, sweep_candidates
    from selfspec.cli import main
    from selfspec.evaluation.sweep import write_back_fastest

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))
    args = ["eval", "speedup", "--model", str(ckpt), "--num-prompts", "2", "--max-new-tokens", "6",
            "--repeats", "3", "--warmup", "0", "--methods", "plain,early_exit", "--candidates",
            "--out", str(tmp_path / "bench")]
    assert main(args) == 2  # no sweep stored its cells yet: one line that says which command does
    assert "run `selfspec eval sweep --model" in capsys.readouterr().err
    first, second = (_entry(DecodeSettings(exit_layer=e, num_speculations=2), speedup, low=1.1)
                     for e, speedup in ((3, 1.3), (1, 1.2)))
    copies = _entry(DecodeSettings("ngram", 2, 3), 1.15, low=1.1)
    assert write_back_fastest(str(ckpt), {"best": first, "fastest_per_drafter": {"early_exit": first,
                                                                                  "ngram": copies},
                                          "confirmed": [first, second, copies]}, tmp_path / "sweep.json")
    assert [(d, s.exit_layer, x) for d, s, x in sweep_candidates(ckpt)] == [("early_exit", 3, 1.3),
                                                                             ("early_exit", 1, 1.2),
                                                                             ("ngram", 2, 1.15)]
    assert main(args) == 0
    report = json.loads((tmp_path / "bench" / "benchmark.json").read_text())
    early = report["candidates"]["early_exit"]
    assert [c["stored"] for c in early["cells"]] == [True, False]  # E = 3 is the drafter's stored cell
    assert all(c["identical_to_plain"] for c in early["cells"])
    here = [c["over_plain"]["speedup"] for c in early["cells"]]
    assert early["stored_over_best"] == pytest.approx(here[0] / max(here))
    # copies' one cell is their stored setting, whether or not they are among --methods
    assert report["candidates"]["ngram"]["cells"][0]["stored"]
    assert report["candidates"]["ngram"]["stored_over_best"] == 1.0
    text = (tmp_path / "bench" / "benchmark.md").read_text()
    assert "The sweep's re-timed cells, timed again here:" in text
    assert f"early_exit: the stored cell runs at {early['stored_over_best']:.3f}× the best cell here." in text


@pytest.mark.parametrize("speedup, written",
                         [(1.4, True), (0.9, False)])  # slower than plain: keep the checkpoint's
def test_sweep_write_back_records_only_a_setting_that_beats_plain(tiny_run, tmp_path, speedup, written):
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import read_meta, save_tuned
    from selfspec.evaluation.sweep import write_back_fastest

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    own = DecodeSettings(exit_layer=2, num_speculations=3)
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"], settings=own)
    best = _entry(DecodeSettings(exit_layer=3, num_speculations=4), speedup)
    report = {"best": best, "fastest_per_drafter": {"early_exit": best}}
    assert write_back_fastest(str(ckpt), report, tmp_path / "sweep.json") is written
    assert read_settings(ckpt) == (DecodeSettings(exit_layer=3, num_speculations=4) if written else own)
    assert ("sweep" in read_meta(ckpt)) is written
    assert not write_back_fastest(str(ckpt), {"best": None, "fastest_per_drafter": {}}, tmp_path / "s.json")


@pytest.mark.parametrize("best", [
    DecodeSettings("hybrid", 3, 2, 64).override(min_ngram=1),
    DecodeSettings("ngram", 2, 3).override(min_ngram=4),  # the copy drafter keeps the checkpoint's E and k
])
def test_sweep_write_back_stores_the_drafter_and_load_tuned_decodes_that_way(tiny_run, tmp_path, best):
    import numpy as np
    from transformers import AutoModelForCausalLM

    from selfspec import load_tuned
    from selfspec.checkpoint import read_meta, save_tuned
    from selfspec.evaluation.sweep import write_back_fastest

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3),
                      token_counts=np.ones(model.config.vocab_size, dtype=np.int64))
    entry = _entry(best, 1.6)
    assert write_back_fastest(str(ckpt), {"best": entry, "fastest_per_drafter": {best.drafter: entry}},
                              tmp_path / "sweep.json")
    meta = read_meta(ckpt)
    # selfspec.json: the same field names
    assert {name: meta[name] for name in best.to_json()} == best.to_json()
    assert meta["fastest"][best.drafter]["settings"] == best.to_json()
    generator = load_tuned(ckpt)
    assert generator.settings == best
    assert generator.draft_head().size == (best.draft_vocab_size or model.config.vocab_size)
    plain = generator.generate(["def f(x):"], max_new_tokens=12, num_speculations=0, drafter="early_exit",
                               eos_token_id=[])
    out = generator.generate(["def f(x):"], max_new_tokens=12, eos_token_id=[])  # the stored drafter
    assert out.sequences == plain.sequences


def test_cli_sweep_rejects_a_bad_grid_in_one_line(tiny_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import save_tuned

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))
    assert main(["eval", "sweep", "--model", str(ckpt), "--exit-layers", "9"]) == 2
    assert "error: " in capsys.readouterr().err
    assert main(["eval", "sweep", "--model", str(ckpt), "--ks", "two"]) == 2
    assert "--ks must be a comma list" in capsys.readouterr().err


def test_cli_draft_vocab_counts_into_the_checkpoint_and_generate_drafts_from_it(tiny_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import read_meta, read_token_counts, save_tuned

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))
    assert main(["draft-vocab", str(ckpt), "--data", str(tiny_run["corpus"]), "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    counts = read_token_counts(ckpt)
    assert (counts.shape == (model.config.vocab_size,)
            and read_meta(ckpt)["token_counts"]["tokens"] == counts.sum())
    assert "V' =    256:" in out and "of the tokens" in out
    assert main(["generate", str(ckpt), "def f(x):", "--drafter", "hybrid", "--draft-vocab-size", "64",
                 "--max-new-tokens", "8", "--no-stream", "--no-eos"]) == 0
    assert "[hybrid, E = 2, k = 3, V' = 64, min_ngram = 2:" in capsys.readouterr().err


def test_the_benchmark_runs_each_drafter_at_the_fastest_setting_the_sweep_stored(tiny_run, tmp_path):
    import numpy as np
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import read_meta, resolve_settings, save_tuned
    from selfspec.evaluation.sweep import write_back_fastest
    from selfspec.evaluation.timing import method_settings

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3),
                      token_counts=np.ones(model.config.vocab_size, dtype=np.int64))
    rows = {"early_exit": DecodeSettings(exit_layer=3, num_speculations=4, draft_vocab_size=64),
            "hybrid": DecodeSettings("hybrid", 1, 1).override(min_ngram=3),
            "ngram": DecodeSettings("ngram", 2, 3).override(min_ngram=1)}
    speedups = {"early_exit": 1.2, "hybrid": 2.5, "ngram": 0.9}  # ngram slower than plain: not stored
    fastest = {d: _entry(row, speedups[d]) for d, row in rows.items()}
    assert write_back_fastest(str(ckpt), {"best": fastest["hybrid"], "fastest_per_drafter": fastest},
                              tmp_path / "s")
    assert set(read_meta(ckpt)["fastest"]) == {"early_exit", "hybrid"}
    settings, stored, counts = resolve_settings(ckpt)
    assert settings == rows["hybrid"] and stored == {d: rows[d] for d in ("early_exit", "hybrid")}
    methods = method_settings(settings, stored)
    assert methods["early_exit"] == rows["early_exit"] and methods["hybrid"] == rows["hybrid"]
    assert methods["ngram"] == rows["hybrid"].override(drafter="ngram") and methods["plain"].is_plain
    # a flag sets every method alike
    settings, stored, _ = resolve_settings(ckpt, exit_layer=2)
    assert stored == {} and settings.exit_layer == 2


def test_the_eval_commands_measure_sampled_decoding_and_the_sweep_stores_a_sampled_pick(tiny_run, tmp_path,
                                                                                        capsys):
    """`eval speedup` and `eval sweep` take the sampling flags (`SamplingOptions`, declared once): every
    method samples alike, the reports say how, sampled outputs are not compared token for token (they
    are draws), and a sampled sweep's write-back goes under `formats.sampled`, which `load_tuned` then
    decodes sampled calls with while greedy calls keep the checkpoint's own."""
    import json

    from transformers import AutoModelForCausalLM

    from selfspec import load_tuned
    from selfspec.checkpoint import read_meta, save_tuned
    from selfspec.decoding import SAMPLED
    from selfspec.evaluation.sweep import write_back_fastest

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    ckpt = save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nimport os\n")
    sampled = ["--temperature", "0.8", "--top-p", "0.95", "--seed", "3"]
    assert main(["eval", "speedup", "--model", str(ckpt), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--repeats", "1", "--warmup", "0", "--methods", "plain,early_exit,hf_greedy",
                 "--out", str(tmp_path / "bench"), *sampled]) == 0
    report = json.loads((tmp_path / "bench" / "benchmark.json").read_text())
    assert report["sampling"] == "temperature 0.8, top-p 0.95" and "identical" not in report
    assert 0 <= report["sources"]["early_exit"]["early_exit"]["acceptance_rate"] <= 1  # the sampled α
    assert "temperature 0.8, top-p 0.95" in (tmp_path / "bench" / "benchmark.md").read_text()
    assert main(["eval", "sweep", "--model", str(ckpt), "--prompts", str(prompts), "--exit-layers", "1,2",
                 "--ks", "1,2", "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0", "--confirm", "0",
                 "--out", str(tmp_path / "sweep"), *sampled]) == 0
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert sweep["sampling"] == "temperature 0.8, top-p 0.95" and sweep["all_identical_to_plain"] is None
    assert all(row["identical_to_plain"] is None for row in sweep["grid"])
    capsys.readouterr()
    pick = DecodeSettings(exit_layer=1, num_speculations=2)
    entry = _entry(pick, 1.4)
    assert write_back_fastest(str(ckpt), {"best": entry, "fastest_per_drafter": {"early_exit": entry}},
                              tmp_path / "sweep.json", constraint_kind=SAMPLED)
    assert read_meta(ckpt)["formats"][SAMPLED]["settings"] == pick.to_json()
    generator = load_tuned(ckpt)
    assert generator.settings == DecodeSettings(exit_layer=2, num_speculations=3)  # greedy calls: its own
    out = generator.generate(["def f(x):"], max_new_tokens=8, temperature=0.8, seed=1, eos_token_id=[])
    assert out.stats.k_rounds.keys() <= {2} and out.stats.k_rounds  # sampled calls: the sampled pick
    greedy = generator.generate(["def f(x):"], max_new_tokens=8, eos_token_id=[])
    assert greedy.stats.k_rounds.keys() <= {3}
    assert main(["eval", "speedup", "--model", str(ckpt), "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    # sweeps at two temperatures: each pick under its own (`sampled@T`), a call at the nearest one's
    from selfspec.decoding import sampled_key
    for temperature, k in ((0.8, 2), (0.3, 4)):
        pick = DecodeSettings(exit_layer=1, num_speculations=k)
        entry = _entry(pick, 1.4)
        assert write_back_fastest(str(ckpt), {"best": entry, "fastest_per_drafter": {"early_exit": entry}},
                                  tmp_path / "sweep.json", constraint_kind=sampled_key(temperature))
    assert {"sampled@0.8", "sampled@0.3"} <= read_meta(ckpt)["formats"].keys()
    generator = load_tuned(ckpt)
    for temperature, k in ((0.25, 4), (0.5, 2), (1.0, 2)):  # 0.5 is nearer 0.8 than 0.3 by ratio
        out = generator.generate(["def f(x):"], max_new_tokens=8, temperature=temperature, seed=1,
                                 eos_token_id=[])
        assert out.stats.k_rounds.keys() <= {k} and out.stats.k_rounds, (temperature, out.stats.k_rounds)


def test_a_sampled_call_decodes_at_the_pick_of_the_nearest_temperature():
    from selfspec.decoding import SAMPLED, sampled_key, sampled_pick
    keys = [sampled_key(0.8), sampled_key(0.3), "json_schema", "sampled@bad", "sampled@0"]
    assert [sampled_pick(keys, t) for t in (0.1, 0.45, 0.5, 0.8, 2.0)] == [
        "sampled@0.3", "sampled@0.3", "sampled@0.8", "sampled@0.8", "sampled@0.8"]
    assert sampled_pick([SAMPLED, "json_schema"], 0.3) == SAMPLED  # a pick stored without its temperature
    assert sampled_pick([SAMPLED, sampled_key(0.7)], 0.3) == "sampled@0.7"
    assert sampled_pick(["json_schema"], 0.3) is None
