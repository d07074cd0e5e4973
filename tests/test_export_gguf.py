"""`selfspec export --gguf`: the draft and the whole tuned model as GGUF files llama.cpp reads.

Read back with the `gguf` package's reader: the tensors llama.cpp's architecture names, at the
checkpoint's shapes and (f32) values (Llama's query/key rows in llama.cpp's rotary order), E blocks plus
the exit block, and one tokenizer in both files. When tools/build_llama_cpp.py has built llama.cpp, it
loads them: it tokenizes as the checkpoint's tokenizer does, decodes greedily as transformers does, and
its decoding with the draft equals its decoding without.
"""

import importlib.util
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants
from helpers import tiny_model

from selfspec import cli
from selfspec.checkpoint import Provenance, save_tuned
from selfspec.decoding import DecodeSettings
from selfspec.errors import UserError
from selfspec.export import export_draft
from selfspec.export_gguf import permute_rotary
from selfspec.model.exit_adapter import ExitBlock

REPO = Path(__file__).resolve().parents[1]
E = 2
GGUF_FAMILIES = ("llama", "qwen2", "qwen3")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tuned(root: Path, tokenizer, family: str = "llama", block: bool = False, **overrides):
    """A tiny tuned checkpoint with the project's tokenizer at `root/tuned`: (model, exit block or None)."""
    model = tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id, **overrides)
    adapter = None
    if block:
        adapter = ExitBlock.from_model(model, [3])
        with torch.no_grad():  # a trained block differs from the one it was copied from
            for p in adapter.parameters():
                p.add_(0.01 * torch.randn_like(p))
    save_tuned(root / "tuned", model, tokenizer, exit_adapter=adapter,
               settings=DecodeSettings(exit_layer=E, num_speculations=2))
    return model, adapter


def _fields(reader: GGUFReader, prefix: str) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(prefix)}


def _expected_tensors(model, adapter, layers: int) -> dict:
    """{GGUF name: f32 array} of the draft: blocks [0, E) of `model` then the exit block, norm, head."""
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    blocks = [model.model.layers[i] for i in range(E)] + (list(adapter.layers) if adapter else [])
    assert len(blocks) == layers
    names = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    expected = {"token_embd.weight": model.model.embed_tokens.weight,
                "output_norm.weight": model.model.norm.weight, "output.weight": model.lm_head.weight}
    for index, block in enumerate(blocks):
        for key, tensor in block.state_dict().items():
            expected[f"blk.{index}.{names[key]}"] = tensor
    expected = {k: v.detach().float().numpy() for k, v in expected.items()}
    for index in range(layers):  # llama.cpp's rotary order: what its converter writes
        for name, count in (("attn_q", heads), ("attn_k", kv_heads)):
            key = f"blk.{index}.{name}.weight"
            expected[key] = permute_rotary(expected[key], count)
    return expected


