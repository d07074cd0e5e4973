"""The embedded default end to end, shrunk: real stdlib corpus and tokenizer, a few steps of each stage.

Slow (minutes): run with `python -m pytest -m slow`.
"""

import pytest

from selfspec import load_tuned
from selfspec.checkpoint import read_meta
from selfspec.config import load_config
from selfspec.files import cache_dir
from selfspec.training.loop import train_or_reuse

pytestmark = pytest.mark.slow


def test_embedded_pipeline_pretrain_finetune_generate(tmp_path):
    data = str(cache_dir())  # the real corpus and tokenizer, built once in the user cache and reused
    base_cfg = load_config("embedded_base", [
        f"data.cache_dir={data}", f"output_dir={tmp_path}/base", "model.arch.num_layers=4",
        "optim.max_steps=6", "optim.batch_size=4", "eval_every=0", "save_every=0", "data.max_eval_blocks=4"])
    base_dir, reused = train_or_reuse(base_cfg, kind="base", progress=False)
    assert not reused
    assert train_or_reuse(base_cfg, kind="base", progress=False) == (base_dir, True)  # cached

    tune_cfg = load_config("demo_finetune", [
        f"model.name_or_path={base_dir}", f"data.cache_dir={data}", f"output_dir={tmp_path}/tuned",
        "early_exit.layers=1:4", "exit_layer=2", "optim.max_steps=4", "optim.batch_size=4", "eval_every=2",
        "save_every=0", "data.max_eval_blocks=4"])
    tuned_dir, _ = train_or_reuse(tune_cfg, kind="tuned", progress=False)
    meta = read_meta(tuned_dir)
    assert meta["exit_layer"] == 2 and meta["metrics"]["steps"] == 4

    gen = load_tuned(tuned_dir, num_speculations=3)
    prompt = "def read_config(path):\n    "
    fast = gen.generate([prompt], max_new_tokens=24, eos_token_id=[])
    plain = gen.generate([prompt], max_new_tokens=24, num_speculations=0, eos_token_id=[])
    assert fast.sequences == plain.sequences and len(fast.sequences[0]) == 24
    assert fast.stats.rounds < 24  # drafts were accepted, not only corrections


@pytest.fixture
def chat_base(tiny_run, tmp_path):
    """The tiny model with a chat template, as an imported base: a directory of model and tokenizer."""
    from helpers import CHATML
    from transformers import AutoModelForCausalLM

    tokenizer = type(tiny_run["tokenizer"]).from_pretrained(tiny_run["model"])
    tokenizer.chat_template = CHATML
    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    model.config.max_position_embeddings = 1024  # the extraction prompts run to ~250 of its tokens
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def test_the_json_demo_distills_trains_gates_sweeps_and_measures(chat_base, tmp_path, capsys):
    """`selfspec demo --json` shrunk onto the tiny chat model: the model's own constrained replies, the
    recipe's exit block on them (the model frozen: the gate moves 0.0), a sweep that stores the JSON
    format's fastest drafter, and both benchmarks, every output identical to constrained plain."""
    import json

    from selfspec import demo, recipes

    # 200 replies: the held-out splits (2% each, by id) get two conversations each, a block of 256

    recipe = tmp_path / "json.yaml"
    recipe.write_text(f"base: {recipes.find('smollm2-135m_json')}\n" + "\n".join([
        f"model: {{name_or_path: {chat_base}}}",
        f"data: {{source: {tmp_path}/distill/responses.jsonl, cache_dir: {tmp_path}/cache, block_size: 256, "
        "max_train_blocks: null, max_eval_blocks: 2, keep_truncated: true}",  # 48-token replies: all cut
        "early_exit: {layers: 2, draft_vocab_size: 64}",
        "optim: {max_steps: 3, warmup_steps: 1, batch_size: 2}",
        "adapter_init_layer: 3", "exit_layer: 2", "eval_every: 0", "save_every: 0",
        f"output_dir: {tmp_path}/json"]) + "\n")
    passed = demo.demo_json(finetune_config=str(recipe), limit=200, reply_tokens=48, num_prompts=2,
                            max_new_tokens=24, repeats=1)
    out = tmp_path / "json"
    assert passed and json.loads((out / "gate.json").read_text())["relative_change"] == 0.0
    assert read_meta(out / "model")["metrics"]["steps"] == 3
    # The sweep stores the format's pick exactly when a re-timed cell beat plain by more than its noise
    # (timing decides which, on a busy machine neither): never the checkpoint's own defaults.
    from selfspec.evaluation.paired import beats_plain

    sweep = json.loads((out / "sweep" / "sweep.json").read_text())
    meta = read_meta(out / "model")
    assert sweep["prompts_from"] == "json-extract" and sweep["all_identical_to_plain"]
    rows = sweep["confirmed"] or [e for e in (sweep["best"], *sweep["fastest_per_drafter"].values()) if e]
    assert ("json_schema" in meta.get("formats", {})) == any(beats_plain(row) for row in rows)
    assert "fastest" not in meta
    for bench in ("benchmark_untuned", "benchmark"):
        report = json.loads(next((out / bench).glob("*.json")).read_text())
        assert all(report["identical"].values()), bench
    assert "== 6/6" in capsys.readouterr().out
