"""selfspec's one compiled CPU kernel: x @ Wᵀ for 1-8 rows of x, streaming W once (`few_rows.cpp`).

Built on first use with torch's own extension builder (a C++ compiler and ninja; AVX2 + FMA;
OpenMP, so that `at::parallel_for` spreads the rows over torch's own threads) and
cached by torch under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`). Where it cannot be
built (no compiler, another CPU, `SELFSPEC_KERNELS=0`) `few_rows_linear()` returns None once and for
all, with one warning if the build itself failed, and `fast.linear` keeps MKL's products.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("few_rows.cpp")
# A build takes about a minute on 2 cores; a lock file older than this was left by a killed one
_STALE_LOCK_SECONDS = 600


def _cpu_has_avx2_fma() -> bool:
    """AVX2 and FMA, the kernel's instructions (torch reports AVX2 or better as its CPU capability)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def few_rows_linear() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The compiled `few_rows_linear(x (m, K), weight (N, K)) -> (m, N)` (fp32 or bf16, m <= 8), or None
    where it is not available."""
    if os.environ.get("SELFSPEC_KERNELS", "1") == "0" or not _cpu_has_avx2_fma():
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        return None
    from torch.utils import cpp_extension

    name = "selfspec_few_rows"
    # torch builds into <root>/<python and device tag>/<name>, under a lock file that a killed build
    # leaves behind, and waits for it forever: a lock older than any build is stale
    root = Path(cpp_extension.get_default_build_root())
    for lock in root.glob(f"*/{name}/lock"):
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)
    if not any(root.glob(f"*/{name}/{name}.so")):
        print("selfspec: building its CPU kernel for few-row products (once per machine, about a minute)",
              file=sys.stderr, flush=True)
    try:
        module = cpp_extension.load(name=name, sources=[str(_SOURCE)],
                                    extra_cflags=["-O3", "-funroll-loops", "-mavx2", "-mfma", "-fopenmp"],
                                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # a broken toolchain must not stop decoding: MKL's products remain
        warnings.warn(f"selfspec's CPU kernel did not build ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); decoding uses MKL's products",
                      stacklevel=2)
        return None
    return module.few_rows_linear


__all__ = ["few_rows_linear"]
