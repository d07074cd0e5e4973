"""`selfspec export --draft`: a tuned exit as a standalone Hugging Face draft model, for every family the
adapter supports. Its logits are the exit's, exactly (fp32; selfspec's CPU kernels off, so both sides run
torch's operations in the same order), with and without an exit block; Hugging Face's assisted
generation with it equals Hugging Face's greedy; it loads with nothing of selfspec; what cannot be
exported is a one-line error."""

import filecmp
import json
import subprocess
import sys

import pytest
import torch
from helpers import FAMILIES, tiny_model
from test_decoding_grammar import tokenizer  # noqa: F401
from transformers import AutoModelForCausalLM

from selfspec import cli
from selfspec.checkpoint import save_tuned
from selfspec.decoding import DecodeSettings
from selfspec.errors import UserError
from selfspec.export import export_draft
from selfspec.model.exit_adapter import ExitAdapter, ExitBlock
from selfspec.model.fast import kernels_up_to
from selfspec.model.view import DecoderView

E = 2


def _tuned(tmp_path, family, adapter=None, with_tokenizer=None):
    vocab_size = len(with_tokenizer) if with_tokenizer is not None else 96
    model = tiny_model(family, vocab_size=vocab_size)
    if adapter == "block":
        adapter = ExitBlock.from_model(model, [3])
        with torch.no_grad():  # a trained block differs from the one it was copied from
            for p in adapter.parameters():
                p.add_(0.01 * torch.randn_like(p))
    elif adapter == "mlp":
        adapter = ExitAdapter(32, 64)
    save_tuned(tmp_path / "tuned", model, with_tokenizer, exit_adapter=adapter,
               settings=DecodeSettings(exit_layer=E, num_speculations=2))
    return model, adapter


def _exit_logits(model, adapter, ids):
    """selfspec's exit: blocks [0, E) as training runs them, the exit block if any, final norm, head."""
    view = DecoderView(model)
    hidden = view.embed(ids)
    context = view.context(hidden)
    for index in range(E):
        hidden = view.run_block(index, hidden, context)
    if adapter is not None:
        hidden = adapter(hidden, view, context)
    return view.exit_logits(hidden)


