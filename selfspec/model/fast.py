"""Inference-only forward of Llama-family blocks straight from their weights.

Decoding one token through a small model is bound by per-operation overhead, not arithmetic: a
Hugging Face `LlamaDecoderLayer` call spends most of its time in Python (module `__call__`s, keyword
plumbing, the attention-interface dispatch), several times the cost of its eight matrix products on
a CPU. `FastLlamaBlocks` runs the same computation, in the same order and the same dtypes, as a
flat sequence of tensor operations on the modules' own weight tensors (no copies, no fused weights,
so no extra memory): pre-norm RMSNorm -> q/k/v projections (+ Qwen3's per-head q/k norms) ->
rotary -> cache update -> scaled dot-product attention -> o projection -> residual -> RMSNorm ->
SwiGLU MLP -> residual.

On CPU a decoding pass of a few positions (a plain step, a draft step, a verification) runs each
block instead as two compiled calls around the cache write (`kernels/few_rows.cpp`: `block_front`
norm -> q/k/v -> rotary, `block_back` attention -> o -> residual -> norm -> MLP -> residual), the
same computation rounded where the tensor operations round; see `run_block`. A pass over several
blocks with the engine's cache runs them all in one compiled call (`FastLlamaBlocks.run_range`).

`DecoderView` uses it whenever autograd is off, the model is in eval mode and uses SDPA attention
(decoding, evaluation), and falls back to the model's own blocks otherwise (training, eager or
flash attention, PEFT adapters not merged, quantised, sharded, offloaded or hooked layers). The
speculative engine's plain and self-speculative paths both run through it, so its losslessness
guarantee is unchanged; tests check it against Hugging Face's blocks.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, op for op (statistics in float32, scaled in the input dtype)."""
    h = hidden.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(hidden.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, hd) rotated by cos/sin (B, 1, T, hd): x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# At most this many rows take the columns path of `linear` (measured up to 8: verification sizes)
_COLUMNS_MAX_ROWS = 8
# The switches (how far the compiled paths run, one row's columns path and halves, the small-block
# threshold below, bf16 emulation) are `kernels.KernelSettings` fields, read per thread or task with
# `kernels.settings()` and changed in a block with `kernels.using(...)` or `kernels_up_to(level)`:
# - columns_min_bytes_one_row (1 MiB): one row takes the columns path only for a weight at least this
#   large: there reading it dominates; a smaller one is bound by the per-op overhead the padding adds;
# - halves_one_row: one row on a large weight runs as two half-products in one batched call (see
#   `linear`); False restores the columns path (for A/B measurements).
# The compiled paths, each on top of the one before (`KERNEL_LEVELS`; `kernels_up_to` turns them off
# from a level on): "products", few-row products and the fixed-width attention run selfspec's kernels
# where they build (see `_kernel_for`, `_attention_kernel_for`; off: MKL's products and the padded
# attention); "blocks", a decoding pass runs each block as two compiled calls (see `run_block`; off:
# the per-operation path, its products in the few-row kernel); "passes", a decoding pass over several
# blocks runs them in one compiled call (see `FastLlamaBlocks.run_range`; off: block by block);
# "rounds", the engine's greedy rounds run in compiled calls: the early-exit drafts in one
# (`backends.CpuKernelsBackend.draft_loop`), the verification in another (`verify_greedy`; off: from
# Python, step by step); "decode", a call's greedy rounds of one row at a fixed k run in one compiled call
# (`CpuKernelsBackend.greedy_rounds`: the host does not return to Python between rounds; off: each round
# as the calls before).
KERNEL_LEVELS = kernels.KERNEL_LEVELS
KernelSettings = kernels.KernelSettings
# Rows per call of the few-row kernel (few_rows.cpp's kMaxRows); more run in chunks of this many
_KERNEL_ROWS = 8
# Up to this many rows an fp32 product, and an fp32 block (see `_pass_fits_kernels`), take the kernels,
# the chunks of `_KERNEL_ROWS` passing over each tile of W while it sits in L2: MKL's product of more
# than 8 rows repacks all of W at every call, which costs more than the kernel up to 48 rows and less
# from 64 on (docs/performance.md, "Kernel thresholds").
_KERNEL_MAX_ROWS = 48
# An fp32 block whose weights take at most `KernelSettings.small_block_bytes` (4 MiB) takes the block
# kernels for passes of up to `_SMALL_BLOCK_MAX_ROWS` positions (a prefill): on small blocks the ~60
# tensor operations of a block cost more than MKL's faster products save (the kernels' wide products,
# `pairs_block`, come close to MKL's there); on large ones MKL's products win from about 64 positions on
# (docs/performance.md, "Register tiles for wide products").
_SMALL_BLOCK_MAX_ROWS = 128
# From this many rows a bf16 product on a CPU that emulates bf16 (`_emulated_bf16`: a prefill) runs as
# fp32 MKL on the weight widened for the call, rounded to bf16 once: at that many rows the kernel is
# compute-bound and torch's emulated bf16 product slower still; below it the kernel wins
# (docs/performance.md, "Kernel thresholds").
_WIDEN_MIN_ROWS = 32


