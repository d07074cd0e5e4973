"""`selfspec eval roofline`: the bytes each pass reads, passes that leave the context as they found
it, and the report files. (Times are measured, never asserted.)"""

import json

import pytest
from helpers import assert_shape, tiny_model

from selfspec.cli import main
from selfspec.evaluation.results import RooflineReport
from selfspec.evaluation.roofline import kv_bytes_per_layer, pass_bytes
from selfspec.evaluation.timing import Passes, measure_passes
from selfspec.model.view import DecoderView


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_a_pass_reads_its_blocks_the_head_and_their_kv_cache(family):
    model = tiny_model(family, num_layers=4)
    view = DecoderView(model)
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert kv_bytes_per_layer(view, 10) == 2 * heads * head_dim * 10 * 4  # keys + values, fp32
    blocks = sum(p.numel() for i in (1, 2, 3) for p in view.layers[i].parameters()) * 4
    head = sum(p.numel() for p in (*view.final_norm.parameters(), *view.lm_head.parameters())) * 4
    assert pass_bytes(view, 1, 4, 10) == blocks + head + 3 * kv_bytes_per_layer(view, 10)


def test_every_pass_sees_the_same_context():
    model = tiny_model("llama", num_layers=4)
    view = DecoderView(model)
    passes = Passes(view, context=12, max_positions=5)
    passes.run(2, 4, 5)
    assert (passes.cache.lengths == 12).all()
    report = measure_passes(view, exit_layer=2, context=12, positions=(1, 3), repeats=2, warmup=1)
    assert list(report) == ["plain", "draft", "verify_1", "verify_3", "full_3"]
    assert report["verify_3"]["blocks"] == [2, 4] and report["verify_3"]["positions"] == 3
    assert all(row["seconds"] > 0 for row in report.values())


def test_the_command_writes_its_table_and_plot(tiny_run, tmp_path, capsys):
    out = tmp_path / "roofline"
    assert main(["eval", "roofline", "--model", str(tiny_run["model"]), "--exit-layer", "2",
                 "--context", "16", "--max-positions", "3", "--repeats", "2", "--warmup", "1",
                 "--num-speculations", "3", "--corpus", str(tiny_run["corpus"]), "--num-prompts", "2",
                 "--max-new-tokens", "12", "--profile-repeats", "1", "--out", str(out)]) == 0
    report = json.loads((out / "roofline.json").read_text())
    assert_shape(report, RooflineReport)
    assert report["bandwidth"]["read_bytes_per_second"] > 0
    assert report["passes"]["plain"]["plain_steps"] == 1.0
    markdown = (out / "roofline.md").read_text()
    assert "| verify_3 | [2, 4) | 3 |" in markdown
    # the round profile: plain's round is the plain step; the early exit drafts 3 per round
    profile = report["round_profile"]
    assert profile["settings"]["num_speculations"] == 3 and profile["settings"]["exit_layer"] == 2
    plain, early_exit = profile["methods"]["plain"], profile["methods"]["early_exit"]
    assert plain["plain_steps"]["round"] == pytest.approx(1.0)
    assert plain["parts"]["draft passes"] == 0 and plain["draft_steps_per_round"] == 0
    assert plain["tokens_per_round"] == 1.0 and plain["rounds"] == 2 * 12
    assert early_exit["draft_steps_per_round"] == pytest.approx(3.0)
    assert early_exit["parts"]["draft passes"] > 0
    assert early_exit["round"] == pytest.approx(sum(early_exit["parts"].values()))
    assert "| draft passes (pass) |" in markdown and "| after the drafts (v) |" in markdown
    assert (out / "roofline.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "roofline", "--model", str(tiny_run["model"]), "--exit-layer", "4"]) == 2
    assert "--exit-layer 4 is not in 1..3" in capsys.readouterr().err
