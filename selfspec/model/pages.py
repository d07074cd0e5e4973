"""A CPU-decoded model's weights moved onto 2 MiB pages (Linux transparent huge pages).

Decoding at batch 1 reads every weight once a step, and on 4 KiB pages a 135M-parameter model spans
130k of them: the address translation of that stream costs time of its own (docs/performance.md,
"Weights on 2 MiB pages"). Linux backs a range with 2 MiB pages where the range is 2 MiB-aligned and,
in transparent huge pages' "madvise" mode, asks for them (`madvise(MADV_HUGEPAGE)`); torch's
allocator aligns to 64 bytes, so the weights are copied into one buffer that is. The parameters stay
the same `nn.Parameter` objects (their `.data` now views into the buffer), tied weights stay tied,
and every value is the same: only where the bytes live changes.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <linux/mman.h>
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ALIGN = 4096  # each weight's first byte: a page boundary, so no two weights share a cache line


def huge_pages_available() -> bool:
    """Linux with transparent huge pages not turned off, and not turned off for selfspec
    (`SELFSPEC_HUGE_PAGES=0`)."""
    if os.environ.get("SELFSPEC_HUGE_PAGES", "1").lower() in ("0", "false", "off", "no"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def _madvise_huge(address: int, length: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    if libc.madvise(address, length, _MADV_HUGEPAGE) == 0:
        return True
    warnings.warn(f"selfspec: madvise(MADV_HUGEPAGE) failed ({os.strerror(ctypes.get_errno())}); the "
                  f"weights stay on ordinary pages", stacklevel=3)
    return False


def _huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """An untouched uint8 tensor of `nbytes` bytes that starts on a 2 MiB boundary and asks for 2 MiB
    pages (no page is backed until written), or None where that is not available."""
    if not huge_pages_available() or nbytes < HUGE_PAGE:
        return None
    padded = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages: the range madvise covers
    buffer = torch.empty(padded + HUGE_PAGE, dtype=torch.uint8)  # + the slack to reach a boundary
    start = -buffer.data_ptr() % HUGE_PAGE
    if not _madvise_huge(buffer.data_ptr() + start, padded):
        return None
    return buffer[start:start + nbytes]


def empty_on_huge_pages(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.empty(numel, dtype=dtype)` on 2 MiB pages where available (a bandwidth probe that reads
    memory as the moved weights lie), else on the allocator's own."""
    buffer = _huge_page_buffer(numel * torch.empty((), dtype=dtype).element_size())
    return torch.empty(numel, dtype=dtype) if buffer is None else buffer.view(dtype)


def onto_huge_pages(model: nn.Module) -> int:
    """Move the CPU parameters of `model` that own their whole storage into one 2 MiB-aligned buffer
    that asks for 2 MiB pages; returns the bytes moved (0: nothing moved, where huge pages are not
    available or the weights are smaller than one such page). Each parameter is copied, then its old
    storage released before the next, so the peak is the model plus one weight."""
    # the parameters that own their whole storage, grouped by it: two objects on one storage (a tie
    # made of two parameters) move together, onto one home, so they stay one tensor
    groups: dict[int, list[nn.Parameter]] = {}
    for p in model.parameters():
        if (type(p.data) is torch.Tensor and p.device.type == "cpu" and p.is_contiguous()
                and p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size()):
            groups.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    offsets, total = [], 0
    for group in groups.values():
        offsets.append(total)
        total += -(-group[0].untyped_storage().nbytes() // _ALIGN) * _ALIGN
    buffer = _huge_page_buffer(total)
    if buffer is None:
        return 0
    with torch.no_grad():
        for group, offset in zip(groups.values(), offsets):
            home = buffer[offset:offset + group[0].untyped_storage().nbytes()]
            home.view(group[0].dtype).view(group[0].shape).copy_(group[0])
            for p in group:
                p.data = home.view(p.dtype).view(p.shape)
    return total


__all__ = ["HUGE_PAGE", "empty_on_huge_pages", "huge_pages_available", "onto_huge_pages"]
