"""Bad input gets a clear answer: one line that names the problem and the fix, a non-zero exit, no
traceback, and nothing written. Across the CLI, the recipes and the Python API.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_model
from transformers import AutoModelForCausalLM

from selfspec.checkpoint import save_tuned
from selfspec.cli import main
from selfspec.config import ConfigError
from selfspec.decoding import DecodeSettings, SelfSpecGenerator
from selfspec.training.loop import train


@pytest.fixture
def ckpt(tiny_run, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    return save_tuned(tmp_path / "tuned", model, tiny_run["tokenizer"],
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))


def one_error_line(capsys) -> str:
    """The CLI's error line; fails if there is a traceback or more than one error line."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def files_under(path) -> set:
    return {p.relative_to(path) for p in path.rglob("*")}


# --------------------------------------------------------------------------------------------------
# The command line: exit status 2, one line
# --------------------------------------------------------------------------------------------------

CLI_CASES = [
    (["generate", "{ckpt}", "def f():", "--exit-layer", "0"], "exit_layer must be an int >= 1"),
    (["generate", "{ckpt}", "def f():", "--exit-layer", "9"], "exit_layer must be an int in 1..4"),
    (["generate", "{ckpt}", "def f():", "--num-speculations", "-2"],
     "pass an integer k >= 0, auto or window"),
    (["generate", "{ckpt}", "def f():", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "{ckpt}", "def f():", "--temperature", "1", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "{ckpt}", ""], "a prompt is empty; pass some text"),
    (["generate", "{ckpt}", "def f():", "--max-new-tokens", "400"], "exceeds the model's 256 positions"),
    (["generate", "{ckpt}", "--prompts", "{long_prompt}"],
     "exceeds the model's 256 positions; shorten the prompt"),
    (["generate", "{ckpt}", "--prompts", "{tmp}/none.txt"], "prompt file"),
    (["generate", "{tmp}/no-model", "x"], "no model at"),
    (["layers", "{tmp}/no-model"], "no model at"),
    (["eval", "gate", "--tuned", "{tmp}/no-model", "--base", "{ckpt}"], "no model at"),
    (["eval", "sweep", "--model", "{ckpt}", "--ks", "two"], "--ks must be a comma list of ints"),
    (["eval", "speedup", "--model", "{ckpt}", "--methods", "plain,fastest"], "unknown method 'fastest'"),
    (["import-gguf", "{tmp}/missing.gguf", "--out", "{tmp}/imported"], "does not exist"),
    (["generate", "{ckpt}", "def f():", "--draft-vocab-size", "64"],
     "draft_vocab_size = 64 needs token_counts.safetensors"),
    (["draft-vocab", "{tmp}/no-model"], "has no selfspec.json"),
    (["eval", "sweep", "--model", "{ckpt}", "--drafters", "early_exit,medusa"],
     "drafters ['medusa'] are not in"),
    (["eval", "sweep", "--model", "{ckpt}", "--drafters", "hybrid", "--min-ngrams", "0"], "min_ngram"),
    (["eval", "sweep", "--model", "{ckpt}", "--draft-vocab-sizes", "0,64"],
     "needs the checkpoint's token counts"),
]


@pytest.mark.parametrize("argv, message", CLI_CASES, ids=[" ".join(a[:1] + a[2:4]) for a, _ in CLI_CASES])
def test_cli_bad_input(ckpt, tmp_path, capsys, argv, message):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("x = 1 " * 300 + "\n")
    before = files_under(tmp_path)
    args = [a.format(ckpt=ckpt, tmp=tmp_path, long_prompt=long_prompt) for a in argv]
    assert main(args) == 2
    assert message in one_error_line(capsys)
    assert files_under(tmp_path) == before  # nothing written


def test_corrupted_selfspec_json(ckpt, capsys):
    (ckpt / "selfspec.json").write_text('{"format_version": 1, "exit_layer": ')
    assert main(["generate", str(ckpt), "x"]) == 2
    assert "is not valid JSON" in one_error_line(capsys)


def test_truncated_weights(ckpt, capsys):
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    assert main(["generate", str(ckpt), "x"]) == 2
    assert "are damaged" in one_error_line(capsys)


def test_missing_tokenizer(tiny_run, tmp_path, capsys):
    bare = save_tuned(tmp_path / "bare", AutoModelForCausalLM.from_pretrained(tiny_run["model"]),
                      settings=DecodeSettings(exit_layer=2))
    assert main(["generate", str(bare), "x"]) == 2
    assert "has no tokenizer" in one_error_line(capsys)


