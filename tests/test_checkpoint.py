"""Tuned checkpoints: atomic save, plain Hugging Face loading, selfspec.json errors."""

import json

import pytest
import torch
from helpers import tiny_model
from transformers import AutoModelForCausalLM

from selfspec.checkpoint import (
    CheckpointError,
    Provenance,
    draft_vocab,
    read_meta,
    read_token_counts,
    save_token_counts,
    save_tuned,
    update_meta,
)
from selfspec.decoding import DecodeSettings


def test_save_writes_safetensors_meta_and_loads_with_auto_model(tmp_path):
    model = tiny_model("qwen3")
    path = save_tuned(tmp_path / "ckpt", model, settings=DecodeSettings(exit_layer=2, num_speculations=5),
                      provenance=Provenance(base_model="base", training={"seed": 1},
                                            metrics={"val/loss": 1.5}))
    assert (path / "model.safetensors").is_file()
    meta = read_meta(path)
    assert meta["exit_layer"] == 2 and meta["num_speculations"] == 5 and meta["base_model"] == "base"
    assert meta["training"] == {"seed": 1} and meta["metrics"] == {"val/loss": 1.5}
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_failed_save_leaves_the_previous_checkpoint_intact(tmp_path):
    model = tiny_model("llama")
    path = save_tuned(tmp_path / "ckpt", model, settings=DecodeSettings(exit_layer=2))
    before = (path / "model.safetensors").read_bytes()

    def disk_full(*args, **kwargs):
        raise RuntimeError("disk full")

    model.save_pretrained = disk_full
    with pytest.raises(RuntimeError, match="disk full"):
        save_tuned(path, model, settings=DecodeSettings(exit_layer=2))
    assert (path / "model.safetensors").read_bytes() == before
    assert read_meta(path)["exit_layer"] == 2
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_exit_layer_outside_the_model_is_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="exit_layer = 9 is outside 1..4"):
        save_tuned(tmp_path / "x", tiny_model("llama"), settings=DecodeSettings(exit_layer=9))
    assert not (tmp_path / "x").exists()


def test_meta_errors_say_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match="has no selfspec.json"):
        read_meta(tmp_path)
    (tmp_path / "selfspec.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_meta(tmp_path)
    (tmp_path / "selfspec.json").write_text(json.dumps({"format_version": 99, "exit_layer": 1}))
    with pytest.raises(CheckpointError, match="format_version 99"):
        read_meta(tmp_path)


def test_update_meta_merges_fields(tmp_path):
    path = save_tuned(tmp_path / "ckpt", tiny_model("gpt2"), settings=DecodeSettings(exit_layer=1))
    update_meta(path, exit_layer=3, num_speculations=6)
    meta = read_meta(path)
    assert (meta["exit_layer"], meta["num_speculations"], meta["kind"]) == (3, 6, "tuned")


def test_pickled_weights_are_refused_with_the_fix(tmp_path):
    from selfspec.model.loading import ModelLoadError, load_causal_lm

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # a pickle: loading it could run code
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError,
                       match="holds no .safetensors weights; selfspec loads no pickled weights"):
        load_causal_lm(str(tmp_path))


def test_truncated_safetensors_is_a_one_line_error(tmp_path):
    from selfspec import load_tuned

    path = save_tuned(tmp_path / "ckpt", tiny_model("llama"), settings=DecodeSettings(exit_layer=2))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    from selfspec.model.loading import ModelLoadError

    with pytest.raises(ModelLoadError,
                       match="are damaged .*invalid header length.*; save or download the model again"):
        load_tuned(path)