@pytest.mark.parametrize("adapter", [None, "block"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_draft_computes_the_exits_logits_and_assists_hugging_face_losslessly(tmp_path, family, adapter):
    model, block = _tuned(tmp_path, family, adapter)
    draft_dir = export_draft(tmp_path / "tuned", tmp_path / "draft")
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    assert draft.config.architectures == model.config.architectures or draft.config.architectures is None
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["vocab_size"] == model.config.vocab_size  # what vLLM's draft check compares
    assert config.get("num_hidden_layers", config.get("n_layer")) == E + (adapter is not None)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), kernels_up_to(None):
        assert torch.equal(draft(ids).logits, _exit_logits(model, block, ids))
        greedy = model.generate(ids[:1], max_new_tokens=16, do_sample=False, pad_token_id=0)
        assisted = model.generate(ids[:1], max_new_tokens=16, do_sample=False, pad_token_id=0,
                                  assistant_model=draft)
    assert torch.equal(assisted, greedy)


def test_the_tokenizer_is_copied_byte_for_byte_and_the_draft_loads_without_selfspec(tmp_path, tokenizer):  # noqa: F811
    _tuned(tmp_path, "llama", with_tokenizer=tokenizer)
    draft_dir = export_draft(tmp_path / "tuned", tmp_path / "draft")
    files = [f.name for f in (tmp_path / "tuned").iterdir() if f.name.startswith(("tokenizer", "special"))]
    assert "tokenizer.json" in files
    assert all(filecmp.cmp(tmp_path / "tuned" / f, draft_dir / f, shallow=False) for f in files)
    assert not (draft_dir / "selfspec.json").exists()
    path = repr(str(draft_dir))
    code = ("import sys; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            f"AutoModelForCausalLM.from_pretrained({path}); AutoTokenizer.from_pretrained({path}); "
            "assert not any(m.startswith('selfspec') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_what_cannot_be_exported_is_refused_in_one_line(tmp_path):
    _tuned(tmp_path, "llama", adapter="mlp")
    with pytest.raises(UserError, match="MLP .* no block of the model's family"):
        export_draft(tmp_path / "tuned", tmp_path / "draft")
    assert not (tmp_path / "draft").exists()
    with pytest.raises(UserError, match="exit layer must be an int in 1..4"):
        export_draft(tmp_path / "tuned", tmp_path / "draft", exit_layer=9)
    (tmp_path / "draft").mkdir()
    with pytest.raises(UserError, match="exists: pass --force"):
        export_draft(tmp_path / "tuned", tmp_path / "draft", exit_layer=3)


def test_the_command_writes_the_draft_and_says_what_it_is(tmp_path, capsys):
    _tuned(tmp_path, "qwen2")
    assert cli.main(["export", str(tmp_path / "tuned"), "--draft", str(tmp_path / "draft")]) == 0
    assert "a qwen2 draft of 2 blocks" in capsys.readouterr().out
    assert cli.main(["export", str(tmp_path / "tuned"), "--draft", str(tmp_path / "draft")]) == 2
    assert capsys.readouterr().err.strip().endswith("draft exists: pass --force to replace it")


WINDOWED = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)


@pytest.mark.parametrize("overrides", [dict(tie_word_embeddings=True), WINDOWED])
def test_tied_heads_and_per_layer_windows_export_as_they_decode(tmp_path, overrides):
    """A head tied to the embedding (Llama-3.2-1B's, SmolLM2's) and Qwen2's windows on some layers only."""
    family = "qwen2" if "sliding_window" in overrides else "llama"
    model = tiny_model(family, **overrides)
    if overrides.get("tie_word_embeddings"):
        model.tie_weights()
    save_tuned(tmp_path / "tuned", model, settings=DecodeSettings(exit_layer=E, num_speculations=2))
    draft = AutoModelForCausalLM.from_pretrained(export_draft(tmp_path / "tuned", tmp_path / "draft")).eval()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), kernels_up_to(None):
        assert torch.equal(draft(ids).logits, _exit_logits(model, None, ids))


def test_doctor_on_an_exported_draft_measures_its_acceptance_against_the_target(tmp_path, tokenizer,  # noqa: F811
                                                                                 capsys):
    """`selfspec doctor DRAFT`: α is the draft's top token against the target's greedy reply. A draft that
    is the whole model (E = 3 of 4 blocks, the exit block a copy of block 3) agrees on every token; two
    random blocks do not. The verdict follows α and the draft's cost in weights read."""
    from selfspec.evaluation.doctor import doctor
    from selfspec.evaluation.options import DoctorOptions

    model = tiny_model("llama", vocab_size=len(tokenizer))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):", "import os\n"]))
    alphas = {}
    for name, exit_layer, block in (("whole", 3, ExitBlock.from_model(model, [3])), ("half", 2, None)):
        save_tuned(tmp_path / name, model, tokenizer, exit_adapter=block,
                   settings=DecodeSettings(exit_layer=exit_layer, num_speculations=2))
        draft = export_draft(tmp_path / name, tmp_path / f"{name}-draft")
        with kernels_up_to(None):
            result = doctor(DoctorOptions(model=str(draft), prompts=str(prompts), max_new_tokens=12,
                                          out=str(tmp_path / f"{name}-doctor")))
        figures = result["figures"]
        assert figures["tokens"] == 24 and figures["exit_layer"] == exit_layer
        assert json.loads((tmp_path / f"{name}-doctor" / "doctor.json").read_text())["figures"] == figures
        alphas[name] = figures["alpha"]
        if figures["num_speculations"]:
            assert figures["predicted_speedup"] > 1 and "verdict: up to" in result["diagnosis"][-1]
        else:
            assert "no k beats plain decoding" in result["diagnosis"][-1]
    assert alphas["whole"] == 1.0 and alphas["half"] < 1.0
    assert "acceptance: α = 1.000 over 24" in capsys.readouterr().out
