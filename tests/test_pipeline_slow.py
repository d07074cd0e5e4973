"""The embedded default end to end, shrunk: real stdlib corpus and tokenizer, a few steps of each stage.

Slow (minutes): run with `python -m pytest -m slow`.
"""

import pytest

from selfspec import load_tuned
from selfspec.cache import cache_dir
from selfspec.checkpoint import read_meta
from selfspec.config import load_config
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
