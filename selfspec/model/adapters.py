"""One small adapter per architecture family: the only code that knows Hugging Face's module names.

An adapter answers four questions about a causal LM: where its pieces live (embedding, blocks, final
norm, LM head), how to embed tokens at given positions, what per-call extras a block needs (rotary
cos/sin for the Llama family), and how to call one block. Everything else in selfspec goes through
`DecoderView`, which is built on these answers.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..errors import UserError
from .fast import FastLlamaBlocks, run_block


class UnsupportedArchitectureError(UserError):
    """The model's `config.model_type` has no adapter."""


class Adapter:
    """Base class: the pieces of a decoder-only causal LM and how to call them."""

    model_types: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        self.model = model  # the *ForCausalLM module (never a PEFT or DDP wrapper)
        self.config = model.config
        # Read once: a config attribute costs microseconds, and decoding asks for every block.
        self.sdpa = getattr(self.config, "_attn_implementation", None) == "sdpa"

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

    def block_extras(self, hidden: torch.Tensor, positions: torch.Tensor,
                     max_position: int | None = None) -> dict:
        """Per-call tensors every block needs (computed once per `run_layers`, not per block).

        max_position: the largest entry of `positions` when the caller knows it without a device read.
        """
        return {}

    def call_block(self, index: int, hidden, mask, cache, extras: dict) -> torch.Tensor:
        return self.call_layer(self.layers[index], hidden, mask, cache, extras)

    def run_blocks(self, start: int, end: int, hidden, mask, cache, extras: dict) -> torch.Tensor | None:
        """Blocks [start, end) on hidden (B, T, D) with one mask, all at once where this family has a
        faster way than block by block; None (nothing run) otherwise."""
        return None

    def uses_fast(self) -> bool:
        """Whether decoding passes run on `fast.FastLlamaBlocks` now (autograd off, eval mode, SDPA, plain
        blocks): the families without them never do."""
        return False

    def run_passes_with(self, runner) -> bool:
        """Run the decoding passes of `run_blocks` through `runner(start, end, hidden, cache)` (a
        backend's fixed-shape passes, which returns None to decline a pass), or as before (None).
        Whether this family takes one (the Llama family's plain blocks)."""
        return runner is None

    def call_layer(self, layer: nn.Module, hidden, mask, cache, extras: dict) -> torch.Tensor:
        """Call a block module of this family (one of `layers`, or an exit block outside them, which
        writes its keys at its own `layer_idx`) on hidden (B, T, D)."""
        raise NotImplementedError

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head after the final norm: (..., D) -> (..., V)."""
        return self.lm_head(self.final_norm(hidden))

    def sliding_window(self, index: int) -> int | None:
        """Attention window of block `index` (None: full causal attention)."""
        return None

    @functools.cached_property
    def windows(self) -> tuple:
        """Every block's attention window (`sliding_window`), read once: the config's attributes cost
        microseconds each, and a decoding round asks for them."""
        return tuple(self.sliding_window(i) for i in range(len(self.layers)))

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model is made for (its position table or rotary setup); None: unknown."""
        return getattr(self.config, "max_position_embeddings", None)


