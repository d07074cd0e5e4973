"""`DecoderView`: a Hugging Face causal LM seen as embed -> blocks [0, N) -> final norm -> LM head.

Self-speculative decoding and early-exit training both need to run a *range* of blocks, stop, and
read logits out of an intermediate hidden state through the model's own final norm and LM head.
`DecoderView` gives that uniform interface over every supported family; the family-specific module
names live in `adapters.py`.

Positions and caches. Every call takes per-row `positions` (B, T). A cache passed to `run_layers`
must follow Hugging Face's `Cache.update(key, value, layer_idx, ...)` protocol and keep each row's
keys at *slot index == position* (no left padding). Then one rule builds the attention mask for any
batch: a query at position p sees the key in slot j iff j <= p (and p - j < window for sliding-window
blocks). That rule covers prefill, one-token decoding, k+1-token verification and rows of different
lengths alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .adapters import Adapter, adapter_for


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare *ForCausalLM inside DDP/FSDP (`.module`) and PEFT (`get_base_model()`) wrappers."""
    while True:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner


def num_layers(model: nn.Module) -> int:
    """N, the number of decoder blocks (read from the module tree, not from a family's config field)."""
    return len(adapter_for(unwrap_model(model)).layers)


@dataclass
class LayerContext:
    """What every block of one `run_layers` call shares: positions, masks per window, rotary extras."""

    positions: torch.Tensor  # (B, T)
    masks: dict  # window (int | None) -> additive mask (B, 1, T, S) or None for SDPA's causal kernel
    extras: dict  # family-specific per-call tensors (rotary cos/sin)


class DecoderView:
    """Uniform, piecewise access to a decoder-only Hugging Face causal LM.

    `exit_logits(run_layers(embed(x), 0, E))` is the draft model of self-speculative decoding: the
    first E blocks, then the model's *final norm* and LM head (skipping the norm gives logits of the
    wrong scale and an acceptance rate near zero).
    """

    def __init__(self, model: nn.Module):
        self.model = unwrap_model(model)
        self.adapter: Adapter = adapter_for(self.model)
        self.config = self.model.config
        # Attention window of every block, looked up once (None: full causal attention).
        self.windows: list[int | None] = list(self.adapter.windows)

    # -- structure -----------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.adapter.layers)

    @property
    def layers(self) -> nn.ModuleList:
        return self.adapter.layers

    @property
    def final_norm(self) -> nn.Module:
        return self.adapter.final_norm

    @property
    def lm_head(self) -> nn.Module:
        return self.adapter.lm_head

    @property
    def max_positions(self) -> int | None:
        """The longest sequence (prompt + generated tokens) the model is made for; None: unknown."""
        return self.adapter.max_positions

    @property
    def vocab_size(self) -> int:
        """V: the width of the logits (the LM head's rows; may exceed the tokenizer's vocabulary)."""
        return self.lm_head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # -- pieces ----------------------------------------------------------------------------------------
    @staticmethod
    def default_positions(input_ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Positions start..start+T-1 for every row: (B, T)."""
        batch, length = input_ids.shape[:2]
        return torch.arange(start, start + length, device=input_ids.device).expand(batch, length)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> input of block 0 (B, T, D)."""
        if positions is None:
            positions = self.default_positions(input_ids)
        return self.adapter.embed(input_ids, positions)

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head after the model's final norm: (..., D) -> (..., V)."""
        return self.adapter.exit_logits(hidden)

    def context(self, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                kv_length: int | None = None, cached: bool = False, aligned: bool = False) -> LayerContext:
        """Build the shared per-call state for blocks run on `hidden` (B, T, D).

        positions: (B, T); None means 0..T-1 for every row (training on packed blocks).
        kv_length: the key length S the cache returns after the update (slots 0..S-1); default
            max(positions) + 1 when `cached` (one device read), else T (keys are the T inputs).
        aligned: the caller guarantees that every row sits at the same positions (batch 1 always
            does). The mask is then built once for all rows, and a one-token step that sees every
            slot needs none at all, which lets SDPA take its fastest path.
        """
        batch, length = hidden.shape[:2]
        contiguous = positions is None
        if positions is None:
            positions = torch.arange(length, device=hidden.device).expand(batch, length)
        if cached:
            if kv_length is None:
                kv_length = int(positions.max()) + 1
            key_positions = torch.arange(kv_length, device=hidden.device)[None]  # (1, S)
        else:
            key_positions = positions
        max_position = length - 1 if contiguous else (kv_length - 1 if cached else None)
        query_positions = positions[:1] if aligned else positions
        masks = {}
        for window in set(self.windows):
            if contiguous and not cached:
                fast = window is None or window >= length  # SDPA's own causal kernel is exact
            else:
                fast = aligned and cached and length == 1 and (window is None or window >= kv_length)
            masks[window] = (None if fast and self.adapter.sdpa
                             else self._mask(query_positions, key_positions, window, hidden.dtype))
        return LayerContext(positions, masks, self.adapter.block_extras(hidden, positions, max_position))

    @staticmethod
    def _mask(positions, key_positions, window, dtype):
        """Additive mask (B, 1, T, S): 0 where query position p may see key position j, else -inf-ish."""
        visible = key_positions[:, None, :] <= positions[:, :, None]  # (B, T, S)
        if window is not None:
            visible &= positions[:, :, None] - key_positions[:, None, :] < window
        mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[:, None]

    def run_layers(self, hidden: torch.Tensor, start: int, end: int, cache=None,
                   positions: torch.Tensor | None = None, kv_length: int | None = None,
                   context: LayerContext | None = None, aligned: bool = False) -> torch.Tensor:
        """Run blocks [start, end) on hidden (B, T, D); returns (B, T, D).

        With a cache, each block writes its keys/values at `positions` and attends to slots
        0..kv_length-1. Pass a prebuilt `context` to run several ranges with one mask/rotary build.
        """
        if context is None:
            context = self.context(hidden, positions, kv_length, cached=cache is not None, aligned=aligned)
        if cache is not None and start < end and len(set(self.windows[start:end])) == 1:
            # blocks of one attention window: the family may run them in one go (a decoding pass)
            out = self.adapter.run_blocks(start, end, hidden, context.masks[self.windows[start]], cache,
                                          context.extras)
            if out is not None:
                return out
        for index in range(start, end):
            hidden = self.run_block(index, hidden, context, cache)
        return hidden

    def run_block(self, index: int, hidden: torch.Tensor, context: LayerContext, cache=None) -> torch.Tensor:
        """Run block `index` once (the unit that layer dropout skips)."""
        mask = context.masks[self.windows[index]]
        return self.adapter.call_block(index, hidden, mask, cache, context.extras)

    def run_extra_block(self, layer: nn.Module, like: int, hidden: torch.Tensor, context: LayerContext,
                        cache=None) -> torch.Tensor:
        """Run a block module outside the model's list (an exit block, `model.exit_adapter.ExitBlock`)
        with the attention window of block `like`; it writes its keys at its own `layer_idx`."""
        mask = context.masks[self.windows[like]]
        return self.adapter.call_layer(layer, hidden, mask, cache, context.extras)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
                num_layers: int | None = None) -> torch.Tensor:
        """Logits (B, T, V) of the first `num_layers` blocks (default all) + final norm + head."""
        hidden = self.embed(input_ids, positions)
        hidden = self.run_layers(hidden, 0, num_layers or self.num_layers, cache, positions)
        return self.exit_logits(hidden)

    __call__ = forward
