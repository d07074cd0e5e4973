"""Write a Hugging Face causal LM as a GGUF file that llama.cpp reads: `selfspec export --gguf`.

llama.cpp's own converter (`convert_hf_to_gguf.py`) recognises a BPE tokenizer by hashing how it
splits a test string against a table of known models, so it refuses selfspec's embedded tokenizer (its
own byte-level BPE, trained on the Python stdlib). This writer uses the `gguf` package's writer and
reads the tokenizer's pre-tokenizer from its tokenizer.json instead: a byte-level BPE whose splitting
is one llama.cpp implements (GPT-2's regex: the embedded tokenizer and SmolLM2's as transformers
imports it; GPT-2's with single digits: SmolLM2's own) is written with that name, anything else is
refused rather than written to tokenize differently in llama.cpp than in selfspec.

A draft and its target written here hold the same tokenizer metadata (the same tokens, types, merges,
BOS/EOS), which is what llama.cpp checks before it drafts with one for the other.

Families: Llama (and Mistral without a sliding window), Qwen2 (without its windows) and Qwen3, the
ones whose llama.cpp architecture has exactly the blocks transformers runs. Llama's query and key rows
are permuted from transformers' rotate-half rotary order into llama.cpp's interleaved one, as llama.cpp's
converter does. Norms and biases stay f32 at every type, as in llama.cpp's converter; at q8_0 a matrix
whose rows are not whole 32-value blocks stays f32.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from .errors import UserError

GGUF_TYPES = ("f32", "bf16", "q8_0")

# transformers model_type -> llama.cpp architecture with the same blocks
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# A tokenizer.json pre-tokenizer, summarised, -> the llama.cpp pre-tokenizer that splits text the same way
_GPT2 = (("ByteLevel", True),)
_PRE_TOKENIZERS = {_GPT2: "gpt-2", (("Digits", True), ("ByteLevel", True)): "smollm"}


def gguf_file_name(role: str, gguf_type: str) -> str:
    """The file name an export gives a GGUF: `draft-q8_0.gguf`, `target-f32.gguf`."""
    return f"{role}-{gguf_type}.gguf"


def check_gguf_exportable(model, tokenizer_dir: str | Path, gguf_type: str) -> None:
    """Raise a one-line UserError if `model` with the tokenizer in `tokenizer_dir` cannot be written as
    GGUF for llama.cpp at `gguf_type`; before anything is written, so a refusal leaves no files."""
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    if importlib.util.find_spec("gguf") is None:
        raise UserError("writing GGUF files needs the gguf package: pip install 'selfspec[gguf]' "
                        "(or pip install gguf)")
    config = model.config
    family = config.model_type
    if family not in _ARCHITECTURES:
        raise UserError(f"selfspec writes GGUF for {', '.join(_ARCHITECTURES)} models, not {family}: export "
                        f"without --gguf and convert the draft with llama.cpp's convert_hf_to_gguf.py")
    window = getattr(config, "sliding_window", None)
    if window and (family == "mistral" or getattr(config, "use_sliding_window", False)):
        raise UserError(f"this {family} model attends through a sliding window of {window} tokens, which "
                        f"llama.cpp's {_ARCHITECTURES[family]} architecture does not: no GGUF export for it")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling not in ("default", None):
        raise UserError(f"this model scales its rotary embedding ({scaling}), "
                        f"which selfspec's GGUF writer does not carry: export without --gguf and "
                        f"convert with llama.cpp's convert_hf_to_gguf.py")
    if getattr(config, "mlp_bias", False) or (family != "qwen2" and getattr(config, "attention_bias", False)):
        raise UserError(f"this {family} model has biases its llama.cpp architecture does not load: "
                        f"no GGUF export for it")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"this model's MLP uses {config.hidden_act}, llama.cpp's {family} uses silu: "
                        f"no GGUF export for it")
    _tokenizer_metadata(Path(tokenizer_dir), config.vocab_size)


def write_gguf(model, tokenizer_dir: str | Path, path: str | Path, gguf_type: str = "f32",
               name: str | None = None) -> Path:
    """Write `model` (a transformers causal LM of a family `check_gguf_exportable` accepts) with the
    tokenizer in `tokenizer_dir` to the GGUF file `path`, its matrices at `gguf_type`; returns `path`.

    The caller makes the write atomic (selfspec export writes into a staging directory)."""
    import gguf

    check_gguf_exportable(model, tokenizer_dir, gguf_type)
    config = model.config
    arch = _ARCHITECTURES[config.model_type]
    layers = config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or Path(path).stem)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, _tokenizer_metadata(Path(tokenizer_dir), config.vocab_size))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for key, tensor in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue  # llama.cpp reads a missing output.weight as the embedding, as the tied head is
        mapped = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if mapped is None:  # an unknown weight: better no file than one that computes something else
            raise UserError(f"cannot write {key} of this {config.model_type} model as GGUF: "
                            f"llama.cpp has no name for it")
        data = tensor.detach().float().cpu().numpy()
        if arch == "llama" and mapped.endswith(("attn_q.weight", "attn_q.bias")):
            data = permute_rotary(data, heads)
        elif arch == "llama" and mapped.endswith(("attn_k.weight", "attn_k.bias")):
            data = permute_rotary(data, kv_heads)
        _add_tensor(writer, mapped, data, gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a query/key projection from transformers' rotate-half order (each head's first half of
    dimensions, then its second) into llama.cpp's interleaved pairs, as its converter permutes them."""
    head_dim = weight.shape[0] // heads
    return (weight.reshape(heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape))


