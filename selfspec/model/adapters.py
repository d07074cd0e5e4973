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
from .static_passes import StaticPasses


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

    def static_passes(self, mode: str | None) -> bool:
        """Run the decoding passes as `StaticPasses` in `mode` ("eager", "compile"), or as before
        (None). Whether this family and model have them (the Llama family's plain blocks with a
        rotary table)."""
        return mode is None

    def allocate_static(self, cache) -> None:
        """With static passes on, give `cache` the buffers of every block now (see `StaticPasses`)."""

    def draft_loop(self, exit_layer: int, token, cache, positions, head: tuple, k: int, eta: float):
        """Greedy early-exit drafts of a round in one call where this family has one (see
        `DecoderView.draft_loop`); None (nothing run) otherwise."""
        return None

    def draft_choice(self, hidden, head: tuple, allowed, eta: float):
        """Greedy drafts from exit states in one call where this family has one (see
        `DecoderView.draft_choice`); None (nothing run) otherwise."""
        return None

    def draft_step(self, exit_layer: int, tokens, cache, positions, head: tuple, exit_block, allowed,
                   eta: float, choose: bool = True):
        """One greedy early-exit draft step in one call where this family has one (see
        `DecoderView.draft_step`, and `exit_pass` for choose=False); None (nothing run) otherwise."""
        return None

    def verify_greedy(self, start: int, end: int, hidden, tokens, cache, positions, drafts, allowed=None):
        """Greedy verification in one call where this family has one (see `DecoderView.verify_greedy`);
        None (nothing run) otherwise."""
        return None

    def greedy_rounds(self, exit_layer: int, token: int, cache, start: int, head: tuple, k: int, eta: float,
                      eos, max_tokens: int, max_rounds: int, copies: tuple | None = None,
                      overlap: bool = False):
        """One row's greedy rounds (early-exit drafts or copies) in one call where this family has one (see
        `DecoderView.greedy_rounds`); None (nothing run) otherwise."""
        return None

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
        self._rope_per_call = any(kind in rope_type for kind in self._LENGTH_DEPENDENT_ROPE)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: (L, head_dim)
        self._static: StaticPasses | None = None  # the decoding passes for CUDA graphs, when asked for

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

    def _use_fast(self) -> bool:
        # Eager and flash attention differ from SDPA in rounding (eager: float32 softmax): keep them.
        return not torch.is_grad_enabled() and not self.model.training and self.sdpa and self.fast is not None

    def embed(self, input_ids, positions):
        return self.model.model.embed_tokens(input_ids)

    def block_extras(self, hidden, positions, max_position=None):
        # Rotary cos/sin: (B, T, head_dim) each, shared by every block of this call. Rows of a table
        # computed once for positions 0..L-1 are the very values a per-call computation gives (the
        # angle of a position is one product, no reduction), at the cost of one index per call.
        if max_position is None or self._rope_per_call:
            rotary = self.model.model.rotary_emb
            return {"position_embeddings": rotary(hidden, position_ids=positions), "position_ids": positions}
        table = self._rope_rows(hidden, max_position)
        return {"position_embeddings": (table[0][positions], table[1][positions]), "position_ids": positions}

    def call_block(self, index, hidden, mask, cache, extras):
        if self._use_fast():
            return self.fast(index, hidden, mask, cache, *extras["position_embeddings"])
        return self.call_layer(self.layers[index], hidden, mask, cache, extras)

    def static_passes(self, mode):
        if mode is None:
            self._static = None
            return True
        if self.fast is None or self.fast.head is None or self._rope_per_call or not self.sdpa:
            return False
        embedding = self.model.model.embed_tokens
        if type(embedding) is not nn.Embedding:
            return False
        weight = embedding.weight
        self._static = StaticPasses(self.fast, weight, self.windows,
                                    lambda capacity: self._rope_rows(weight[:1, None], capacity - 1), mode)
        return True

    def allocate_static(self, cache):
        if self._static is not None:
            self._static.allocate(cache)

    def run_blocks(self, start, end, hidden, mask, cache, extras):
        if self._use_fast():
            if self._static is not None:  # a decoding pass (up to `WIDTH` rows) at fixed shapes
                return self._static.run(start, end, hidden, cache)
            return self.fast.run_range(start, end, hidden, mask, cache, *extras["position_embeddings"])
        return None

    def draft_loop(self, exit_layer, token, cache, positions, head, k, eta):
        if self._static is not None:
            if not self._use_fast():
                return None
            return self._static.draft_loop(exit_layer, token, cache, head, k, eta)
        place = self._round_place(0, exit_layer, cache, positions)
        if place is None:
            return None
        embedding = self.model.model.embed_tokens
        mask_value = torch.finfo(embedding.weight.dtype).min  # `DecoderView._mask`'s
        return self.fast.draft_loop(exit_layer, embedding, token, cache, *place, mask_value, head, k, eta)

    def draft_choice(self, hidden, head, allowed, eta):
        if self._static is not None or not self._use_fast():  # static passes choose with torch's operations
            return None
        return self.fast.draft_choice(hidden, head, allowed, eta)

    def draft_step(self, exit_layer, tokens, cache, positions, head, exit_block, allowed, eta, choose=True):
        if self._static is not None:  # static passes run the step from Python, at their fixed shapes
            return None
        place = self._round_place(0, exit_layer, cache, positions)
        if place is None:
            return None
        slots, cos, sin = place
        layers, first, extra_slots = [], 0, None
        if exit_block is not None:
            last = slots[3] - 1  # the calls attend to every slot: no window may cut one
            windows = [self.windows[like] for like in exit_block.init_layers]
            if any(w is not None and w <= last for w in windows):
                return None
            layers = list(exit_block.layers)
            first = layers[0].self_attn.layer_idx  # the exit blocks' cache layers: N, N + 1, ..
            extra_slots = cache.slot_buffers(first, first + len(layers))
            if extra_slots is None:
                return None
        embedding = self.model.model.embed_tokens
        mask_value = torch.finfo(embedding.weight.dtype).min  # `DecoderView._mask`'s
        out = self.fast.draft_step(exit_layer, layers, self.config, embedding, tokens, slots, extra_slots,
                                   cos, sin, mask_value, head, allowed, eta, choose)
        if out is None:
            return None
        cache.written(0, exit_layer)
        if layers:
            cache.written(first, first + len(layers))
        return out

    def verify_greedy(self, start, end, hidden, tokens, cache, positions, drafts, allowed=None):
        if self._static is not None:
            if not self._use_fast():
                return None
            return self._static.verify_greedy(start, end, hidden, tokens, cache, drafts, allowed)
        place = self._round_place(start, end, cache, positions)
        if place is None:
            return None
        embedding = self.model.model.embed_tokens
        mask_value = torch.finfo(embedding.weight.dtype).min  # `DecoderView._mask`'s
        return self.fast.verify_greedy(start, end, embedding, hidden, tokens, cache, *place, mask_value,
                                       drafts, allowed)

    def greedy_rounds(self, exit_layer, token, cache, start, head, k, eta, eos, max_tokens, max_rounds,
                      copies=None, overlap=False):
        if self._static is not None or not self._use_fast() or self._rope_per_call:
            return None
        num_layers = len(self.layers)
        keys, values = cache.keys[:num_layers], cache.values[:num_layers]
        last = start + max_tokens + k + (copies[3] if copies else 0)  # past the last slot a round writes
        if any(b is None for b in keys) or any(w is not None and w <= last for w in self.windows):
            return None
        # the next round's drafts made ahead reach k + 1 slots further; not where a window would cut them
        overlap = overlap and all(w is None or w > last + k + 1 for w in self.windows)
        last += k + 1 if overlap else 0
        embedding = self.model.model.embed_tokens
        cos, sin = self._rope_rows(embedding.weight[:1, None], last)
        out = self.fast.greedy_rounds(exit_layer, embedding, token, keys, values, start, cos, sin,
                                      torch.finfo(embedding.weight.dtype).min, head, k, eta, eos, max_tokens,
                                      max_rounds, copies, overlap)
        if out is not None:  # every layer holds the slots up to the pending token: the rest is stale
            cache.hold([start + len(out[0])])
        return out

    def _rope_rows(self, hidden, max_position: int) -> tuple:
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

    def _round_place(self, start: int, end: int, cache, positions):
        """Where a compiled round call over blocks [start, end) at `positions` (B, T) writes and
        attends: (the cache's `slot_buffers`, the rotary cos, sin (B, T, hd)), or None where the call
        does not apply: no fast blocks, a layer without a buffer yet, or an attention window that cuts
        a slot (the calls attend causally to every slot, with no window)."""
        slots = cache.slot_buffers(start, end) if hasattr(cache, "slot_buffers") else None
        if slots is None or not self._use_fast():
            return None
        last = slots[3] - 1  # the last slot written: kv_length - 1
        if any(w is not None and w <= last for w in self.windows[start:end]):
            return None
        weight = self.model.model.embed_tokens.weight
        if self._rope_per_call:
            return slots, *self.block_extras(weight[:1, None], positions, last)["position_embeddings"]
        cos, sin = self._rope_rows(weight[:1, None], last)  # rows of the table: the positions' own values
        if slots[4] is not None:  # rows at their own slots
            return slots, cos[positions], sin[positions]
        batch, first = positions.shape[0], slots[2]  # every row at slots first .. last: a slice
        return slots, cos[first:last + 1].expand(batch, -1, -1), sin[first:last + 1].expand(batch, -1, -1)

    def call_layer(self, layer, hidden, mask, cache, extras):
        if self._use_fast():  # an exit block: the model's own blocks took the branch above
            block = self.fast.extra(layer, self.config)
            if block is not None:
                return run_block(block, layer.self_attn.layer_idx, hidden, mask, cache,
                                 *extras["position_embeddings"])
        return layer(hidden, attention_mask=mask, cache=cache, use_cache=cache is not None, **extras)

    def exit_logits(self, hidden):
        if self._use_fast() and self.fast.head is not None:
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
