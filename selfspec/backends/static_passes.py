"""Static-shaped decoding passes for CUDA graphs: `StaticPasses`.

On a GPU a small model's decoding step is a few hundred kernel launches, each a few µs of CPU time
whatever the arithmetic, so a round of k draft steps and a verification costs its launches, not its
passes (the practitioners' notes name the cure: capture the round). Capture needs every pass to
have one shape and no host reads inside, which the engine's passes lack: their width is the round's
k + 1, their keys the cache's first kv_length slots, their drafts a host loop. Here each pass is a
function of fixed shapes:

- every pass runs on exactly `WIDTH` query rows (fewer are padded with copies of the last row, which
  write the same keys to the same slot), so a position rounds the same alone (a plain step) as among
  k + 1 (a verification): the output of speculative decoding equals plain decoding's by
  construction, as under `fast.fixed_width` (every matrix product on the same number of rows, each
  row's result independent of the others);
- it attends to every slot of the cache (B, H_kv, capacity, hd) under a mask built from the
  positions (B, W) on the device (slot j visible to position p when j <= p, inside the block's
  window), and writes its keys with a scatter at those positions, so nothing depends on host ints;
- the draft loop is the engine's own (`draft_loop.draft_loop`) over this module's pass of one position:
  each argmax (or draw) fed to the next step on the device; η cuts its drafts once after it (the steps
  past the cut ran for nothing, their keys stale and hidden).

Functions per block range, made once each (`_made`, one maker per kind in `_KINDS`): `run` (blocks
[start, end) on hidden states: a pass the engine runs from Python), `verify` (+ final norm, LM head, a
grammar's masks and `sampling.accept_greedy`), `draft_loop` (k draft steps and the last draft's pass,
greedy or sampled) and `verify_sampled` (the round accepted by `sampling.accept_sampled`, with each row's
own settings and counter-based random numbers, taken as tensors: one function for every setting). The
loop, the acceptance, the masks and the sampling are the engine's own functions (`selfspec.draft_loop`,
`selfspec.sampling`), captured here, not copies. In "eager" mode they run as written (any device: the
tests' reference); in "graph" mode each is captured per argument signature as one CUDA graph
(`graphs.CapturedPass`, emulated off CUDA), the cache's buffers written in place by every replay. (A
"compile" mode through `torch.compile(mode="reduce-overhead")` was removed: inductor skipped CUDA graphs
for these passes, which write their inputs in place, so it never captured them.) The engine keeps its
caches' buffers in a `decoding.cache.CachePool` while static passes are on
(`SelfSpecGenerator(static_passes=...)`), so a second `generate`, and a batch whose rows left or joined,
reuse the captured graphs.

Only the Llama family's plain blocks (`fast.FastLlamaBlocks`) with a table-driven rotary; products
are `F.linear`, attention is `fast.fixed_attention` (float32, written out), so these passes
round differently from the CPU kernels' (a decode is all static or all not).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..draft_loop import draft_loop, keep_sure, trimmed_logits
from ..model.fast import (
    FIXED_WIDTH,
    FastLlamaBlocks,
    _Block,
    attention_inputs,
    fixed_attention,
    mlp_half,
    rms_norm,
)
from ..sampling import ACCEPT, TARGET, RowSampling, accept_greedy, accept_sampled, apply_mask, uniforms
from .base import STATIC_MODES
from .graphs import CapturedPass

WIDTH = FIXED_WIDTH  # query rows of every static pass


class StaticPasses:
    """The static-shaped passes of one model (see the module docstring).

    fast: the model's `FastLlamaBlocks` (blocks and the plain final norm + LM head); embedding: the
    token embedding table (V, D); windows: each block's attention window (None: full); rope: maps a
    capacity to the rotary table (cos, sin), (L >= capacity, hd) each; mode: "eager" or "graph".
    """

    def __init__(self, fast: FastLlamaBlocks, embedding: torch.Tensor, windows: tuple,
                 rope: Callable[[int], tuple], mode: str):
        if mode not in STATIC_MODES:
            raise ValueError(f"static passes mode must be one of {STATIC_MODES}, got {mode!r}")
        self.fast, self.embedding, self.windows, self.rope, self.mode = fast, embedding, windows, rope, mode
        self._functions: dict = {}  # (kind, start, end, masked, head id, steps, sampling) -> the function

    # -- what the engine calls ---------------------------------------------------------------------
    def run(self, start: int, end: int, hidden: torch.Tensor, cache) -> torch.Tensor | None:
        """Blocks [start, end) on hidden (B, T, D) at the cache's announced positions, T <= WIDTH;
        returns (B, T, D), the cache written; None, nothing run, where it does not apply."""
        length = hidden.shape[1]
        slots = self._slots(cache, start, end, slice(0, length))
        if slots is None:
            return None
        out = self._made("run", start, end)(_pad(hidden), *slots)
        cache.written(start, end)
        return out[:, :length]

    def verify_greedy(self, start: int, end: int, hidden: torch.Tensor | None, tokens: torch.Tensor | None,
                      cache, drafts: torch.Tensor, allowed: torch.Tensor | None):
        """`Backend.verify_greedy` on static passes: decided (B, T + 1), the tokens (B, T) then each
        row's accepted count; None, nothing run, where it does not apply."""
        length = drafts.shape[1] + 1
        slots = self._slots(cache, start, end, slice(0, length))
        if slots is None:
            return None
        source = _pad(tokens) if hidden is None else _pad(hidden)
        padded = torch.full((drafts.shape[0], WIDTH - 1), -1, dtype=drafts.dtype, device=drafts.device)
        padded[:, :length - 1] = drafts  # -1 past the drafts: never accepted
        if allowed is not None:
            allowed = _pad(allowed.to(source.device))
        targets, accepted = self._made("verify", start, end, masked=allowed is not None)(
            source, *slots, padded, allowed)
        cache.written(start, end)
        return torch.cat([targets[:, :length], accepted[:, None].to(targets.dtype)], 1)

    def draft_loop(self, exit_layer: int, token: torch.Tensor, cache, head: tuple, k: int, stop_below: float,
                   sampling: RowSampling | None = None):
        """`Backend.draft_loop` on static passes: `draft_loop.draft_loop`, the engine's own loop, over this
        module's fixed-shape pass of one position and the draft head, from `token` (B,) at the cache's
        announced positions (B, k + 1); run as written, or captured unrolled as one graph ("graph": one
        launch for the k steps and the last draft's pass; sampled rows' one graph whatever their settings,
        `sampling` taken as tensors). η cuts the drafts after it (`draft_loop.keep_sure`, one host read).
        Returns (drafts (B, s), their distributions q (B, s, V) or None when greedy, exit states (B, s + 1,
        D)), the cache holding the s + 1 inputs at blocks [0, E); None, nothing run, where it does not apply
        (no drafts to make, k = 0, included)."""
        slots = self._slots(cache, 0, exit_layer, slice(0, k + 1)) if k else None
        if slots is None:
            return None
        keys, values, _, cos, sin = slots
        sampled = sampling is not None and not sampling.all_greedy
        kind = "draft_loop_sampled" if sampled else "draft_loop"
        loop = self._made(kind, 0, exit_layer, head=head, steps=k)
        rows = sampling.tensors() if sampled else ()
        out = loop(token, keys, values, cache.positions[:, :k + 1], cos, sin, *rows)
        drafts, q, hidden = keep_sure(*(out if sampled else (out[0], None, *out[1:])), stop_below)
        cache.written(0, exit_layer, drafts.shape[1] + 1)
        return drafts, q, hidden

    def verify_sampled(self, start: int, end: int, hidden: torch.Tensor | None, tokens: torch.Tensor | None,
                       cache, drafts: torch.Tensor, q: torch.Tensor, sampling: RowSampling,
                       allowed: torch.Tensor | None):
        """`Backend.verify_sampled` on static passes: the target's pass, head, masks, processed
        probabilities and `sampling.accept_sampled`'s rule with the rows' random numbers, in one pass of
        fixed shapes (a graph per k: the drafts padded inside it, never accepted past the k). decided
        (B, T + 1); None where it does not apply."""
        slots = self._slots(cache, start, end, slice(0, drafts.shape[1] + 1))
        if slots is None:
            return None
        source = _pad(tokens) if hidden is None else _pad(hidden)
        if allowed is not None:
            allowed = _pad(allowed.to(source.device))
        verify = self._made("verify_sampled", start, end, masked=allowed is not None)
        out = verify(source, *slots, drafts, q, allowed, *sampling.tensors())
        cache.written(start, end)
        return out

    def allocate(self, cache) -> None:
        """Give the cache's layers of the model's blocks their buffers now: the passes write them in
        place, so the same addresses serve every pass (and every replay of a captured one)."""
        dtype, device = self.embedding.dtype, self.embedding.device
        for layer, b in enumerate(self.fast.blocks):
            cache.allocate(layer, b.wk.shape[0] // b.head_dim, b.head_dim, dtype, device)

    # -- the pieces --------------------------------------------------------------------------------
    def _slots(self, cache, start: int, end: int, columns: slice):
        """(keys, values of blocks [start, end) (B, H_kv, S, hd) each, positions (B, WIDTH), the rotary
        table cos, sin (L, hd)) for a pass over the `columns` of the cache's announced positions; None
        where static passes do not apply: more rows than WIDTH, or a layer of the range without a
        buffer yet."""
        if columns.stop - columns.start > WIDTH or not hasattr(cache, "slot_buffers"):
            return None
        slots = cache.slot_buffers(start, end)
        if slots is None:
            return None
        keys, values = slots[0], slots[1]
        return (keys, values, _pad(cache.positions[:, columns]), *self.rope(cache.capacity))

    def _made(self, kind: str, start: int, end: int, head: tuple | None = None, masked: bool = False,
              steps: int = 0):
        """The function of pass `kind` over blocks [start, end) (`_KINDS`), made once per key and run as
        the mode says (as written, or captured as a graph)."""
        key = (kind, start, end, masked, None if head is None else id(head[0]), steps)
        if key not in self._functions:
            model = _Slice(self.fast.blocks[start:end], self.windows[start:end], *self.fast.head,
                           self.embedding)
            function = _KINDS[kind](model, head, steps)
            if self.mode == "graph":
                function = CapturedPass(function, static=(1, 2), device=self.embedding.device)
            self._functions[key] = function
        return self._functions[key]


@dataclass(frozen=True)
class _Slice:
    """What a static pass reads of the model: blocks [start, end) with their attention windows, the final
    norm (weight, eps) and LM head (weight, bias), and the token embedding table (V, D)."""

    blocks: list
    windows: tuple
    norm: torch.Tensor
    eps: float
    head_weight: torch.Tensor
    head_bias: torch.Tensor | None
    embedding: torch.Tensor

    def run(self, source, keys, values, positions, cos, sin) -> torch.Tensor:
        """The blocks on `source`: token ids (B, W) embedded, or hidden states (B, W, D)."""
        hidden = self.embedding[source] if source.dim() == 2 else source
        return _blocks(self.blocks, self.windows, hidden, keys, values, positions, cos, sin)

    def logits(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and LM head on hidden (B, W, D), a grammar's masks `allowed` (B, W, V) applied."""
        logits = F.linear(rms_norm(hidden, self.norm, self.eps), self.head_weight, self.head_bias)
        return logits if allowed is None else apply_mask(logits, allowed)

    def one_position(self, token, keys, values, position, cos, sin) -> torch.Tensor:
        """A draft step's pass: `token` (B,) at `position` (B, 1), the pass's W rows all that one
        position (the same keys to the same slot); its hidden state (B, D) after the blocks."""
        hidden = self.embedding[token][:, None].expand(-1, WIDTH, -1)  # (B, W, D)
        return _blocks(self.blocks, self.windows, hidden, keys, values,
                       position.expand(-1, WIDTH).contiguous(), cos, sin)[:, 0]


def _run(model: _Slice, head, steps) -> Callable:
    """Blocks on hidden states: a pass the engine runs from Python."""
    def function(hidden, keys, values, positions, cos, sin):
        return model.run(hidden, keys, values, positions, cos, sin)
    return function


def _verify(model: _Slice, head, steps) -> Callable:
    """The greedy verification: the pass, the head, the masks, `accept_greedy` on drafts padded with -1
    (never accepted) to W - 1 columns: (targets (B, W), accepted (B,))."""
    def function(source, keys, values, positions, cos, sin, drafts, allowed):
        logits = model.logits(model.run(source, keys, values, positions, cos, sin), allowed)  # (B, W, V)
        return accept_greedy(drafts, logits)
    return function


def _verify_sampled(model: _Slice, head, steps) -> Callable:
    """The sampled verification: the pass, the head, the masks, each row's processed probabilities and
    `accept_sampled` on the k drafts padded to the pass's W - 1 columns (never accepted past the k),
    with the rows' settings and seeds as tensors (`RowSampling.tensors`): decided (B, k + 2)."""
    def function(source, keys, values, positions, cos, sin, drafts, q, allowed, *rows):
        sampling = RowSampling.captured(rows)
        logits = model.logits(model.run(source, keys, values, positions, cos, sin), allowed)  # (B, W, V)
        k = drafts.shape[1]
        # the token at slot position j is decided for position j + 1
        tokens, accepted = accept_sampled(
            F.pad(drafts, (0, WIDTH - 1 - k)), F.pad(q, (0, 0, 0, WIDTH - 1 - k)), sampling.probs(logits),
            uniforms(sampling.seeds, positions[:, :-1] + 1, ACCEPT),
            uniforms(sampling.seeds, positions + 1, TARGET), live=k)
        return torch.cat([tokens[:, :k + 1], accepted[:, None].to(tokens.dtype)], 1)
    return function


def _draft_loop(model: _Slice, head, steps, sampled: bool = False) -> Callable:
    """`draft_loop.draft_loop` over this module's pass of one position and the draft head (greedy, or with
    the rows' settings as tensors, `RowSampling.captured`): (drafts (B, steps), q (B, steps, V) when
    sampled, top probabilities (steps, B), exit states (B, steps + 1, D))."""
    weight, bias, ids, vocab = head

    def logits(hidden):  # (B, D) -> (B, V)
        return trimmed_logits(F.linear(rms_norm(hidden, model.norm, model.eps), weight, bias), ids, vocab)

    def function(token, keys, values, positions, cos, sin, *rows):
        def step(token, i):  # positions (B, steps + 1): step i at column i
            return model.one_position(token, keys, values, positions[:, i:i + 1], cos, sin)
        sampling = RowSampling.captured(rows) if sampled else None
        drafts, q, tops, states = draft_loop(step, logits, token, positions, steps, sampling)
        return (drafts, q, tops, states) if sampled else (drafts, tops, states)  # a graph's outputs: tensors
    return function


# each pass's maker: (the model's slice, the draft head's tensors, draft steps) -> the function
_KINDS = {"run": _run, "verify": _verify, "verify_sampled": _verify_sampled, "draft_loop": _draft_loop,
          "draft_loop_sampled": functools.partial(_draft_loop, sampled=True)}


def _pad(x: torch.Tensor) -> torch.Tensor:
    """x (B, T, ...) with T < WIDTH padded to WIDTH rows by copies of its last row."""
    extra = WIDTH - x.shape[1]
    if not extra:
        return x
    return torch.cat([x, x[:, -1:].expand(-1, extra, *x.shape[2:])], 1)


def _blocks(blocks: list[_Block], windows: tuple, hidden: torch.Tensor, keys: list, values: list,
            positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Blocks on hidden (B, W, D) at positions (B, W), block i writing keys[i], values[i]
    (B, H_kv, S, hd) at those slots and attending to every slot the mask shows it; cos, sin: the
    rotary table (L, hd), L > every position."""
    if not blocks:  # a verification at E = N: only the head
        return hidden
    slots = torch.arange(keys[0].shape[2], device=positions.device)  # (S,)
    behind = positions[:, :, None] - slots[None, None, :]  # (B, W, S): how far back each slot is
    masks = {}
    for window in set(windows):
        visible = behind >= 0 if window is None else (behind >= 0) & (behind < window)
        masks[window] = torch.zeros(visible.shape, device=positions.device).masked_fill(
            ~visible, torch.finfo(torch.float32).min)[:, None]  # (B, 1, W, S)
    cos, sin = cos[positions][:, None], sin[positions][:, None]  # (B, 1, W, hd)
    for b, window, k_cache, v_cache in zip(blocks, windows, keys, values):
        hidden = _block(b, hidden, k_cache, v_cache, positions, masks[window], cos, sin)
    return hidden


def _block(b: _Block, hidden: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           positions: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One Llama-family block on hidden (B, W, D), every part the fast path's own: the halves before and
    after attention (`fast.attention_inputs`, `fast.mlp_half`) and its fixed-shape attention
    (`fast.fixed_attention`) over every slot under `mask` (B, 1, W, S), its keys and values scattered
    into the cache at `positions` (B, W) first: fixed shapes, which a CUDA graph replays."""
    width = hidden.shape[1]
    q, k, v = attention_inputs(b, hidden, cos, sin, F.linear)  # (B, Hq, W, hd), (B, Hkv, W, hd) twice
    index = positions[:, None, :, None].expand(-1, k.shape[1], -1, b.head_dim)
    keys.scatter_(2, index, k.to(keys.dtype))
    values.scatter_(2, index, v.to(values.dtype))
    attn = fixed_attention(q, keys, values, mask, b, width)  # (B, W, Hq·hd)
    hidden = hidden + F.linear(attn.to(hidden.dtype), b.wo, b.bo)
    return mlp_half(b, hidden, F.linear)
