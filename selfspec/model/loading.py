"""Creating and loading Hugging Face causal LMs and tokenizers, with clear errors for bad paths."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ..errors import UserError
from .pages import onto_huge_pages

if TYPE_CHECKING:
    from ..config import ArchConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(UserError):
    """A model or tokenizer path that cannot be loaded; the message says what to do instead."""


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype | str:
    """`auto` means float32 on CPU (fp16/bf16 matmuls are slow or inexact there) and the checkpoint's own
    dtype on accelerators."""
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else "auto"
    return DTYPES[name]


def build_llama(arch: ArchConfig, tokenizer, attn_implementation: str = "sdpa",
                seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised Llama-architecture model of `arch`'s shape (`config.ArchConfig`), with
    `tokenizer`'s vocabulary and special tokens (deterministic for `seed`)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=arch.hidden_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        intermediate_size=arch.intermediate_size, max_position_embeddings=arch.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        tie_word_embeddings=arch.tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def _looks_local(name_or_path: str) -> bool:
    """A path rather than a hub id ("gpt2", "Qwen/Qwen2.5-0.5B")."""
    return (name_or_path.startswith((".", "/", "~")) or Path(name_or_path).exists()
            or name_or_path.count("/") > 1)


def load_causal_lm(name_or_path: str, dtype: str = "auto", attn_implementation: str = "sdpa",
                   device: torch.device | str = "cpu", trust_remote_code: bool = False,
                   huge_pages: bool = False):
    """`AutoModelForCausalLM.from_pretrained` with a one-line error for paths that hold no model.

    Safe by default: weights load from safetensors only (a pickle can run code), and a checkpoint's
    own modelling code runs only when the caller passes `trust_remote_code=True`. `huge_pages`: on a
    CPU, the weights moved onto 2 MiB pages where Linux offers them (`pages.onto_huge_pages`; for
    decoding, which reads them all every step). No hub kernels: with the `kernels` package installed
    (transformers 5 depends on it) `from_pretrained` would swap modules for code fetched from the Hugging
    Face hub at run time, and on CUDA `model.train()` fetches them (failing offline); selfspec's passes
    read the model's own modules and its losslessness tests assume their numerics.
    """
    path = Path(name_or_path).expanduser()
    if _looks_local(name_or_path) and not (path / "config.json").is_file():
        raise ModelLoadError(f"no model at {name_or_path!r} (no config.json there); "
                             f"build the embedded base with "
                             f"`selfspec pretrain` or pass a model directory or hub id")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path) if path.exists() else name_or_path, dtype=resolve_dtype(dtype, device),
            attn_implementation=attn_implementation, use_safetensors=True,
            trust_remote_code=trust_remote_code, use_kernels=False)
    except SafetensorError as exc:
        raise ModelLoadError(f"the weights in {name_or_path!r} are damaged ({exc}); "
                             f"save or download the model again") from None
    except OSError as exc:
        if path.is_dir() and not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"{name_or_path!r} holds no .safetensors weights; selfspec loads no pickled "
                                 f"weights: convert them with "
                                 f"save_pretrained(..., safe_serialization=True)") from None
        raise ModelLoadError(f"cannot load model {name_or_path!r}: {str(exc).splitlines()[0]}") from None
    model = model.to(device)
    if huge_pages and torch.device(device).type == "cpu":
        onto_huge_pages(model)
    return model


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """`AutoTokenizer.from_pretrained` with a one-line error (no remote code unless asked for)."""
    try:
        return AutoTokenizer.from_pretrained(str(Path(name_or_path).expanduser())
                                             if Path(name_or_path).expanduser().exists() else name_or_path,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load tokenizer {name_or_path!r}: {str(exc).splitlines()[0]}") from None