@pytest.mark.parametrize("block", [False, True])
def test_the_draft_and_target_files_hold_the_checkpoints_weights_and_one_tokenizer(tmp_path, tiny_run, block):
    tokenizer = tiny_run["tokenizer"]
    model, adapter = _tuned(tmp_path, tokenizer, block=block)
    out = export_draft(tmp_path / "tuned", tmp_path / "export", gguf_target=True)
    draft, target = GGUFReader(str(out / "draft-f32.gguf")), GGUFReader(str(out / "target-f32.gguf"))
    layers = E + block
    assert draft.fields["llama.block_count"].contents() == layers
    assert target.fields["llama.block_count"].contents() == 4
    tensors = {t.name: t for t in draft.tensors}
    expected = _expected_tensors(model, adapter, layers)
    assert set(tensors) == set(expected)
    for name, values in expected.items():
        assert tensors[name].tensor_type == GGMLQuantizationType.F32
        assert np.array_equal(np.asarray(tensors[name].data), values), name
    assert {t.name for t in target.tensors} == {n for n in expected if not n.startswith("blk.")} | {
        f"blk.{i}.{n.split('.', 2)[2]}" for i in range(4) for n in expected if n.startswith("blk.0.")}
    # what llama.cpp compares before it drafts with one model for the other: all of it identical
    assert _fields(draft, "tokenizer.") == _fields(target, "tokenizer.")
    tokens = _fields(draft, "tokenizer.")
    assert tokens["tokenizer.ggml.model"] == "gpt2" and tokens["tokenizer.ggml.pre"] == "gpt-2"
    vocab = tokenizer.get_vocab()
    assert tokens["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    assert tokens["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert tokens["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert tokens["tokenizer.ggml.add_bos_token"] is False
    assert tokens["tokenizer.ggml.token_type"][tokenizer.eos_token_id] == 3  # control: <|endoftext|>


def test_bf16_and_q8_0_round_within_their_precision_and_norms_stay_f32(tmp_path, tiny_run):
    model, _ = _tuned(tmp_path, tiny_run["tokenizer"])
    for kind, qtype, tolerance in (("bf16", GGMLQuantizationType.BF16, 1e-2),
                                   ("q8_0", GGMLQuantizationType.Q8_0, 2e-2)):
        out = export_draft(tmp_path / "tuned", tmp_path / kind, gguf=True, gguf_type=kind)
        assert not (out / f"target-{kind}.gguf").exists()
        tensors = {t.name: t for t in GGUFReader(str(out / f"draft-{kind}.gguf")).tensors}
        expected = _expected_tensors(model, None, E)
        for name, values in expected.items():
            tensor = tensors[name]
            if values.ndim == 1:
                assert tensor.tensor_type == GGMLQuantizationType.F32
                assert np.array_equal(np.asarray(tensor.data), values)
            else:
                assert tensor.tensor_type == qtype, name
                restored = quants.dequantize(tensor.data, qtype)
                assert np.abs(restored - values).max() <= tolerance * np.abs(values).max(), name


def test_a_tokenizer_that_splits_digits_is_written_as_smollms(tmp_path, tiny_run):
    """SmolLM2's own tokenizer.json: single digits, then GPT-2's byte-level regex."""
    _tuned(tmp_path, tiny_run["tokenizer"])
    spec = json.loads((tmp_path / "tuned" / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    (tmp_path / "tuned" / "tokenizer.json").write_text(json.dumps(spec))
    out = export_draft(tmp_path / "tuned", tmp_path / "export", gguf=True)
    assert GGUFReader(str(out / "draft-f32.gguf")).fields["tokenizer.ggml.pre"].contents() == "smollm"
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "tuned" / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="llama.cpp has no pre-tokenizer known to split text as"):
        export_draft(tmp_path / "tuned", tmp_path / "refused", gguf=True)
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("family, overrides, message", [
    ("gpt2", {}, "GGUF for llama, mistral, qwen2, qwen3 models, not gpt2: export without --gguf"),
    ("mistral", {}, "attends through a sliding window of 8 tokens"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     r"scales its rotary embedding \(linear\)"),
])
def test_what_llama_cpp_cannot_carry_is_refused_in_one_line_before_anything_is_written(
        tmp_path, tiny_run, family, overrides, message):
    _tuned(tmp_path, tiny_run["tokenizer"], family, **overrides)
    with pytest.raises(UserError, match=message) as error:
        export_draft(tmp_path / "tuned", tmp_path / "export", gguf=True)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "export").exists()
    with pytest.raises(UserError, match="--gguf-type must be one of f32, bf16, q8_0"):
        export_draft(tmp_path / "tuned", tmp_path / "export", gguf=True, gguf_type="q4_0")


def test_the_command_writes_the_files_and_names_them(tmp_path, tiny_run, capsys):
    _tuned(tmp_path, tiny_run["tokenizer"], "qwen3")
    args = ["export", str(tmp_path / "tuned"), "--draft", str(tmp_path / "export"), "--gguf-target",
            "--gguf-type", "q8_0"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert f"{tmp_path / 'export' / 'draft-q8_0.gguf'}: " in printed
    assert f"{tmp_path / 'export' / 'target-q8_0.gguf'}: " in printed
    reader = GGUFReader(str(tmp_path / "export" / "draft-q8_0.gguf"))
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= {t.name for t in reader.tensors}


def test_the_export_says_what_a_separate_draft_engine_should_get(tmp_path, tiny_run, capsys):
    """c from the weights each step reads (E blocks + exit block + head over N blocks + head, no KV
    reuse), α the held-out agreement at E, k and speedup the best of E(k, α) / (1 + k·c)."""
    from selfspec.metrics import speedup_simple

    tokenizer = tiny_run["tokenizer"]
    model = tiny_model("llama", vocab_size=len(tokenizer))
    adapter = ExitBlock.from_model(model, [3])
    save_tuned(tmp_path / "tuned", model, tokenizer, exit_adapter=adapter,
               provenance=Provenance(metrics={"val/top1_agreement@2": 0.9}),
               settings=DecodeSettings(exit_layer=E, num_speculations=2))
    assert cli.main(["export", str(tmp_path / "tuned"), "--draft", str(tmp_path / "export")]) == 0
    info = json.loads((tmp_path / "export" / "export.json").read_text())
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    head = model.lm_head.weight.numel()
    estimate = info["separate_draft"]
    assert estimate["draft_cost"] == pytest.approx((3 * block + head) / (4 * block + head))
    assert estimate["acceptance"] == 0.9 and info["exit_blocks"] == 1 and info["gguf"] == []
    k, cost = estimate["num_speculations"], estimate["draft_cost"]
    assert estimate["predicted_speedup"] == max(speedup_simple(j, 0.9, cost) for j in range(1, 9))
    assert estimate["predicted_speedup"] == speedup_simple(k, 0.9, cost) > 1
    assert f"expect up to {estimate['predicted_speedup']:.2f}x at k = {k}" in capsys.readouterr().out


# --- llama.cpp itself, when tools/build_llama_cpp.py has built it ------------------------------------

_build = _tool("build_llama_cpp")


@pytest.mark.parametrize("path, args, message", [
    ("", [], "build_llama_cpp: cmake not found; install it"),
    (None, ["--sdist", "missing.tar.gz"], "build_llama_cpp: --sdist missing.tar.gz is not a file"),
    (None, ["--print-dir"], "build_llama_cpp: no finished build of 0.3.36; run tools/build_llama_cpp.py"),
])
def test_the_build_script_says_in_one_line_what_is_missing(tmp_path, path, args, message):
    import os
    import subprocess
    import sys

    env = {**os.environ, "SELFSPEC_CACHE_DIR": str(tmp_path)}  # an empty cache: nothing built
    if path is not None:
        env["PATH"] = path
    result = subprocess.run([sys.executable, str(REPO / "tools" / "build_llama_cpp.py"), *args], env=env,
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == message or result.stderr.strip().startswith(message)
    assert "\n" not in result.stderr.strip()
needs_llama_cpp = pytest.mark.skipif(not _build.built(), reason="llama.cpp is not built: run "
                                     "python tools/build_llama_cpp.py (about 10-30 minutes)")


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation, no cache, no stop at EOS."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def _completion(client, server, prompt: list[int], steps: int) -> dict:
    body = {"prompt": prompt, "n_predict": steps, "temperature": 0, "ignore_eos": True, "return_tokens": True,
            "cache_prompt": False}
    response = client.post(f"{server.url}/completion", json=body)
    response.raise_for_status()
    return response.json()


@needs_llama_cpp
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_llama_cpp_decodes_as_transformers_and_its_draft_changes_no_token(tmp_path, tiny_run, family):
    import httpx
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_run["tokenizer"]
    model, _ = _tuned(tmp_path, tokenizer, family, block=True)
    out = export_draft(tmp_path / "tuned", tmp_path / "export", gguf_target=True)
    draft_model = AutoModelForCausalLM.from_pretrained(out).eval()
    compare = _tool("llamacpp_draft_compare")
    binary = _build.bin_dir() / "llama-server"
    speculative = ["--model-draft", str(out / "draft-f32.gguf"), "--spec-type", "draft-simple",
                   "--spec-draft-n-max", "3", "--spec-draft-n-min", "0"]
    servers = {"plain": (out / "target-f32.gguf", []), "drafted": (out / "target-f32.gguf", speculative),
               "draft": (out / "draft-f32.gguf", [])}
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[2000:2400]
    prompt = tokenizer(text)["input_ids"][:24]
    replies = {}
    with httpx.Client(timeout=120) as client:
        for name, (gguf, flags) in servers.items():
            with compare.LlamaServer(binary, gguf, flags, 1, 256, tmp_path / f"{name}.log", name) as server:
                replies[name] = _completion(client, server, prompt, 16)
                if name == "plain":  # llama.cpp splits text into the checkpoint's tokens
                    for sample in (text, "\tx = {'a': 1}  # ü\n\n  def f(self):\n", "  3.14e-5 ** 2!!\r\n"):
                        got = client.post(f"{server.url}/tokenize", json={"content": sample}).json()["tokens"]
                        assert got == tokenizer(sample, add_special_tokens=False)["input_ids"]
                log = server.log_text()
    assert replies["plain"]["tokens"] == _greedy(model, prompt, 16)
    assert replies["draft"]["tokens"] == _greedy(draft_model, prompt, 16)
    assert replies["drafted"]["tokens"] == replies["plain"]["tokens"]
    assert replies["drafted"]["timings"]["draft_n"] > 0, log  # it did draft, with the exported exit


@needs_llama_cpp
def test_the_comparison_tool_runs_every_configuration(tmp_path, tiny_run, monkeypatch, capsys):
    _tuned(tmp_path, tiny_run["tokenizer"])
    export_draft(tmp_path / "tuned", tmp_path / "export", gguf_target=True)
    compare = _tool("llamacpp_draft_compare")
    out = tmp_path / "compare.json"
    monkeypatch.setattr("sys.argv", ["llamacpp_draft_compare.py", "--export", str(tmp_path / "export"),
                                     "--prompts", "stdlib", "--requests", "2", "--max-tokens", "8",
                                     "--threads", "1", "--context", "512", "--logs", str(tmp_path / "logs"),
                                     "--json-out", str(out)])
    compare.main()
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["plain", "draft-k3", "ngram-simple", "ngram-mod"]
    assert summary["draft-k3"]["drafted"] > 0 and summary["draft-k3"]["acceptance"] is not None
    assert all(row["requests"] == 2 for row in summary.values())
    assert "| draft-k3 |" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "logs")
