"""`selfspec doctor`: each check of the checklist flags its case and passes the others, from injected
figures; the command probes a tiny model end to end. (Times are measured, never asserted.)"""

import json

import pytest
from helpers import assert_shape

from selfspec.cli import main
from selfspec.evaluation.diagnosis import diagnose
from selfspec.evaluation.results import DoctorResult

HEALTHY = {"alpha": 0.9, "k": 4, "exit_layer": 6, "num_layers": 12, "draft_cost": 0.4, "verify_cost": 1.0,
           "weight_cost": 0.45, "overhead": 0.05, "context": 256, "long_context": 2048,
           "draft_cost_long": 0.42, "verify_cost_long": 1.05,
           "speedups": {"early_exit": 1.5, "ngram": 1.2, "hybrid": 1.4}}


def _check(figures: dict, number: int) -> str:
    """Check `number`'s line (a check without its figures is left out, so lines are found by number)."""
    return next(line for line in diagnose(figures) if line.startswith(f"{number}. "))


def test_a_healthy_model_passes_every_check():
    lines = diagnose(HEALTHY)
    # no prefill figure (the doctor's own probe): check 5 is left out
    assert len(lines) == 5 and [line[:2] for line in lines] == ["1.", "2.", "3.", "4.", "6."]
    assert "clears the" in lines[0] and "near the 0.45" in lines[1] and "0.05 plain steps a round" in lines[2]
    assert "hold from 256 to 2048" in lines[3] and "early_exit is fastest at 1.50×" in lines[4]


@pytest.mark.parametrize("change, number, expected", [
    ({"alpha": 0.3}, 1, "below the"),  # acceptance under break-even: train or move E
    ({"alpha": float("nan")}, 1, "not measured"),
    ({"draft_cost": 1.5, "verify_cost": 1.5, "k": 1}, 1, "no α pays for k = 1"),
    ({"draft_cost": 0.7}, 2, "1.56× the 0.45 its weights predict"),  # c far above the weights' share
    ({"draft_cost": 0.7, "free_drafts": True}, 2, "c overstates a step"),  # forced tokens' passes in it
    # a model whose weights sit in the last-level cache: its passes are not bound by reading them
    ({"draft_cost": 0.7, "weights_in_cache": [13 << 20, 32 << 20]}, 2,
     "the weights (13 MiB) fit in the CPU's last-level cache (32 MiB)"),
    ({"draft_cost": 0.7, "weights_in_cache": [13 << 20, 32 << 20]}, 2, "overlapped rounds (--overlap)"),
    ({"weights_in_cache": [13 << 20, 32 << 20]}, 2, "near the 0.45"),  # c as predicted: nothing to explain
    # overlapped rounds: most drafts ran beside a verification, so c is what a round pays, not a pass
    ({"draft_cost": 0.14, "verify_cost": 1.48, "drafted_ahead": 0.64}, 2,
     "c = 0.14 and v = 1.48 plain steps as a round pays them (the weights predict c = 0.45 for a pass "
     "alone): 64% of the rounds drafted beside the round before's verification"),
    ({"overhead": 0.2}, 3, "costs 0.20 plain steps a round (above 0.10)"),
    ({"verify_cost_long": 1.4}, 4, "long contexts erode the gain"),
    ({"draft_cost_long": None, "verify_cost_long": None}, 4, "not measured at 2048"),
    ({"speedups": {"early_exit": 0.8, "ngram": 0.95}}, 6, "nothing beats plain decoding"),
    ({"speedups": {"early_exit": 0.8, "ngram": 1.3}}, 6, "ngram is fastest at 1.30×"),
    ({"speedups": {"early_exit": 1.2}}, 6, "early_exit is fastest at 1.20× plain; copies"),  # alone
])
def test_each_check_flags_its_case(change, number, expected):
    assert expected in _check({**HEALTHY, **change}, number)
    assert "below the" not in _check({**HEALTHY, **change}, 1) or number == 1


def test_the_command_probes_and_writes_its_figures(tiny_run, tmp_path, capsys):
    out = tmp_path / "doctor"
    assert main(["doctor", str(tiny_run["model"]), "--exit-layer", "2", "--corpus", str(tiny_run["corpus"]),
                 "--num-prompts", "1", "--max-new-tokens", "8", "--context", "16", "--long-context", "64",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "selfspec doctor:" in printed and "6. verdict:" in printed
    result = json.loads((out / "doctor.json").read_text())
    assert_shape(result, DoctorResult)
    assert result["figures"]["k"] == 3 and result["figures"]["exit_layer"] == 2
    assert set(result["figures"]["speedups"]) == {"early_exit", "ngram", "hybrid"}
    assert result["diagnosis"] == diagnose(result["figures"])
    # c and v through the engine at both context lengths, printed as a table by length
    figures = result["figures"]
    assert [row["length"] for row in figures["round_costs"]] == [16, 64]
    assert figures["draft_cost_long"] == figures["round_costs"][1]["c"] > 0
    assert figures["verify_cost_long"] == pytest.approx(1 + 3 * figures["round_costs"][1]["s"])
    assert "a round's costs by context length" in printed and "| 64 |" in printed
    # a suite's first turns instead of the corpus (a chat suite goes through the chat template)
    assert main(["doctor", str(tiny_run["model"]), "--exit-layer", "2", "--suite", "stdlib",
                 "--num-prompts", "2", "--max-new-tokens", "8", "--context", "16", "--long-context", "64",
                 "--out", str(tmp_path / "suite")]) == 0
    assert "6. verdict:" in capsys.readouterr().out
    assert main(["doctor", str(tiny_run["model"]), "--context", "64", "--long-context", "16"]) == 2
    assert "--context (64) < --long-context (16)" in capsys.readouterr().err


def test_the_prefill_check_shows_the_decoding_speedup_diluted_end_to_end():
    """A prefill of 30% of plain's time turns a decoding 2× faster into 1 / (0.3 + 0.7 / 2) = 1.54×
    end to end; below `PREFILL_SHARE` the check says nothing."""
    from selfspec.evaluation.diagnosis import PREFILL_SHARE, cost_figures, diagnose

    split = {"plain": {"share": 0.3, "decode_tokens_per_second": 10.0, "decode_over_plain": 1.0},
             "ngram": {"share": 0.46, "decode_tokens_per_second": 20.0, "decode_over_plain": 2.0}}
    lines = diagnose(cost_figures({}, {"ngram": 1.54}, None, prefill=split))
    assert [line[:10] for line in lines] == ["5. prefill", "6. verdict"]
    assert "takes 30% of plain" in lines[0] and "(2.00× plain after the prefill) shows as 1.54×" in lines[0]
    split["plain"]["share"] = PREFILL_SHARE / 2
    assert [line[:10] for line in diagnose(cost_figures({}, {"ngram": 1.54}, None, prefill=split))] == [
        "6. verdict"]
