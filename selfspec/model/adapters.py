"""One small adapter per architecture family: the only code that knows Hugging Face's module names.

An adapter answers four questions about a causal LM: where its pieces live (embedding, blocks, final
norm, LM head), how to embed tokens at given positions, what per-call extras a block needs (rotary
cos/sin for the Llama family), and how to call one block. Everything else in selfspec goes through
`DecoderView`, which is built on these answers.
"""

from __future__ import annotations

import torch
from torch import nn


class UnsupportedArchitectureError(ValueError):
    """The model's `config.model_type` has no adapter."""


class Adapter:
    """Base class: the pieces of a decoder-only causal LM and how to call them."""

    model_types: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        self.model = model  # the *ForCausalLM module (never a PEFT or DDP wrapper)
        self.config = model.config

    # -- where the pieces live -------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        raise NotImplementedError

    @property
    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    # -- how to call them --------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) ids at (B, T) positions -> (B, T, D) input of block 0."""
        raise NotImplementedError

    def block_extras(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict:
        """Per-call tensors every block needs (computed once per `run_layers`, not per block)."""
        return {}

    def call_block(self, index: int, hidden, mask, cache, extras: dict) -> torch.Tensor:
        raise NotImplementedError

    def sliding_window(self, index: int) -> int | None:
        """Attention window of block `index` (None: full causal attention)."""
        return None


class LlamaFamilyAdapter(Adapter):
    """Llama, Mistral, Qwen2 and Qwen3: pre-norm blocks with rotary positions (`model.model.*`)."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    def embed(self, input_ids, positions):
        return self.model.model.embed_tokens(input_ids)

    def block_extras(self, hidden, positions):
        # Rotary cos/sin: (B, T, head_dim) each, shared by every block of this call.
        return {"position_embeddings": self.model.model.rotary_emb(hidden, position_ids=positions),
                "position_ids": positions}

    def call_block(self, index, hidden, mask, cache, extras):
        return self.layers[index](hidden, attention_mask=mask, cache=cache,
                                  use_cache=cache is not None, **extras)

    def sliding_window(self, index):
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        if window is None:
            return None
        if self.config.model_type == "mistral" or layer_types is None:
            return window
        # Qwen2/Qwen3 declare per-layer attention types; only "sliding_attention" layers use the window.
        return window if layer_types[index] == "sliding_attention" else None


class GPT2Adapter(Adapter):
    """GPT-2: learned absolute positions added to the token embedding, LayerNorm, `transformer.h`."""

    model_types = ("gpt2",)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.transformer.h

    @property
    def final_norm(self) -> nn.Module:
        return self.model.transformer.ln_f

    def embed(self, input_ids, positions):
        transformer = self.model.transformer
        return transformer.drop(transformer.wte(input_ids) + transformer.wpe(positions))

    def call_block(self, index, hidden, mask, cache, extras):
        return self.layers[index](hidden, cache=cache, attention_mask=mask, use_cache=cache is not None)


ADAPTERS: tuple[type[Adapter], ...] = (LlamaFamilyAdapter, GPT2Adapter)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for a in ADAPTERS for t in a.model_types)


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for a Hugging Face causal LM, chosen by `config.model_type`."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for adapter_cls in ADAPTERS:
        if model_type in adapter_cls.model_types:
            return adapter_cls(model)
    raise UnsupportedArchitectureError(
        f"model_type {model_type!r} is not supported; supported families: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
