"""selfspec's compiled CPU kernels (`few_rows.cpp`): x @ Wᵀ for a few rows of x, streaming W once, the
attention of a few queries, each computed alone in a fixed order, a Llama-family block for a few
positions as two calls around the cache write (built from those two), and a range of blocks with their
cache writes in one call.

The extension also holds the decoding algorithm's calls that run these (drafts, η, the verification,
n-gram copies, fused rounds): `selfspec/backends/cpu_rounds/rounds.cpp`, which includes `few_rows.h`; their
accessors are `selfspec.backends.cpu_rounds`. This module builds the extension from both sources
(`SOURCES`) and holds it (`extension()`) with its settings; it imports nothing of the backends.

Built on first use with torch's own extension builder (a C++ compiler and ninja; AVX2 + FMA;
OpenMP, so that `at::parallel_for` spreads the rows over torch's own threads) and
cached by torch under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`). Where it cannot be
built (no compiler, another CPU, not POSIX, `SELFSPEC_KERNELS=0`) the accessors return None
once and for all, with one warning if the build itself failed, and `fast` keeps MKL's products and
its padded attention. Processes that start together build once: the first holds a lock file, the others wait.

`KernelSettings` is the one value that switches the compiled paths and the backend's choices (how far
`fast` runs the compiled paths, its thresholds, a wrapper around the extension), held in a
`contextvars.ContextVar`: `settings()` reads it, `using(**changes)` changes it within a block for the
current thread or asyncio task only, so threads that decode at other settings meanwhile do not see
each other's. A thread starts with the default settings, not those of the thread that started it: code
that starts a thread to decode on runs its target in `contextvars.copy_context().run` (the server's
threads, `cpu.on_a_thread_that_ends`), so it inherits them; asyncio tasks copy the context themselves,
and the C++ threads of a compiled call (`overlap`) run with what the call was given.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no compiler setup the kernel supports either
    fcntl = None

# The extension's sources, relative to the package's folder: the model's passes, and the decoding calls
# on them (which define the extension's module)
SOURCES = ("model/kernels/few_rows.cpp", "backends/cpu_rounds/rounds.cpp")
_PACKAGE = Path(__file__).parents[2]
# its build folder under torch's build root (not the one-source extension's, `selfspec_few_rows`)
_NAME = "selfspec_kernels"

# The compiled paths of `fast`, each on top of the one before (see `KernelSettings.level`)
KERNEL_LEVELS = ("products", "blocks", "passes", "rounds", "decode")
_RANK = {level: rank for rank, level in enumerate(KERNEL_LEVELS)}


def requested() -> bool:
    """Whether the environment allows the kernels: `SELFSPEC_KERNELS` unset or not 0 / false / off / no."""
    return os.environ.get("SELFSPEC_KERNELS", "1").lower() not in ("0", "false", "off", "no")


def _default_level() -> str | None:
    return KERNEL_LEVELS[-1] if requested() else None


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """The switches of selfspec's compiled CPU paths and of `fast`'s backend choices, one immutable value
    held per thread or task (see the module docstring; `settings()`, `using()`).

    level: the compiled paths run up to this one (`fast.kernels_up_to` says what each adds): None,
    MKL's products and torch's operations; "products", "blocks", "passes", "rounds" or "decode" (all of
    them, the default; None where `SELFSPEC_KERNELS` turns the kernels off). Outputs are the same at
    every level (greedy, fp32: token for token); A/B runs and tests change it.
    small_block_bytes: an fp32 block whose weights take at most this many bytes takes the block kernels
    for passes of up to `fast._SMALL_BLOCK_MAX_ROWS` positions (a prefill); 0: no block is small.
    columns_min_bytes_one_row: one row takes `fast.linear`'s MKL columns path (or halves) only on a
    weight of at least this many bytes (0: every weight).
    halves_one_row: one row on such a weight runs as a batch of W's two halves (False: the columns
    path, for A/B).
    emulated_bf16: whether the CPU has no bf16 arithmetic for oneDNN (`fast._emulated_bf16`); None
    asks oneDNN, True or False decides (tests of both machines' paths).
    wrap: None, or a function of the built extension whose result the accessors below take their
    functions from instead (a checking or counting wrapper, another build for A/B); `wrapped` composes
    them."""

    level: str | None = dataclasses.field(default_factory=_default_level)
    small_block_bytes: int = 4 << 20
    columns_min_bytes_one_row: int = 1 << 20
    halves_one_row: bool = True
    emulated_bf16: bool | None = None
    wrap: Callable | None = None
    _rank: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.level is not None and self.level not in _RANK:
            raise ValueError(f"kernel level {self.level!r} is not None or one of {', '.join(KERNEL_LEVELS)}")
        for name in ("small_block_bytes", "columns_min_bytes_one_row"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        object.__setattr__(self, "_rank", -1 if self.level is None else _RANK[self.level])

    def runs(self, level: str) -> bool:
        """Whether the compiled path `level` (one of `KERNEL_LEVELS`) is on."""
        return self._rank >= _RANK[level]


_settings: contextvars.ContextVar[KernelSettings] = contextvars.ContextVar(
    "kernel_settings", default=KernelSettings())  # noqa: B039 - frozen: never changed in place
# `settings()`: the current thread's or task's `KernelSettings` (the ContextVar's own `get`: the hot
# paths of `fast` read it at every product)
settings = _settings.get


@contextlib.contextmanager
def using(**changes) -> Iterator[KernelSettings]:
    """Inside the block, the current `KernelSettings` with `changes` (its field names) replaced, for
    this thread or asyncio task only (and threads started with a copy of its context); restored after
    it. Yields the settings in force."""
    token = _settings.set(dataclasses.replace(settings(), **changes))
    try:
        yield settings()
    finally:
        _settings.reset(token)


@contextlib.contextmanager
def wrapped(wrap: Callable) -> Iterator[KernelSettings]:
    """Inside the block, the accessors below take their functions from `wrap(extension)` instead of the
    built extension (`using(wrap=...)`, composed with a wrapper already in force: that one applies
    first). Tests wrap the kernels to check or count their calls; `tools/kernel_ab.py` returns
    another build."""
    outer = settings().wrap
    with using(wrap=wrap if outer is None else lambda module: wrap(outer(module))) as current:
        yield current


def cpu_has_avx2_fma() -> bool:
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
    module = extension()
    return None if module is None else module.few_rows_linear


def few_queries_attention() -> Callable | None:
    """The compiled `few_queries_attention(q (B, H, m, hd) fp32, k, v (B, Hkv, S, hd) fp32 or bf16,
    mask (B, m, S) fp32 additive, scale) -> (B, m, H·hd)` in k's dtype, every query computed alone in
    a fixed order; or None where the kernels are not available."""
    module = extension()
    return None if module is None else module.few_queries_attention


def block_halves() -> tuple[Callable, Callable] | None:
    """The compiled halves of a Llama-family block for a few positions, or None where the kernels are
    not available: `block_front(hidden, norm, eps, wq, bq, wk, bk, wv, bv, q_norm, q_eps, k_norm, k_eps,
    cos, sin, head_dim) -> (q fp32 (B, H, T, hd), k, v (B, Hkv, T, hd))` before the cache write, and
    `block_back(hidden, q, keys, values, mask (B, T, S) or None, scale, wo, bo, norm, eps, w_gate,
    b_gate, w_up, b_up, w_down, b_down) -> (B, T, D)` after it."""
    module = extension()
    return None if module is None else (module.block_front, module.block_back)


def blocks_pass() -> tuple[type, Callable] | None:
    """The compiled `(Block, blocks_pass)`, or None where the kernels are not available. `Block(norm1,
    eps1, wq, bq, wk, bk, wv, bv, q_norm, q_eps, k_norm, k_eps, head_dim, scale, wo, bo, norm2, eps2,
    w_gate, b_gate, w_up, b_up, w_down, b_down)` holds one block's tensors; `blocks_pass(blocks, hidden
    (B, T, D), keys, values, start, kv_length, mask (B, T, kv_length) or None, cos, sin)` runs the blocks
    one after the other as `block_halves` does, writing each one's keys and values into its buffer
    (B, Hkv, capacity, hd) at slots start .. start + T - 1, and returns the last one's output, or None
    (nothing computed) where a block's tensors or a buffer do not suit the kernels."""
    module = extension()
    return None if module is None else (module.Block, module.blocks_pass)


def sources(root: Path = _PACKAGE) -> list[Path]:
    """The extension's sources under `root`, a folder laid out as the package's (the package's own by
    default; `tools/kernel_ab.py --against` passes another revision's)."""
    return [root / source for source in SOURCES]


def build(files: list[Path], name: str):
    """Compile `files` (`sources()`, or one file that is the whole extension) as the extension `name`
    with the kernels' flags; raises what the build raises. torch caches the build under `name`, and ninja
    rebuilds what changed (a header through the compiler's dependency files). `tools/kernel_ab.py
    --against` builds a second version with it."""
    from torch.utils import cpp_extension

    return cpp_extension.load(name=name, sources=[str(file) for file in files],
                              extra_cflags=["-O3", "-funroll-loops", "-mavx2", "-mfma", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)


def extension():
    """The compiled extension (as the settings' `wrap` makes it), or None where the kernels are not
    available. The accessors above and the decoding calls' (`selfspec.backends.cpu_rounds`) take their
    functions from it; a function without an accessor (`masked_target`, which `verify_greedy` runs) is
    reached through it."""
    module = _built()
    wrap = settings().wrap
    return module if module is None or wrap is None else wrap(module)


def look_again() -> None:
    """Forget the built extension, or that there is none: the next accessor looks it up (and builds it)
    anew, reading `SELFSPEC_KERNELS` again for the build (tests); the default `KernelSettings.level`
    was read at import and stays (set another with `using(level=...)`)."""
    _built.cache_clear()


def ninja_path() -> str | None:
    """The ninja torch's build runs: the one on PATH, else the `ninja` package's (a dependency of
    selfspec; its folder is put on PATH, where torch's build looks, when the venv's bin is not there)."""
    found = shutil.which("ninja")
    if found is not None:
        return found
    try:
        import ninja
    except ImportError:
        return None
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja")


@functools.cache
def _built():
    """The compiled extension, built once per machine, or None."""
    if not requested():
        return None
    compiler = (os.environ.get("CXX") or "c++").split()[0]  # CXX may be "ccache g++"
    if fcntl is None or not cpu_has_avx2_fma():
        return None
    if None in (shutil.which(compiler), ninja_path()):
        warnings.warn(f"selfspec's CPU kernels need a C++ compiler ({compiler}) and ninja to build; without "
                      f"them decoding uses torch's operations, several times slower", stacklevel=2)
        return None
    try:  # whatever fails here (toolchain, file system), decoding keeps MKL's products
        from torch.utils import cpp_extension

        root = Path(cpp_extension.get_default_build_root())
        with _build_lock(root):
            if not any(root.glob(f"*/{_NAME}/{_NAME}.so")):
                print("selfspec: building its CPU kernels for decoding (once per machine, about a minute)",
                      file=sys.stderr, flush=True)
            module = build(sources(), _NAME)
    except Exception as error:
        first = str(error).splitlines()[0] if str(error) else ""
        warnings.warn(f"selfspec's CPU kernels did not build ({type(error).__name__}: {first}); decoding "
                      f"uses MKL's products", stacklevel=2)
        return None
    return module


__all__ = ["KERNEL_LEVELS", "KernelSettings", "SOURCES", "block_halves", "blocks_pass", "build",
           "cpu_has_avx2_fma", "extension", "few_queries_attention", "few_rows_linear", "look_again",
           "ninja_path", "requested", "settings", "sources", "using", "wrapped"]