@contextlib.contextmanager
def kernels_up_to(level: str | None):
    """Inside the block, run selfspec's compiled CPU paths only up to `level` (A/B runs and tests; the
    default is all of them): None, MKL's products and torch's operations; "products", the few-row
    kernel for the products (`linear`); "blocks", + each block of a decoding pass as two calls
    (`run_block`); "passes", + a pass's blocks in one call (`FastLlamaBlocks.run_range`); "rounds", +
    a greedy round's drafts and its verification in one call each (`draft_loop`, `verify_greedy`);
    "decode", + one row's greedy rounds at a fixed k in one call (`greedy_rounds`).
    Outputs are the same at every level (greedy, fp32: token for token). It sets
    `KernelSettings.level` (`kernels.using(level=level)`) for this thread or asyncio task only: threads
    that decode at other levels meanwhile keep theirs, and a thread started inside the block runs at
    the default level unless its target runs in a copy of this context (`contextvars.copy_context`)."""
    with kernels.using(level=level):
        yield


# Rows per product under `fixed_width` (see there): at least a verification's k + 1 positions.
FIXED_WIDTH = 16
_fixed_width: contextvars.ContextVar[int] = contextvars.ContextVar("fixed_width", default=0)


@contextlib.contextmanager
def fixed_width(enabled: bool = True):
    """Within it, every product of `linear` and every attention of these blocks runs on exactly
    `FIXED_WIDTH` rows (queries): fewer are padded with copies of the last, more are cut into
    chunks. A position's result then never depends on how many positions share its pass. Where
    selfspec's CPU kernels build (`kernels`), products and attention go through them instead,
    unpadded: each row (query) is computed alone in a fixed order there.

    Why: a GEMM's rounding depends on its shape (MKL, oneDNN and cuBLAS pick kernels and reduction
    splits by the number of rows), which is invisible in fp32 but flips bf16 argmaxes: a
    verification of k + 1 positions would not compute what k + 1 single plain steps compute. The
    engine decodes low-precision models inside this context (its prefill, shared by every method,
    stays outside), so its speculative output equals its own plain output token for token.
    """
    token = _fixed_width.set(FIXED_WIDTH if enabled else 0)
    try:
        yield
    finally:
        _fixed_width.reset(token)


def _pad_rows(flat: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, K) -> (ceil(rows / width) · width, K): padded with copies of the last row."""
    extra = -flat.shape[0] % width
    return torch.cat([flat, flat[-1:].expand(extra, -1)]) if extra else flat


def _fixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  width: int) -> torch.Tensor:
    """`linear` with every product over exactly `width` rows (the `fixed_width` context)."""
    rows = x.numel() // x.shape[-1]
    flat = _pad_rows(x.reshape(rows, x.shape[-1]), width)  # (chunks · width, K)
    if x.device.type == "cpu":  # streams W (see `linear`)
        out = torch.cat([torch.mm(weight, chunk.t()).t() for chunk in flat.split(width)])
    else:
        out = torch.cat([F.linear(chunk, weight) for chunk in flat.split(width)])
    out = out[:rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0]).contiguous()


def _emulated_bf16(settings: KernelSettings | None = None) -> bool:
    """True where this CPU has no bf16 arithmetic for oneDNN (AVX2 and older): there torch's bf16
    products of many rows (a prefill) are emulated, several times slower than fp32's
    (docs/performance.md). `KernelSettings.emulated_bf16` decides it where not None."""
    told = (settings or kernels.settings()).emulated_bf16
    return _onednn_lacks_bf16() if told is None else told


@functools.cache
def _onednn_lacks_bf16() -> bool:
    """oneDNN's own answer for `_emulated_bf16`."""
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch without the query: assume the common case
        return True


