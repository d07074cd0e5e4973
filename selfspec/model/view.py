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

    def static_passes(self, mode: str | None) -> bool:
        """From now on run the decoding passes (every pass of up to `static_passes.WIDTH` positions with
        the engine's cache: plain steps, drafts, verifications) at fixed shapes, ready for CUDA graphs:
        mode "eager" runs them as written, "compile" through `torch.compile` (CUDA graphs on a GPU);
        None goes back. Whether the family has them (the Llama family's plain blocks)."""
        return self.adapter.static_passes(mode)

    def allocate_static(self, cache) -> None:
        """With static passes on, give a new `decoding.KVCache` the buffers of every block now, before
        its first pass (a no-op otherwise)."""
        self.adapter.allocate_static(cache)

    def draft_choice(self, hidden: torch.Tensor, head: tuple, allowed: torch.Tensor | None = None,
                     eta: float = 0.0):
        """Greedy drafts from exit states `hidden` (B, D) in one compiled call, where the family has one
        (the Llama family on selfspec's CPU kernels): the final norm, the draft head `head` (as
        `draft_loop`'s), a grammar's mask `allowed` (B, V) bool where given, and the argmax, as the
        compiled draft loop and step choose. Returns (drafts (B,), sure: whether some row's draft puts
        `eta` on its top token), or None where it does not apply."""
        return self.adapter.draft_choice(hidden, head, allowed, eta)

    def draft_step(self, exit_layer: int, tokens: torch.Tensor, cache, positions: torch.Tensor, head: tuple,
                   exit_block=None, allowed: torch.Tensor | None = None, eta: float = 0.0):
        """One greedy early-exit draft step in one compiled call, where the family has one (the Llama
        family on selfspec's CPU kernels): `tokens` (B, T) at `positions` (B, T) (announced to `cache`)
        through blocks [0, exit_layer), then `exit_block`'s blocks (an `ExitBlock`, each writing its own
        cache layer) when given, the final norm and draft head on the last position, a grammar's
        mask `allowed` (B, V) bool where given, and the argmax: the engine's Python step, op for op.
        head as `draft_loop`'s. Returns (draft (B,), hidden (B, T, D) after block E, sure: whether some
        row's draft puts `eta` on its top token), the cache holding the T positions; or None, nothing
        run, where it does not apply (the kernels off, static passes, a window that cuts a slot)."""
        return self.adapter.draft_step(exit_layer, tokens, cache, positions, head, exit_block, allowed, eta)

    def exit_pass(self, exit_layer: int, tokens: torch.Tensor, cache, positions: torch.Tensor, head: tuple,
                  exit_block=None):
        """`draft_step`'s pass without its choice, in one compiled call where the family has one: `tokens`
        (B, T) at `positions` through blocks [0, exit_layer), then `exit_block`'s blocks. Returns (hidden
        (B, T, D) after block E, the exit states (B, T, D) the draft head reads), or None, nothing run."""
        return self.adapter.draft_step(exit_layer, tokens, cache, positions, head, exit_block, None, 0.0,
                                       choose=False)

    def draft_loop(self, exit_layer: int, token: torch.Tensor, cache, positions: torch.Tensor, head: tuple,
                   k: int, eta: float = 0.0):
        """Greedy early-exit drafts in one compiled call, where the family has one (the Llama family on
        selfspec's CPU kernels): from `token` (B,) at `positions[:, 0]` (announced to `cache`; rows
        may sit at different slots), k steps of blocks [0, exit_layer) + final norm + draft head +
        argmax, each draft the next step's input, ending early when no row's draft puts `eta` on its
        top token.
        positions (B, k + 1); head: (weight (V', D), bias or None, ids (V',) of a trimmed head or None,
        V). Returns (drafts (B, s), exit states (B, s + 1, D): every input that ran, the last draft
        included unless η stopped first), the cache holding those s + 1 positions at blocks
        [0, exit_layer); or None, nothing run, where it does not apply."""
        return self.adapter.draft_loop(exit_layer, token, cache, positions, head, k, eta)

    def greedy_rounds(self, exit_layer: int, token: int, cache, start: int, head: tuple, k: int, eta: float,
                      eos: torch.Tensor, max_tokens: int, max_rounds: int, copies: tuple | None = None,
                      overlap: bool = False):
        """Greedy decoding rounds of one row in one compiled call, where the family has one (as
        `draft_loop`): from the pending `token` at slot `start` of `cache` (one row, every layer holding
        `start` positions), each round k early-exit drafts through blocks [0, exit_layer) with `head`
        (as `draft_loop`'s: stopping below `eta`) and their verification (as `verify_greedy`), or for
        k = 0 a plain step; the row keeps the accepted drafts and the target's next token, cut after
        an eos (`eos` (n,) int64) and at `max_tokens` in all, for up to `max_rounds` rounds. With
        `copies` (the row's tokens so far (t,) int64, the pending one last; min_ngram, max_ngram; the
        copy length), each round first drafts a copy from the context (`ngram.NGramIndex.propose`,
        verified over blocks [0, N)); without one, k = 0 takes a plain step and k > 0 drafts with the
        early exit, followed by a copy when its drafts make one (the `hybrid`). With `overlap`, a round
        whose k early-exit drafts ran verifies on one thread while another drafts the next round from
        the exit's guess of the target's next token (`DecodeSettings.overlap`): the same drafts are kept
        as a fresh draft would make. The same passes as the engine's rounds one by one, so the same
        tokens, without the host's work between them. Returns numpy (tokens (t,), rounds (R, 5):
        early-exit drafts, copied drafts, accepted count, kept tokens and whether the drafts were made
        ahead, per round; seconds (R, 2): each round's draft and verification seconds), the cache
        holding start + t positions; or None, nothing run, where it does not apply."""
        return self.adapter.greedy_rounds(exit_layer, token, cache, start, head, k, eta, eos, max_tokens,
                                          max_rounds, copies, overlap)

    def verify_greedy(self, start: int, end: int, cache, positions: torch.Tensor, drafts: torch.Tensor,
                      hidden: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                      allowed: torch.Tensor | None = None):
        """Greedy verification in one compiled call, where the family has one (as `draft_loop`): blocks
        [start, end) on the T positions `positions` (B, T) (announced to `cache`, every row at the same
        slots), causal over them, then the final norm, the LM head, the argmax and the accepted prefix
        of `drafts` (B, T - 1), as `sampling.accept_greedy`. The input: `hidden` (B, T, D), or `tokens`
        (B, T) embedded (start = 0: a whole-model pass). allowed: a grammar's masks (B, T, V) bool on
        the target's logits. Returns decided (B, T + 1): the tokens (B, T), then each row's accepted
        count; the cache written at blocks [start, end); or None, nothing run, where it does not
        apply."""
        return self.adapter.verify_greedy(start, end, hidden, tokens, cache, positions, drafts, allowed)

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