def test_token_counts_round_trip_and_rank_the_draft_vocabulary(tmp_path):
    import numpy as np

    model = tiny_model("llama")
    path = save_tuned(tmp_path / "ckpt", model, settings=DecodeSettings(exit_layer=2))
    assert read_token_counts(path) is None and draft_vocab(path, None) is None
    with pytest.raises(CheckpointError,
                       match="draft_vocab_size = 8 needs token_counts.safetensors.*selfspec draft-vocab"):
        draft_vocab(path, 8)
    counts = np.arange(96)
    summary = save_token_counts(path, counts, "a corpus")
    assert summary == {"source": "a corpus", "tokens": int(counts.sum()), "vocab_size": 96}
    assert read_meta(path)["token_counts"] == summary
    assert np.array_equal(read_token_counts(path), counts)
    assert draft_vocab(path, 3).tolist() == [95, 94, 93]
    with pytest.raises(CheckpointError, match="non-empty 1-D array of counts >= 0"):
        save_token_counts(path, [-1, 2])
    (path / "token_counts.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="is damaged.*selfspec draft-vocab"):
        read_token_counts(path)
    assert not [p.name for p in path.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_fastest_entries_a_sweep_wrote_before_decode_settings_still_read(tmp_path):
    """Flat entries (drafter, exit_layer, num_speculations, vocab, min_ngram) from earlier sweeps."""
    from selfspec import load_tuned
    from selfspec.checkpoint import fastest_settings, resolve_settings

    path = save_tuned(tmp_path / "ckpt", tiny_model("llama"), token_counts=[1] * 96,
                      settings=DecodeSettings(exit_layer=2, num_speculations=3))
    update_meta(path, fastest={
        "early_exit": {"drafter": "early_exit", "exit_layer": 3, "num_speculations": 4, "vocab": 64,
                       "min_ngram": 0, "speedup": 1.2, "tokens_per_second": 10.0},
        "ngram": {"drafter": "ngram", "exit_layer": 0, "num_speculations": 0, "vocab": 0, "min_ngram": 1,
                  "speedup": 1.1, "tokens_per_second": 9.0}})
    fastest = fastest_settings(path)
    assert fastest["early_exit"] == DecodeSettings(exit_layer=3, num_speculations=4, draft_vocab_size=64)
    assert fastest["ngram"] == DecodeSettings("ngram", 2, 3).override(min_ngram=1)  # the checkpoint's E and k
    assert resolve_settings(path)[1] == fastest
    update_meta(path, fastest={"early_exit": "fast"})
    with pytest.raises(CheckpointError, match="bad \"fastest\" entry"):
        fastest_settings(path)
    with pytest.raises(CheckpointError, match="settings must be a DecodeSettings"):
        load_tuned(path, "cpu", "auto", 6)


def test_a_plain_hugging_face_model_loads_and_decodes_with_copies_unless_told(tiny_run, tmp_path, recwarn):
    """A directory without selfspec.json (a model the user already has): copies by default, said once;
    the keywords choose the early exit; the output is plain greedy's either way."""
    import selfspec
    from selfspec import load_tuned

    plain_dir = tmp_path / "hf"
    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    model.save_pretrained(plain_dir)
    tiny_run["tokenizer"].save_pretrained(plain_dir)
    gen = load_tuned(plain_dir)
    assert [str(w.message) for w in recwarn].count(
        f"{plain_dir} has no selfspec.json (not tuned by selfspec): decoding with copies from the context; "
        f"pass exit_layer=E to draft with the early exit") == 1
    assert gen.settings.drafter == "ngram" and gen.view.device.type == ("cuda" if torch.cuda.is_available()
                                                                          else "cpu")
    recwarn.clear()
    early = load_tuned(plain_dir, exit_layer=2, num_speculations=3)
    assert not recwarn.list and early.settings == DecodeSettings(exit_layer=2, num_speculations=3)
    prompt = ["def f(x):\n    return x + x"]
    plain = early.generate(prompt, max_new_tokens=12, num_speculations=0, eos_token_id=[])
    assert gen.generate(prompt, max_new_tokens=12, eos_token_id=[]).sequences == plain.sequences
    assert early.generate(prompt, max_new_tokens=12, eos_token_id=[]).sequences == plain.sequences
    with pytest.raises(CheckpointError, match="draft_vocab_size = 8 needs token_counts"):
        load_tuned(plain_dir, exit_layer=2, draft_vocab_size=8)
    assert {"DecodeSettings", "GenerationOutput", "SelfSpecGenerator", "load_tuned"} <= set(selfspec.__all__)


def test_chat_applies_the_template_and_answers_each_conversation(tiny_run):
    from helpers import CHATML

    from selfspec import SelfSpecGenerator
    from selfspec.errors import UserError

    tokenizer = type(tiny_run["tokenizer"]).from_pretrained(tiny_run["model"])
    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"]).eval()
    with pytest.raises(UserError, match="chat needs a tokenizer with a chat template"):
        SelfSpecGenerator(model, tokenizer, exit_layer=2).chat([{"role": "user", "content": "hi"}])
    tokenizer.chat_template = CHATML
    gen = SelfSpecGenerator(model, tokenizer, exit_layer=2, num_speculations=2)
    talk = [{"role": "user", "content": "def f(x):"}]
    longer = talk + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    out = gen.chat([talk, longer], max_new_tokens=6, eos_token_id=[])
    text = tokenizer.apply_chat_template(talk, tokenize=False, add_generation_prompt=True)
    direct = gen.generate([tokenizer(text, add_special_tokens=False)["input_ids"]], max_new_tokens=6,
                          eos_token_id=[])
    assert out.sequences[0] == direct.sequences[0] and len(out.sequences) == 2
    assert out.texts[0] == tokenizer.decode(direct.sequences[0], skip_special_tokens=True)
    assert gen.chat(talk, max_new_tokens=6, eos_token_id=[]).sequences == [direct.sequences[0]]


def test_models_load_without_hub_kernels(tmp_path):
    """transformers 5 kernelizes every model with hub code when `kernels` is installed (a dependency of
    transformers): on CUDA `model.train()` then fetches kernels at run time, failing offline (seen on the
    lent H200). selfspec's loads switch it off; Hugging Face's default keeps it on where `kernels` is."""
    from selfspec.model.loading import load_causal_lm
    tiny_model("llama").save_pretrained(tmp_path)
    assert load_causal_lm(str(tmp_path)).use_kernels is False
    hub_default = AutoModelForCausalLM.from_pretrained(tmp_path).use_kernels
    assert hub_default is _kernels_installed()


def _kernels_installed() -> bool:
    from transformers.utils import is_kernels_available
    return bool(is_kernels_available())