def _max_kernel_rows(dtype: torch.dtype, settings: KernelSettings, weight_bytes: int | None = None) -> int:
    """The most rows the kernels take outside `fixed_width` (where they take any number):
    `_KERNEL_MAX_ROWS` in fp32 (`_SMALL_BLOCK_MAX_ROWS` for a block of at most the settings'
    `small_block_bytes` of weights, `weight_bytes`); in bf16 fewer than `_WIDEN_MIN_ROWS` on a CPU
    without bf16 arithmetic (`_emulated_bf16`), `_KERNEL_ROWS` on one with it (torch's bf16 product is
    native there)."""
    if dtype == torch.float32:
        small = weight_bytes is not None and weight_bytes <= settings.small_block_bytes
        return _SMALL_BLOCK_MAX_ROWS if small else _KERNEL_MAX_ROWS
    return _WIDEN_MIN_ROWS - 1 if _emulated_bf16(settings) else _KERNEL_ROWS


def _kernel_for(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, width: int,
                settings: KernelSettings):
    """selfspec's few-row kernel (`kernels/few_rows.cpp`) where it applies, else None: the "products"
    level on (`settings`), on CPU, without autograd (it has no backward), fp32 or bf16 throughout (bias
    included: F.linear refuses a mix), a contiguous weight, 1 to `_max_kernel_rows` rows (in chunks of
    8); any number under `fixed_width`."""
    if not settings.runs("products") or x.device.type != "cpu" or not weight.is_contiguous() or (
            weight.shape[1] == 0):
        return None
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype or (
            bias is not None and bias.dtype != x.dtype):
        return None
    if rows < 1 or (rows > _max_kernel_rows(x.dtype, settings) and not width):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    return kernels.few_rows_linear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x (..., K) -> (..., N), computed the way the CPU reads `weight`
    fastest when x has a few rows (a decode step, a verification of k + 1 positions).

    First choice on CPU without autograd, fp32 or bf16, 1 to `_max_kernel_rows` rows (48 in fp32, 31
    in bf16 where the CPU emulates it; in chunks of 8; any number under `fixed_width`), a contiguous
    weight: selfspec's kernel (`kernels/few_rows.cpp`, see `_kernel_for`), which reads each row of W
    once from both cores and multiplies it with every row of x, each output one fp32 dot product in a
    fixed order; it is faster than the MKL paths below for plain steps, draft steps and
    verifications (docs/performance.md). A row's result does not depend on how many rows share the
    call, so under `fixed_width` it needs no padding. Where the kernel does not build, the MKL paths:

    `F.linear` of 2-8 rows (x @ Wᵀ, an sgemm that repacks W) costs more than MKL's one-row product
    (sgemv) per row read, so a verification would cost well over a plain step. The same sgemm posed
    as W @ xᵀ streams W instead, and even one row posed as two columns (the row and a copy) beats
    sgemv on a large weight. Three rows are padded to four the same way (3 columns were slower than
    4); the copies' results are dropped. One row on a weight under `columns_min_bytes_one_row` keeps
    sgemv (on small weights the padding's extra operations cost more than the streaming saves), and
    so do other devices and inputs of more than
    `_COLUMNS_MAX_ROWS` rows (prefill). A bf16 prefill where the CPU emulates bf16 runs in fp32 on
    the widened weight (see `_WIDEN_MIN_ROWS`).

    One row on a large weight of even height runs as a batch of two products, x @ W[:N/2]ᵀ and
    x @ W[N/2:]ᵀ (views of W): MKL's one-row product keeps to one core, and the batch gives each
    core a half. For 2-8 rows the columns path stays faster. The A/B figures behind these choices
    are in docs/performance.md.
    """
    width = _fixed_width.get()
    settings = kernels.settings()
    rows = x.numel() // x.shape[-1]
    kernel = _kernel_for(x, weight, bias, rows, width, settings)
    if kernel is not None:
        out = kernel(x.reshape(rows, x.shape[-1]).contiguous(), weight)  # (rows, N), each row alone
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if width:
        return _fixed_linear(x, weight, bias, width)
    if (x.dtype == weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == x.dtype)
            and rows >= _WIDEN_MIN_ROWS and x.device.type == "cpu" and _emulated_bf16(settings)):
        # the fp32 product of the bf16 values, rounded once, as torch's bf16 product defines it
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(torch.bfloat16)
    if rows > _COLUMNS_MAX_ROWS or x.device.type != "cpu" or (
            rows == 1 and weight.numel() * weight.element_size() < settings.columns_min_bytes_one_row):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])  # (rows, K)
    if rows == 1 and settings.halves_one_row and weight.shape[0] % 2 == 0:
        # W's two halves as a batch of two products (views, no copy): one per core
        halves = weight.view(2, weight.shape[0] // 2, weight.shape[1]).transpose(1, 2)
        out = torch.matmul(flat, halves).reshape(*x.shape[:-1], weight.shape[0])  # (2, 1, N/2) -> (..., N)
        return out if bias is None else out + bias
    if rows in (1, 3):
        flat = torch.cat([flat, flat[-1:]])  # (rows + 1, K)
    out = torch.mm(weight, flat.t()).t()[:rows]  # (rows, N), a transposed view
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0]).contiguous()


@dataclass(frozen=True)
class _Block:
    """The tensors and constants of one block, gathered once (attribute lookups cost as much as ops)."""

    norm1: torch.Tensor
    eps1: float
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    q_norm: tuple[torch.Tensor, float] | None  # Qwen3: RMSNorm over each head's dims
    k_norm: tuple[torch.Tensor, float] | None
    norm2: torch.Tensor
    eps2: float
    w_gate: torch.Tensor
    b_gate: torch.Tensor | None
    w_up: torch.Tensor
    b_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    act: object  # F.silu, or the module's own activation
    head_dim: int
    scaling: float
    gqa: bool  # fewer key/value heads than query heads

    @functools.cached_property
    def weight_bytes(self) -> int:
        """The bytes of the block's seven weights (what a pass reads)."""
        weights = (self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down)
        return sum(w.numel() * w.element_size() for w in weights)

    def tensors(self) -> list[torch.Tensor | None]:
        """Every tensor of the block (None for an absent bias or norm)."""
        qk_norms = [t for norm in (self.q_norm, self.k_norm) for t in (norm or (None,))[:1]]
        return [self.norm1, self.wq, self.bq, self.wk, self.bk, self.wv, self.bv, self.wo, self.bo, *qk_norms,
                self.norm2, self.w_gate, self.b_gate, self.w_up, self.b_up, self.w_down, self.b_down]


def _is_plain_linear(module) -> bool:
    return type(module) is nn.Linear  # a LoRA, quantised or hooked layer computes something else


def _norm(module) -> tuple[torch.Tensor, float] | None:
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or eps is None:
        return None
    return weight, float(eps)


def _records_only(hook) -> bool:
    """Transformers' own output-capturing hook (installed for `output_hidden_states`): it only records,
    so bypassing it changes nothing while no output is being collected."""
    return (getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
            and getattr(hook, "__name__", None) == "output_capturing_hook")


def hooked(modules: nn.Module) -> bool:
    """Whether some module relies on work done around its own call, which this code bypasses: FSDP 1/2
    and DeepSpeed ZeRO-3 gather sharded weights in hooks, accelerate's `device_map` offloading moves
    weights in (`_hf_hook`), and any user forward hook would silently not run."""
    for m in modules.modules():
        if (hasattr(m, "_fsdp_wrapped_module") or type(m).__name__.startswith("FSDP")
                or hasattr(m, "_hf_hook")):
            return True
        hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
        if not all(_records_only(h) for h in hooks):
            return True
    return any(type(p) is not nn.Parameter or hasattr(p, "ds_id") or p.is_meta for p in modules.parameters())


def _gather(layer: nn.Module, config) -> _Block | None:
    """The block's tensors, or None when it is not a plain Llama-family block this code reproduces."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return None
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [_norm(getattr(layer, n, None)) for n in ("input_layernorm", "post_attention_layernorm")]
    if not all(_is_plain_linear(m) for m in linears) or None in norms:
        return None
    q_norm = k_norm = None
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        q_norm, k_norm = _norm(getattr(attn, "q_norm", None)), _norm(getattr(attn, "k_norm", None))
        if q_norm is None or k_norm is None:
            return None
    act = F.silu if getattr(config, "hidden_act", None) == "silu" else getattr(mlp, "act_fn", None)
    if act is None:
        return None
    q, k, v, o, gate, up, down = linears
    return _Block(norms[0][0], norms[0][1], q.weight, q.bias, k.weight, k.bias, v.weight, v.bias,
                  o.weight, o.bias, q_norm, k_norm, norms[1][0], norms[1][1], gate.weight, gate.bias,
                  up.weight, up.bias, down.weight, down.bias, act, int(attn.head_dim), float(attn.scaling),
                  q.weight.shape[0] != k.weight.shape[0])


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value heads (B, Hkv, S, hd) repeated to (B, heads, S, hd), as Hugging Face's repeat_kv."""
    batch, kv_heads, length, head_dim = x.shape
    return x[:, :, None].expand(-1, -1, heads // kv_heads, -1, -1).reshape(batch, heads, length, head_dim)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, b: _Block):
    """SDPA over q (B, Hq, T, hd) and k, v (B, Hkv, S, hd) -> (B, T, Hq·hd), grouped-query heads handled
    as Hugging Face's sdpa integration does (so that CUDA picks the same kernels): `enable_gqa`
    without a mask; with a mask, one query token folds its Hq/Hkv heads into the query length
    (`pack_gqa`), and longer queries repeat the key/value heads."""
    batch, heads, length, head_dim = q.shape
    width = _fixed_width.get()
    if width and (mask is not None or length == 1):  # a decoding pass (cached), not a causal prefill
        if mask is None:  # one query that sees every cached slot
            mask = q.new_zeros(1, 1, 1, k.shape[2])
        attend = _attention_kernel_for(q, k, v)
        if attend is not None:  # every query alone: nothing to pad
            mask = mask.expand(batch, 1, length, k.shape[2]).reshape(batch, length, -1).float().contiguous()
            return attend(q.float().contiguous(), k, v, mask, b.scaling)
        return fixed_attention(q, k, v, mask, b, width)
    gqa = {}
    if b.gqa and mask is None:
        gqa["enable_gqa"] = True
    elif b.gqa and length == 1:
        q = q.reshape(batch, k.shape[1], heads // k.shape[1], head_dim)  # (B, Hkv, groups, hd)
    elif b.gqa:
        k, v = _repeat_kv(k, heads), _repeat_kv(v, heads)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and length > 1,
                                         scale=b.scaling, **gqa)
    return (out.reshape(batch, heads, length, head_dim).transpose(1, 2)
            .reshape(batch, length, heads * head_dim))


def _attention_kernel_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """selfspec's few-query attention kernel (`kernels/few_rows.cpp`) where it applies under
    `fixed_width`, else None: the "products" level on, on CPU, keys and values fp32 or bf16 alike, each
    (row, head)'s (S, hd) slice contiguous (the engine's cache), without autograd."""
    if not kernels.settings().runs("products") or q.device.type != "cpu" or k.dtype not in (
            torch.float32, torch.bfloat16):
        return None
    if v.dtype != k.dtype or k.stride(-1) != 1 or k.stride(-2) != k.shape[-1] or v.stride() != k.stride():
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    return kernels.few_queries_attention()


def fixed_attention(q, k, v, mask, b: _Block, width: int) -> torch.Tensor:
    """Attention of q (B, Hq, T, hd) over every slot of k, v (B, Hkv, S, hd) under `mask` (B or 1, 1, T,
    S; 0 where a query sees a slot, the float32 minimum where not) -> (B, T, Hq·hd), on exactly `width`
    queries per product: the same products for one query as for a verification's k + 1
    (`fixed_width`), and the fixed shapes a CUDA graph replays (the static passes'). The one
    fixed-shape attention of the package."""
    batch, heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    mask = mask.expand(batch, 1, length, k.shape[2])
    extra = -length % width
    if extra:  # pad the queries (and their mask rows) with copies of the last
        q = torch.cat([q, q[:, :, -1:].expand(-1, -1, extra, -1)], 2)
        mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, extra, -1)], 2)
    # Written out in float32 rather than SDPA, whose CPU kernel rounds a query differently when the
    # keys hidden from it sit before the visible ones (a sliding window) and the key count changes.
    # Hidden keys weigh exactly 0 here, and each key keeps its index, so a query's sums are the same
    # for every key count. Grouped-query heads: each key/value head's g query heads as g·width rows of
    # one product, the cache read in place rather than repeated.
    keys, values = k.float().transpose(-1, -2), v.float()  # (B, Hkv, hd, S), (B, Hkv, S, hd)
    out = []
    for qc, mc in zip(q.split(width, 2), mask.split(width, 2)):
        rows = qc.shape[2]
        qg = qc.reshape(batch, kv_heads, groups * rows, head_dim).float()  # (B, Hkv, g·w, hd)
        mg = mc[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * rows, -1)
        scores = torch.matmul(qg, keys) * b.scaling + mg.float()  # (B, Hkv, g·w, S)
        attn = torch.matmul(torch.softmax(scores, -1), values)  # (B, Hkv, g·w, hd)
        out.append(attn.reshape(batch, heads, rows, head_dim).to(q.dtype))
    out = torch.cat(out, 2)[:, :, :length]
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim)


