"""Tiny random models of every family the adapter supports, built in-process (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_config(family: str, num_layers: int = 4, vocab_size: int = 96, **overrides):
    common = {**_COMMON, "num_hidden_layers": num_layers, "vocab_size": vocab_size}
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "mistral":
        # A window shorter than the test sequences, so the sliding-window mask is exercised.
        cfg = MistralConfig(**common, sliding_window=8)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=8)
    elif family == "gpt2":
        cfg = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=num_layers, n_head=4, n_positions=256,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


_CLASSES = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
            "qwen3": Qwen3ForCausalLM, "gpt2": GPT2LMHeadModel}


def tiny_model(family: str, num_layers: int = 4, vocab_size: int = 96, seed: int = 0,
               attn_implementation: str = "sdpa", **overrides):
    """A random fp32 model in eval mode; weights scaled up so logits are far from uniform."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, num_layers, vocab_size, **overrides)
    cfg._attn_implementation = attn_implementation
    model = _CLASSES[family](cfg).float().eval()
    return model


def sharp_llama(vocab_size: int = 64, seed: int = 3):
    """A tiny Llama whose LM head is scaled ×20: distributions far from uniform, for sampling tests."""
    model = tiny_model("llama", vocab_size=vocab_size, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model
