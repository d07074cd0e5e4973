"""selfspec's compiled CPU kernels (`few_rows.cpp`): x @ Wᵀ for a few rows of x, streaming W once, the
attention of a few queries, each computed alone in a fixed order, a Llama-family block for a few
positions as two calls around the cache write (built from those two), and a range of blocks with their
cache writes in one call.

Built on first use with torch's own extension builder (a C++ compiler and ninja; AVX2 + FMA;
OpenMP, so that `at::parallel_for` spreads the rows over torch's own threads) and
cached by torch under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`). Where it cannot be
built (no compiler, another CPU, not POSIX, `SELFSPEC_KERNELS=0`) both accessors return None
once and for all, with one warning if the build itself failed, and `fast` keeps MKL's products and
its padded attention. Processes that start together build once: the first holds a lock file, the others wait.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no compiler setup the kernel supports either
    fcntl = None

_SOURCE = Path(__file__).with_name("few_rows.cpp")
_NAME = "selfspec_few_rows"


def _cpu_has_avx2_fma() -> bool:
    """AVX2 and FMA, the kernel's instructions (torch reports AVX2 or better as its CPU capability)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@contextlib.contextmanager
def _build_lock(root: Path):
    """Held around the build: one selfspec process builds at a time, and any lock file of torch's
    found while holding it was left by a killed build (torch waits for its lock forever). The OS
    releases this lock when its process dies, so it can never be stale itself."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{_NAME}.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            for stale in root.glob(f"*/{_NAME}/lock"):  # torch builds into <root>/<python tag>/<name>
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def few_rows_linear() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The compiled `few_rows_linear(x (m, K), weight (N, K)) -> (m, N)` (fp32 or bf16; more than 8 rows
    in chunks of 8), or None where the kernels are not available."""
    module = _module()
    return None if module is None else module.few_rows_linear


def few_queries_attention() -> Callable | None:
    """The compiled `few_queries_attention(q (B, H, m, hd) fp32, k, v (B, Hkv, S, hd) fp32 or bf16,
    mask (B, m, S) fp32 additive, scale) -> (B, m, H·hd)` in k's dtype, every query computed alone in
    a fixed order; or None where the kernels are not available."""
    module = _module()
    return None if module is None else module.few_queries_attention


def block_halves() -> tuple[Callable, Callable] | None:
    """The compiled halves of a Llama-family block for a few positions, or None where the kernels are
    not available: `block_front(hidden, norm, eps, wq, bq, wk, bk, wv, bv, q_norm, q_eps, k_norm, k_eps,
    cos, sin, head_dim) -> (q fp32 (B, H, T, hd), k, v (B, Hkv, T, hd))` before the cache write, and
    `block_back(hidden, q, keys, values, mask (B, T, S) or None, scale, wo, bo, norm, eps, w_gate,
    b_gate, w_up, b_up, w_down, b_down) -> (B, T, D)` after it."""
    module = _module()
    return None if module is None else (module.block_front, module.block_back)


def blocks_pass() -> tuple[type, Callable] | None:
    """The compiled `(Block, blocks_pass)`, or None where the kernels are not available. `Block(norm1,
    eps1, wq, bq, wk, bk, wv, bv, q_norm, q_eps, k_norm, k_eps, head_dim, scale, wo, bo, norm2, eps2,
    w_gate, b_gate, w_up, b_up, w_down, b_down)` holds one block's tensors; `blocks_pass(blocks, hidden
    (B, T, D), keys, values, start, kv_length, mask (B, T, kv_length) or None, cos, sin)` runs the blocks
    one after the other as `block_halves` does, writing each one's keys and values into its buffer
    (B, Hkv, capacity, hd) at slots start .. start + T - 1, and returns the last one's output, or None
    (nothing computed) where a block's tensors or a buffer do not suit the kernels."""
    module = _module()
    return None if module is None else (module.Block, module.blocks_pass)


def draft_loop() -> Callable | None:
    """The compiled `draft_loop(blocks, embed, token, keys, values, start, cos, sin, norm, eps, head, bias,
    ids, vocab, k, eta) -> [drafts (B, s), hidden (B, s + 1, D)]` (greedy early-exit drafts: k steps of
    `blocks_pass` over blocks [0, E), the draft head and the argmax, stopping below eta; [] where
    `blocks_pass` declines), or None where the kernels are not available."""
    module = _module()
    return None if module is None else module.draft_loop


