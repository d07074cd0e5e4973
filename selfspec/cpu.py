"""CPU runtime settings that change speed, never results (and `sync_device`, for timing any device,
and `to_device`, a host tensor sent up without waiting).

Training and evaluation on CPU allocate and free (tokens, vocabulary) logits blocks of hundreds of
megabytes every step (49,152 × 2,048 fp32 values are 400 MB). glibc serves such blocks with mmap and
returns them to the kernel on free, so the next step faults every page in again and the kernel
zeroes it: on SmolLM2-135M that was half the CPU time in system calls and a quarter of the step
time. `keep_freed_memory` makes glibc keep freed memory for reuse instead.

`on_a_thread_that_ends` keeps a model's loading from slowing the thread that later decodes it.
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import platform
import threading
from pathlib import Path

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8


def keep_freed_memory() -> bool:
    """Tell glibc to serve large blocks from its heap and keep freed memory (Linux only).

    The process's peak resident memory stays reserved after a peak instead of being returned;
    nothing else changes. Returns whether the setting was applied (False off glibc).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # No mmap for big blocks, no trimming of the heap top, and grow it in 1 GiB steps.
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 1 << 30)))


def one_heap() -> bool:
    """Serve the allocations of every thread started from now on from glibc's one main heap (Linux only):
    memory that a worker thread frees (a request's grammar compiled and dropped) is then reused by
    every thread and goes back to the kernel with `release_freed_memory`, where a heap per thread keeps
    much of it resident. For a server, whose threads allocate little beside the decoding thread's
    tensors. Call it before any other thread allocates: a heap made before stays, later threads are dealt
    out among the heaps there are, and the free top of a heap other than the main one is never returned.
    Whether the setting was applied (False off glibc)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(_M_ARENA_MAX, 1) == 1


def release_freed_memory() -> bool:
    """Return the heap's free pages to the kernel now (glibc's `malloc_trim`, every arena; Linux only),
    whatever `keep_freed_memory` set: a long-running process calls it when idle, so that one peak (a
    request's huge grammar) does not stay resident. Whether it ran (False off glibc)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    return True


def has_bf16_units() -> bool | None:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 or AMX, Arm BF16); None off Linux.

    Without them torch emulates bf16 matrix products, and a bf16 autocast training step runs many
    times slower than fp32 (docs/results.md).
    """
    try:
        with open("/proc/cpuinfo") as handle:
            flags = set(handle.read().split())
    except OSError:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def last_level_cache_bytes() -> int | None:
    """The size of CPU 0's last-level cache (Linux sysfs); None where it cannot be read."""
    best = None  # (level, bytes)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * scale)
    return None if best is None else best[1]


def on_a_thread_that_ends(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` run on a new thread, waited for; its result, or its exception re-raised.

    Why: libgomp (PyTorch's OpenMP on Linux) gives every thread that starts a parallel region a team of
    worker threads of its own, kept until that thread exits. Once the process holds more such threads
    than CPUs, libgomp throttles every team: their workers stop spinning and sleep between parallel
    regions, and a decoding pass holds a hundred regions per token. A model loaded on the main
    thread (its copies run in parallel) and then decoded on another thread (a server's decode loop, a
    web framework's worker) decoded the embedded default 2.4× slower than on one thread. The team of a
    thread that ends goes with it, so loading here leaves the caller's thread without one, and
    whichever thread decodes first owns the only team. Its stack goes back too: the megabytes a deep
    recursion touched (a grammar's compilation) do not stay resident in a long-lived thread.
    """
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            result.append((False, exc))

    # in a copy of the caller's context: its context variables (the kernel settings, `fixed_width`) hold
    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), name="selfspec-load",
                              daemon=True)
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def sync_device(device) -> None:
    """Wait until the work queued on `device` (a torch.device or a name like "cuda:0") is done.

    GPU kernels run asynchronously: a timer read right after a call measures the launch, not the
    work, so time a step as sync_device, start, step, sync_device, stop. On the CPU (whose work is
    done when the call returns) it does nothing.
    """
    import torch  # here, so that the allocator settings above load without torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def to_device(tensor, device):
    """`tensor` (host memory) on `device`, without the host waiting for the device.

    A copy to a GPU from pageable memory waits for every kernel queued before it (CUDA stages it
    through pinned memory; torch's blocking copy synchronizes the stream): a sync, like a host read.
    From pinned memory with `non_blocking=True` the copy is queued like a kernel, and torch's caching
    host allocator keeps the pinned block until the copy has run. On the CPU `tensor` itself."""
    import torch

    device = torch.device(device)
    if device.type == "cpu" or tensor.device == device:
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
