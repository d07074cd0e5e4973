"""CPU runtime helpers: loading on a thread that ends leaves the caller's thread without an OpenMP team."""

import os
import platform
import subprocess
import sys

import pytest
from helpers import tiny_model

from selfspec.checkpoint import save_tuned
from selfspec.cpu import on_a_thread_that_ends
from selfspec.decoding import DecodeSettings
from selfspec.errors import UserError


def test_a_thread_that_ends_hands_back_the_result_and_the_exception():
    assert on_a_thread_that_ends(lambda a, b=0: a + b, 2, b=3) == 5

    def fails():
        raise UserError("no such checkpoint")

    with pytest.raises(UserError, match="no such checkpoint"):
        on_a_thread_that_ends(fails)


# In a fresh interpreter with two OpenMP threads: how many threads a parallel op on the main thread adds
# after `setup`. A thread's first parallel region starts its team (one worker thread here); a thread
# that already holds one adds none.
_COUNT = """
import os, sys, time, torch
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def settled():  # the workers of a thread that ended leave a moment after it
    counts = [threads()]
    while len(counts) < 50 and (len(counts) < 5 or len(set(counts[-5:])) > 1):
        time.sleep(0.05)
        counts.append(threads())
    return counts[-1]
{setup}
before = settled()
torch.ones(1 << 22).add_(1)  # a parallel region on the main thread
print(threads() - before)
"""


def _workers_added(setup: str) -> int:
    out = subprocess.run([sys.executable, "-c", _COUNT.format(setup=setup)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux", reason="counts threads in /proc/self/task")
def test_loading_leaves_the_callers_thread_without_an_openmp_team(tmp_path):
    # 8192 x 32 embedding values: loading copies them in parallel regions
    path = save_tuned(tmp_path / "ckpt", tiny_model("llama", vocab_size=8192),
                      settings=DecodeSettings(exit_layer=2))
    # the control: a team started on the main thread stays, so a second parallel op adds no thread
    assert _workers_added("torch.ones(1 << 22).add_(1)") == 0
    assert _workers_added("from selfspec.cpu import on_a_thread_that_ends\n"
                          "on_a_thread_that_ends(lambda: torch.ones(1 << 22).add_(1))") == 1
    assert _workers_added(f"from selfspec.checkpoint import load_tuned\nload_tuned({str(path)!r})") == 1


def test_release_freed_memory_runs_on_glibc():
    import platform

    from selfspec.cpu import release_freed_memory

    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert release_freed_memory() is on_glibc


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("one", [True, False])
def test_after_one_heap_a_new_threads_allocations_come_from_the_main_heap(one):
    """glibc's malloc_stats lists its arenas: a thread started after `one_heap` allocates from arena 0
    alone; without it (the control), from an arena of its own."""
    code = ("import ctypes, threading\n"
            "from selfspec.cpu import one_heap\n"
            f"assert one_heap() if {one} else True\n"
            "libc = ctypes.CDLL('libc.so.6')\n"
            "libc.malloc.restype = ctypes.c_void_p\n"
            "thread = threading.Thread(target=lambda: libc.malloc(1000))\n"
            "thread.start(); thread.join()\n"
            "libc.malloc_stats()\n")
    stats = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "Arena 0:" in stats and ("Arena 1:" in stats) is not one


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("command", ["serve", "train"])
def test_selfspec_serve_keeps_one_heap_through_the_clis_imports(command):
    """The CLI's imports start a library's thread (pyarrow's, under `datasets`) that makes a second glibc
    heap; `selfspec serve` asks for one heap before them, so none is made. The control: another command."""
    code = ("import ctypes, sys\n"
            f"sys.argv = ['selfspec', '{command}']\n"
            "import selfspec.cli\n"
            "ctypes.CDLL('libc.so.6').malloc_stats()\n")
    stats = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "Arena 0:" in stats and ("Arena 1:" in stats) is (command != "serve")