def draft_choice() -> Callable | None:
    """The compiled `draft_choice(h (B, D), norm, eps, head (V', D), bias, ids, vocab, allowed, eta) ->
    [draft (B,), top (B,)]` (greedy drafts from exit states: the final norm, the draft head, a grammar's
    mask (B, V) and the first maximum by token id in one pass, with each draft's probability for η
    where eta > 0), or None where the kernels are not available."""
    module = _module()
    return None if module is None else module.draft_choice


def draft_step() -> Callable | None:
    """The compiled `draft_step(blocks, extra, embed, tokens, keys, values, start, cos, sin, mask_value, norm,
    eps, head, bias, ids, vocab, allowed, eta, row_starts) -> [draft (B,), hidden (B, T, D), sure (1,)]`
    (one greedy early-exit step: `blocks_pass` over blocks [0, E), then the exit blocks `extra`, the
    draft head, a grammar's mask and the argmax; [] where `blocks_pass` declines), or None where the
    kernels are not available."""
    module = _module()
    return None if module is None else module.draft_step


def verify_greedy() -> Callable | None:
    """The compiled `verify_greedy(blocks, hidden, tokens, embed, keys, values, start, cos, sin, mask_value,
    norm, eps, head, bias, drafts, allowed) -> [decided (B, T + 1)]` (the target's pass, head,
    a grammar's masks, argmax and accepted prefix; [] where `blocks_pass` declines), or None where the
    kernels are not available."""
    module = _module()
    return None if module is None else module.verify_greedy


def greedy_rounds() -> Callable | None:
    """The compiled `greedy_rounds(blocks, exit_layer, embed, keys, values, start, token, cos, sin,
    mask_value, norm, eps, head, bias, draft_head, draft_bias, ids, vocab, k, eta, eos, max_tokens,
    max_rounds, history, min_ngram, max_ngram, copy_limit, overlap) -> [tokens (t,), rounds (R, 5), seconds
    (R, 2)]` (one row's greedy rounds at a fixed k: `draft_loop` and `verify_greedy` each round; with
    `history` a copy of up to copy_limit tokens first, else a plain step (k = 0) or the early exit's
    drafts, a copy after them where they make one; with `overlap` a round's verification beside the
    next round's drafts, on two threads; the kept tokens cut at an eos and max_tokens; [] where
    `blocks_pass` declines), or None where the kernels are not available."""
    module = _module()
    return None if module is None else module.greedy_rounds


def build(source: Path, name: str):
    """Compile `source` as the extension `name` with the kernels' flags (torch caches the build under
    `name`); raises what the build raises. `tools/kernel_ab.py --against` builds a second version with it."""
    from torch.utils import cpp_extension

    return cpp_extension.load(name=name, sources=[str(source)],
                              extra_cflags=["-O3", "-funroll-loops", "-mavx2", "-mfma", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)


@functools.cache
def _module():
    """The compiled extension, built once per machine, or None."""
    if os.environ.get("SELFSPEC_KERNELS", "1").lower() in ("0", "false", "off", "no"):
        return None
    compiler = (os.environ.get("CXX") or "c++").split()[0]  # CXX may be "ccache g++"
    if fcntl is None or not _cpu_has_avx2_fma() or None in (shutil.which(compiler), shutil.which("ninja")):
        return None
    try:  # whatever fails here (toolchain, file system), decoding keeps MKL's products
        from torch.utils import cpp_extension

        root = Path(cpp_extension.get_default_build_root())
        with _build_lock(root):
            if not any(root.glob(f"*/{_NAME}/{_NAME}.so")):
                print("selfspec: building its CPU kernels for decoding (once per machine, about a minute)",
                      file=sys.stderr, flush=True)
            module = build(_SOURCE, _NAME)
    except Exception as error:
        first = str(error).splitlines()[0] if str(error) else ""
        warnings.warn(f"selfspec's CPU kernels did not build ({type(error).__name__}: {first}); decoding "
                      f"uses MKL's products", stacklevel=2)
        return None
    return module


__all__ = ["block_halves", "blocks_pass", "draft_choice", "draft_loop", "draft_step", "few_queries_attention",
           "few_rows_linear", "greedy_rounds", "verify_greedy"]