class LlamaFamilyAdapter(Adapter):
    """Llama, Mistral, Qwen2 and Qwen3: pre-norm blocks with rotary positions (`model.model.*`)."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    # Rotary types whose frequencies change with the sequence length (`dynamic_rope_update`): their
    # cos/sin must be computed per call, never read from a table.
    _LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # matched as substrings, as Hugging Face does

    def __init__(self, model):
        super().__init__(model)
        self._fast: FastLlamaBlocks | None | bool = False  # False: not built yet (see `fast`)
        rope_type = str(getattr(self.model.model.rotary_emb, "rope_type", ""))
        # whether cos/sin must be computed per call (a table's rows would be wrong)
        self.rope_per_call = any(kind in rope_type for kind in self._LENGTH_DEPENDENT_ROPE)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: (L, head_dim)
        self._pass_runner = None  # a backend's runner of the decoding passes (`run_passes_with`), or None

    @property
    def fast(self) -> FastLlamaBlocks | None:
        """Autograd-free blocks for decoding and evaluation; None when some block is not a plain one.

        Built on first use, not with the view: a view made before `accelerator.prepare` (the training
        objective's) must not hold the unsharded weights. Modules replaced afterwards (a PEFT wrap)
        need a new `DecoderView`.
        """
        if self._fast is False:
            self._fast = FastLlamaBlocks.build(self.layers, self.config, self.final_norm, self.lm_head)
        return self._fast

    @property
    def embedding(self) -> nn.Module:
        """The token embedding module."""
        return self.model.model.embed_tokens

    def uses_fast(self) -> bool:
        # Eager and flash attention differ from SDPA in rounding (eager: float32 softmax): keep them.
        return not torch.is_grad_enabled() and not self.model.training and self.sdpa and self.fast is not None

    def embed(self, input_ids, positions):
        return self.embedding(input_ids)

    def block_extras(self, hidden, positions, max_position=None):
        # Rotary cos/sin: (B, T, head_dim) each, shared by every block of this call. Rows of a table
        # computed once for positions 0..L-1 are the very values a per-call computation gives (the
        # angle of a position is one product, no reduction), at the cost of one index per call.
        if max_position is None or self.rope_per_call:
            rotary = self.model.model.rotary_emb
            return {"position_embeddings": rotary(hidden, position_ids=positions), "position_ids": positions}
        table = self.rope_rows(hidden, max_position)
        return {"position_embeddings": (table[0][positions], table[1][positions]), "position_ids": positions}

    def call_block(self, index, hidden, mask, cache, extras):
        if self.uses_fast():
            return self.fast(index, hidden, mask, cache, *extras["position_embeddings"])
        return self.call_layer(self.layers[index], hidden, mask, cache, extras)

    def run_passes_with(self, runner):
        self._pass_runner = runner
        return True

    def run_blocks(self, start, end, hidden, mask, cache, extras):
        if self.uses_fast():
            if self._pass_runner is not None:  # a backend's decoding pass at fixed shapes
                return self._pass_runner(start, end, hidden, cache)
            return self.fast.run_range(start, end, hidden, mask, cache, *extras["position_embeddings"])
        return None

    def rope_rows(self, hidden, max_position: int) -> tuple:
        """The rotary table (cos, sin), (L, head_dim) each in hidden's dtype and device, L > max_position."""
        table = self._rope_table
        if table is None or table[0].shape[0] <= max_position or table[0].dtype != hidden.dtype \
                or table[0].device != hidden.device:
            size = 1 << max(max_position, 255).bit_length()  # grows by doubling: few rebuilds
            positions = torch.arange(size, device=hidden.device)[None]
            with torch.no_grad():
                cos, sin = self.model.model.rotary_emb(hidden, position_ids=positions)
            table = self._rope_table = (cos[0], sin[0])
        return table

    def call_layer(self, layer, hidden, mask, cache, extras):
        if self.uses_fast():  # an exit block: the model's own blocks took the branch above
            block = self.fast.extra(layer, self.config)
            if block is not None:
                return run_block(block, layer.self_attn.layer_idx, hidden, mask, cache,
                                 *extras["position_embeddings"])
        return layer(hidden, attention_mask=mask, cache=cache, use_cache=cache is not None, **extras)

    def exit_logits(self, hidden):
        if self.uses_fast() and self.fast.head is not None:
            return self.fast.exit_logits(hidden)
        return super().exit_logits(hidden)

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

    @property
    def max_positions(self):
        return self.config.n_positions  # the learned position table's rows

    def embed(self, input_ids, positions):
        transformer = self.model.transformer
        return transformer.drop(transformer.wte(input_ids) + transformer.wpe(positions))

    def call_layer(self, layer, hidden, mask, cache, extras):
        return layer(hidden, cache=cache, attention_mask=mask, use_cache=cache is not None)


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