def _add_tensor(writer, name: str, data: np.ndarray, gguf_type: str) -> None:
    from gguf import GGMLQuantizationType, quants

    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.ndim == 1 or gguf_type == "f32" or (gguf_type == "q8_0" and data.shape[-1] % 32):
        writer.add_tensor(name, data)
        return
    qtype = GGMLQuantizationType.BF16 if gguf_type == "bf16" else GGMLQuantizationType.Q8_0
    writer.add_tensor(name, quants.quantize(data, qtype), raw_dtype=qtype)


def _tokenizer_metadata(tokenizer_dir: Path, vocab_size: int) -> dict:
    """The tokenizer as llama.cpp's `tokenizer.ggml.*` fields (a dict), or a UserError naming why not."""
    from gguf import TokenType
    from transformers import AutoTokenizer

    file = tokenizer_dir / "tokenizer.json"
    if not file.is_file():
        raise UserError(f"no tokenizer.json in {tokenizer_dir}: GGUF export needs the model's fast "
                        f"(tokenizers) tokenizer saved with it")
    spec = json.loads(file.read_text())
    model = spec.get("model") or {}
    decoder = spec.get("decoder") or {}
    if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel" or spec.get("normalizer"):
        raise UserError("selfspec writes GGUF for byte-level BPE tokenizers without a normalizer (GPT-2's "
                        "kind); this one is not: export without --gguf and convert with llama.cpp's "
                        "convert_hf_to_gguf.py")
    pre = _PRE_TOKENIZERS.get(_summary(spec.get("pre_tokenizer")))
    if pre is None:
        raise UserError(f"llama.cpp has no pre-tokenizer known to split text as this tokenizer's "
                        f"{json.dumps(spec.get('pre_tokenizer'))[:120]} does: no GGUF export for it")
    tokens: dict[int, str] = {index: text for text, index in model["vocab"].items()}
    kinds = {index: TokenType.NORMAL for index in tokens}
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        kinds[added["id"]] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    if max(tokens) >= vocab_size:
        raise UserError(f"the tokenizer has ids up to {max(tokens)}, past the model's {vocab_size}-row "
                        f"embedding: the tokenizer in {tokenizer_dir} is not this model's")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    # whether encoding adds BOS/EOS, read off the tokenizer selfspec uses, so llama.cpp tokenizes alike
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    special = tokenizer("a")["input_ids"]
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return {
        "pre": pre,
        # rows of the embedding no token uses (a vocabulary padded to a multiple) get a placeholder text
        "tokens": [tokens.get(i, f"[PAD{i}]") for i in range(vocab_size)],
        "types": [int(kinds.get(i, TokenType.UNUSED)) for i in range(vocab_size)],
        "merges": merges,
        "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
        "unk": tokenizer.unk_token_id, "pad": tokenizer.pad_token_id,
        "add_bos": len(special) > len(plain) and special[0] == tokenizer.bos_token_id,
        "add_eos": len(special) > len(plain) and special[-1] == tokenizer.eos_token_id,
        "chat_template": template,
    }


def _summary(pre: dict | None) -> tuple:
    """A pre-tokenizer's parts as far as splitting goes (ByteLevel's regex on or off, Digits' kind)."""
    if not pre:
        return ()
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    summary = []
    for part in parts:
        kind = part.get("type")
        if kind == "ByteLevel":
            if part.get("add_prefix_space"):
                return (("ByteLevel-prefix-space",),)  # llama.cpp's byte-level BPE adds no prefix space
            summary.append((kind, part.get("use_regex", True)))
        elif kind == "Digits":
            summary.append((kind, part.get("individual_digits", False)))
        else:
            summary.append((kind, json.dumps(part, sort_keys=True)))
    return tuple(summary)


def _add_tokenizer(writer, meta: dict) -> None:
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    writer.add_token_merges(meta["merges"])
    for key in ("bos", "eos", "unk", "pad"):
        if meta[key] is not None:
            getattr(writer, f"add_{key}_token_id")(meta[key])
    writer.add_add_bos_token(bool(meta["add_bos"]))
    writer.add_add_eos_token(bool(meta["add_eos"]))
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])


__all__ = ["GGUF_TYPES", "check_gguf_exportable", "gguf_file_name", "permute_rotary", "write_gguf"]