class FastLlamaBlocks:
    """Run Llama/Mistral/Qwen2/Qwen3 blocks without autograd, as flat tensor operations.

    Built from a `LlamaFamilyAdapter`'s layers; `FastLlamaBlocks.build(layers, config)` returns None
    when any block is not one this code reproduces exactly (then the caller keeps the model's own).
    The tensors are the modules' own (`nn.Parameter`s updated in place stay current); a model whose
    modules are *replaced* afterwards (e.g. wrapped by PEFT) needs a new `DecoderView`.
    """

    def __init__(self, blocks: list[_Block], head: tuple | None):
        self.blocks = blocks
        self._extra: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # exit block -> tensors
        self.head = head  # (final norm weight, eps, LM head weight, bias), or None: use the modules
        self._kernel_blocks = None  # (the extension's Block class, the blocks as its objects): `compiled`
        self._silu = all(b.act is F.silu for b in blocks)  # the compiled blocks' MLP activation

    @classmethod
    def build(cls, layers: nn.ModuleList, config, final_norm: nn.Module | None = None,
              lm_head: nn.Module | None = None) -> FastLlamaBlocks | None:
        """Gather every block (and the final norm + LM head when given and plain); None if one is not
        plain."""
        if hooked(layers):
            return None
        blocks = [_gather(layer, config) for layer in layers]
        if any(b is None for b in blocks):
            return None
        norm = _norm(final_norm)
        plain_head = (norm is not None and _is_plain_linear(lm_head)
                      and not hooked(nn.ModuleList([final_norm, lm_head])))
        return cls(blocks, (*norm, lm_head.weight, lm_head.bias) if plain_head else None)

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: (..., D) -> (..., V). Only when `head` is not None."""
        norm_weight, eps, head_weight, head_bias = self.head
        return linear(rms_norm(hidden, norm_weight, eps), head_weight, head_bias)

    def __call__(self, index: int, hidden: torch.Tensor, mask: torch.Tensor | None, cache,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Block `index` on hidden (B, T, D) -> (B, T, D); cos/sin (B, T, hd); mask (B, 1, T, S) or None.

        A cache gets `update(k, v, index)` like Hugging Face's attention calls it. A mask of None means
        causal attention over the T inputs (no cache) or attention to every cached slot (T = 1).
        """
        return run_block(self.blocks[index], index, hidden, mask, cache, cos, sin)

    def run_range(self, start: int, end: int, hidden: torch.Tensor, mask: torch.Tensor | None, cache,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """Blocks [start, end) on hidden (B, T, D) in one compiled call (`kernels.blocks_pass`), each
        writing its keys into `cache`; None, nothing computed, where that does not apply: the caller
        then runs the blocks one by one. Applies to a decoding pass the block kernels take (see
        `_block_kernels_for`) with a cache that lends its buffers (`KVCache.slot_buffers`: every layer
        written before; rows at different slots need the mask). The same calls as block by block, so the same
        bits, without the Python between blocks (argument checks, the cache's `update`, the calls'
        arguments), which is a visible share of a small model's step (docs/performance.md)."""
        compiled = self.compiled()
        slot_buffers = getattr(cache, "slot_buffers", None)
        if (compiled is None or slot_buffers is None or torch.is_grad_enabled()
                or not _pass_fits_kernels(hidden, mask, cos, sin, self.blocks[start])):
            return None
        slots = slot_buffers(start, end)
        if slots is None:
            return None
        keys, values, first, kv_length, row_starts = slots
        batch, length = hidden.shape[:2]
        if mask is not None:  # (B, 1, T, S) -> (B, T, S)
            mask = mask.expand(batch, 1, length, kv_length)[:, 0]
        cos, sin = cos.expand(batch, -1, -1).contiguous(), sin.expand(batch, -1, -1).contiguous()
        blocks, run = compiled
        out = run(blocks[start:end], hidden, keys, values, first, kv_length, mask, cos, sin, row_starts)
        if out is not None:
            cache.written(start, end)
        return out

    def compiled(self):
        """`(the blocks as the kernels' Block objects, blocks_pass)`, the objects built once per extension
        (`tools/kernel_ab.py` swaps it); None where the kernels are not available or off, or a block's
        activation is not SiLU."""
        made = kernels.blocks_pass() if kernels.settings().runs("passes") and self._silu else None
        if made is None:
            return None
        block, run = made
        if self._kernel_blocks is None or self._kernel_blocks[0] is not block:
            self._kernel_blocks = (block, [_kernel_block(block, b) for b in self.blocks])
        return self._kernel_blocks[1], run

    def kernel_block(self, b: _Block):
        """A gathered block outside the model's list (an exit block's) as the kernels' `Block` object, of
        the build `compiled` last made (call it first)."""
        return _kernel_block(self._kernel_blocks[0], b)

    def extra(self, layer: nn.Module, config) -> _Block | None:
        """The gathered tensors of a block outside the model's list (an exit block), built once per
        module; None when it is not a plain block."""
        if layer not in self._extra:
            self._extra[layer] = None if hooked(layer) else _gather(layer, config)
        return self._extra[layer]


def _kernel_block(block_class, b: _Block):
    """The gathered block `b` as the kernels' `Block` object (its tensors shared, not copied)."""
    return block_class(b.norm1, b.eps1, b.wq, b.bq, b.wk, b.bk, b.wv, b.bv, *(b.q_norm or (None, 0.0)),
                       *(b.k_norm or (None, 0.0)), b.head_dim, b.scaling, b.wo, b.bo, b.norm2, b.eps2,
                       b.w_gate, b.b_gate, b.w_up, b.b_up, b.w_down, b.b_down)


def _pass_fits_kernels(hidden: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                       b: _Block) -> bool:
    """Whether a pass on hidden (B, T, D) suits selfspec's block kernels, the tensors of its blocks
    (like `b`) aside: on CPU, fp32 or bf16, a decoding pass (a mask, or one position that sees every
    cached slot) of 1 to `_max_kernel_rows` positions (any number under `fixed_width`), an additive
    float mask, (B, T, hd) angles in hidden's dtype (one row of them is broadcast to every row)."""
    settings = kernels.settings()
    if not settings.runs("blocks") or hidden.device.type != "cpu" or hidden.dtype not in (
            torch.float32, torch.bfloat16):
        return False
    batch, length = hidden.shape[:2]
    rows = batch * length
    if rows < 1 or (rows > _max_kernel_rows(hidden.dtype, settings, b.weight_bytes)
                    and not _fixed_width.get()) or (
            mask is None and length > 1):
        return False
    if cos.dtype != hidden.dtype or sin.dtype != cos.dtype or sin.shape != cos.shape:
        return False
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or tuple(cos.shape[1:]) != (length, b.head_dim):
        return False
    return mask is None or mask.is_floating_point()  # a boolean mask is not additive


def _block_kernels_for(b: _Block, hidden: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor):
    """selfspec's whole-block kernels (`kernels.block_halves`) where they apply, else None: a pass that
    suits them (`_pass_fits_kernels`), without autograd, every tensor of the block in hidden's dtype,
    SwiGLU with SiLU."""
    if b.act is not F.silu or not _pass_fits_kernels(hidden, mask, cos, sin, b):
        return None
    if torch.is_grad_enabled() and (hidden.requires_grad or b.wq.requires_grad):
        return None
    if any(t is not None and (t.dtype != hidden.dtype or not t.is_contiguous()) for t in b.tensors()):
        return None
    return kernels.block_halves()


def run_block(b: _Block, index: int, hidden: torch.Tensor, mask: torch.Tensor | None, cache,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`FastLlamaBlocks.__call__` for the gathered block `b`, writing its keys at cache layer `index`.

    A decoding pass of a few positions runs as two compiled calls (`kernels.block_halves`) around the
    cache write, where they build: the ~60 small tensor operations of a block (norms, rotary, views,
    residuals) and the gaps between its seven product calls are a large share of a plain step on a
    small model (docs/performance.md).
    The tensor operations below are the same computation, for every other case."""
    halves = _block_kernels_for(b, hidden, mask, cos, sin)
    if halves is not None:
        front, back = halves
        batch = hidden.shape[0]
        cos, sin = cos.expand(batch, -1, -1).contiguous(), sin.expand(batch, -1, -1).contiguous()
        q_norm, q_eps = b.q_norm or (None, 0.0)
        k_norm, k_eps = b.k_norm or (None, 0.0)
        q, k, v = front(hidden.contiguous(), b.norm1, b.eps1, b.wq, b.bq, b.wk, b.bk, b.wv, b.bv,
                        q_norm, q_eps, k_norm, k_eps, cos, sin, b.head_dim)
        if cache is not None:
            k, v = cache.update(k, v, index)  # (B, Hkv, S, hd): every slot the layer holds
        if k.dtype == hidden.dtype and _attention_kernel_for(q, k, v) is not None:
            if mask is not None:  # (B, 1, T, S) -> (B, T, S)
                mask = mask.expand(batch, 1, hidden.shape[1], k.shape[2])[:, 0]
            return back(hidden.contiguous(), q, k, v, mask, b.scaling, b.wo, b.bo, b.norm2, b.eps2,
                        b.w_gate, b.b_gate, b.w_up, b.b_up, b.w_down, b.b_down)
        # keys the attention kernel cannot read in place (a cache of another layout or dtype): the
        # tensor path
        attn = _attention(q.to(hidden.dtype), k, v, mask, b)
        hidden = hidden + linear(attn, b.wo, b.bo)
        return mlp_half(b, hidden)
    q, k, v = attention_inputs(b, hidden, cos[:, None], sin[:, None])  # one angle per position, all heads
    if cache is not None:
        k, v = cache.update(k, v, index)  # (B, Hkv, S, hd): every slot the layer holds
    attn = _attention(q, k, v, mask, b)  # (B, T, Hq·hd)
    hidden = hidden + linear(attn, b.wo, b.bo)
    return mlp_half(b, hidden)


def attention_inputs(b: _Block, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     product=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's first half before attention on hidden (B, T, D): RMSNorm -> q/k/v projections ->
    (Qwen3's q and k norms) -> rotary with cos, sin (B, 1, T, hd). q (B, Hq, T, hd), k and v
    (B, Hkv, T, hd). `product`: the matrix product (`linear` by default; the static passes give
    `F.linear`, which a CUDA graph captures)."""
    product = product or linear
    batch, length, _ = hidden.shape
    x = rms_norm(hidden, b.norm1, b.eps1)
    q = product(x, b.wq, b.bq).view(batch, length, -1, b.head_dim)
    k = product(x, b.wk, b.bk).view(batch, length, -1, b.head_dim)
    v = product(x, b.wv, b.bv).view(batch, length, -1, b.head_dim).transpose(1, 2)
    if b.q_norm is not None:
        q, k = rms_norm(q, *b.q_norm), rms_norm(k, *b.k_norm)
    return apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin), v


def mlp_half(b: _Block, hidden: torch.Tensor, product=None) -> torch.Tensor:
    """A block's second half after attention's residual: RMSNorm -> SwiGLU MLP -> residual
    (`product` as in `attention_inputs`)."""
    product = product or linear
    x = rms_norm(hidden, b.norm2, b.eps2)
    mlp = b.act(product(x, b.w_gate, b.b_gate)) * product(x, b.w_up, b.b_up)
    return hidden + product(mlp, b.w_down, b.b_down)