def test_serve_without_its_extra_names_the_pip_command(ckpt, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed: importing it fails
    monkeypatch.delitem(sys.modules, "selfspec.serving.app", raising=False)
    assert main(["serve", str(ckpt)]) == 2
    assert "pip install 'selfspec[serve]'" in one_error_line(capsys)


@pytest.mark.parametrize("flags, named", [(["--rounds-per-call", "0"], "--rounds-per-call"),
                                          (["--draft-max-rows", "-1"], "--draft-max-rows")])
def test_serve_refuses_a_bad_scheduler_flag_before_it_loads(ckpt, flags, named, monkeypatch, capsys):
    import selfspec.checkpoint

    def never(*args, **kwargs):
        raise AssertionError("loaded the model")
    monkeypatch.setattr(selfspec.checkpoint, "load_tuned", never)
    assert main(["serve", str(ckpt), *flags]) == 2
    assert named in one_error_line(capsys)


# --------------------------------------------------------------------------------------------------
# Recipes: `selfspec train --config ... a.b=value` and the loop it runs
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--config", "my/missing.yaml"], "config 'my/missing.yaml' is neither a file nor a shipped recipe"),
    (["--config", "demo_finetun"], "did you mean demo_finetune?"),
    (["--config", "demo_finetune", "optim.lrr=1"], "did you mean 'optim.lr'"),
    (["--config", "demo_finetune", "optim.lr=-1"],
     "optim.lr = -1.0 is not allowed; it must be > 0"),
    (["--config", "demo_finetune", "exit_layer=0"], "exit_layer = 0 is not allowed"),
    (["--config", "demo_finetune", "trainable=some"], "choose one of 'all', 'draft', 'adapter'"),
    (["--config", "demo_finetune", "early_exit.layers=null", "choose_exit=true"],
     "it picks among the candidate exits: set early_exit.layers"),
    (["--config", "smollm2-135m_adapter", "layer_dropout.p_max=0.2"],
     "layer dropout would change"),
    (["--config", "smollm2-135m_adapter", "lora.enabled=true"], "a LoRA on them cannot train"),
    (["--config", "smollm2-135m_adapter", "early_exit.kind=ce"],
     "cached features hold the teacher, not the data's labels"),
    (["--config", "smollm2-135m_adapter", "adapter_kind=attention"],
     "choose one of 'mlp', 'block'"),
    (["--config", "smollm2-135m_adapter", "adapter_blocks=0"],
     "adapter_blocks = 0 is not allowed"),
    (["--config", "demo_finetune", "early_exit.draft_vocab_size=0"], "draft_vocab_size = 0"),
])
def test_recipe_config_mistakes_exit_with_one_line(monkeypatch, tmp_path, capsys, argv, message):
    monkeypatch.chdir(tmp_path)  # shipped recipes are found by name from any directory
    assert main(["train", *argv]) == 2
    assert message in one_error_line(capsys)
    assert not any(tmp_path.iterdir())  # nothing written


def run_config(tiny_run, out, *extra):
    from selfspec.config import load_config

    return load_config(None, [
        f"model.name_or_path={tiny_run['model']}", f"data.source={tiny_run['corpus']}",
        f"data.cache_dir={out}/cache", "data.block_size=32", "optim.batch_size=4", "optim.max_steps=1",
        f"output_dir={out}/run", "eval_every=0", "save_every=0", "exit_layer=2", *extra])


@pytest.mark.parametrize("extra, message", [
    (["data.source=./missing.jsonl"], "corpus path './missing.jsonl' does not exist"),
    (["data.block_size=1000"], "data.block_size = 1000 exceeds the model's 256 positions"),
    (["exit_layer=9"], "exit_layer = 9 is larger than the model's 4 layers"),
    (["early_exit.layers=7"], "early-exit layer must be an int in [1, 3]"),
    (["lora.enabled=true", "lora.target_modules=[qkv]"], "lora.target_modules ['qkv'] are not modules"),
])
def test_training_mistakes_are_value_errors_and_write_no_model(tiny_run, tmp_path, extra, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        train(run_config(tiny_run, tmp_path, *extra), progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run" / "model").exists()


def test_an_empty_data_set_is_named(tiny_run, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="too few to carve out|fewer than block_size"):
        train(run_config(tiny_run, tmp_path, f"data.source={empty}"), progress=False)


def test_resume_without_a_saved_state(tiny_run, tmp_path):
    with pytest.raises(ValueError, match="--resume: no saved state"):
        train(run_config(tiny_run, tmp_path), resume=True, progress=False)


# --------------------------------------------------------------------------------------------------
# The Python API
# --------------------------------------------------------------------------------------------------

def test_unsupported_architecture_lists_the_supported_ones():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match="model_type 'bloom' is not supported; supported families: llama"):
        SelfSpecGenerator(model, exit_layer=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"exit_layer": 0}, "exit_layer must be an int >= 1"),
    ({"exit_layer": 2, "num_speculations": -1}, "num_speculations -1 is not allowed; pass an integer k >= 0"),
])
def test_generator_arguments(kwargs, message):
    with pytest.raises((ValueError, ConfigError), match=message):
        SelfSpecGenerator(tiny_model("llama"), **kwargs)


def test_generate_arguments():
    gen = SelfSpecGenerator(tiny_model("llama"), exit_layer=2)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        gen.generate([[]])
    with pytest.raises(ValueError, match="string prompts need a tokenizer"):
        gen.generate("def f():")
    with pytest.raises(ValueError, match="top_p must be in"):
        gen.generate([[1, 2]], temperature=1.0, top_p=0)
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        gen.generate(torch.ones(1, 200, dtype=torch.long), max_new_tokens=100)
