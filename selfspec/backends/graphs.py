"""A pass captured once and replayed: `CapturedPass`, CUDA graphs for `StaticPasses(mode="graph")`.

On a GPU a decoding pass of a small model is hundreds of kernel launches of a few µs of host time each,
so a round costs its launches, not its arithmetic. A CUDA graph records the launches of one call and
replays them with one launch, on the same addresses: every tensor the pass reads must sit where it sat
at capture, and every tensor it returns is rewritten by the next replay. So a `CapturedPass`

- keeps static input buffers: each call copies its arguments into them (the arguments named `static`,
  the KV cache's buffers, are the caller's own, written in place, and must keep their addresses: a new
  address is a new capture);
- copies the outputs out after each replay: the caller may keep them across replays (a round keeps its
  drafts' exit states until its verification runs, which another captured pass writes);
- captures one graph per argument signature (shapes, dtypes, the static buffers' addresses), all graphs
  of one pass drawing on one memory pool, and keeps the `KEPT` most recently used: the engine's
  `CachePool` keeps addresses per batch size and capacity, but a pool set that grows leaves the old
  set's graphs unused, and an unbounded set would hold their buffers forever.

Off CUDA the same object emulates the graph, so the semantics are tested without a GPU: the capture
runs the pass once refusing what a capture cannot hold (`_NoHostReads`: a host read, an operation whose
output's shape or values come from the host or from data the host must read first), and a replay runs it
again on the static inputs and writes its outputs into the same output buffers, which the caller then
sees overwritten by the next replay unless it copied them (as `__call__` does). A real replay reruns
the captured kernels on the captured addresses, not the Python: so the emulated replay records what
each operation read (the addresses of the tensors made before the pass, its host values) and refuses
a replay that reads anything else (`ReplayMismatch`: an input rebound, a weight moved, a host value
changed after capture), which a GPU would have replayed silently with the old one.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

KEPT = 16  # graphs kept per pass, least recently used dropped first (those in use stay)
# a device value read on the host: a wait for the device (and a result a replay cannot give again)
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
              torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose}


class HostReadInCapture(RuntimeError):
    """A captured pass read a device value on the host, or sized or filled a result from the host (its
    replay could not)."""


class ReplayMismatch(RuntimeError):
    """An emulated replay read another tensor or host value than its capture: a real replay would read
    the captured one."""


# results whose size depends on the data: the host reads the size first, a wait for the device
_DATA_SIZED = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
               torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
               torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.bincount,
               torch.Tensor.bincount}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
             torch.Tensor.index_put, torch.index_put}


def sized_by_data(func, args: tuple, kwargs: dict) -> str | None:
    """Why `func(*args, **kwargs)` sizes its result from device data, which the host must read first
    (on CUDA a wait for the device, in a capture impossible), or None: `nonzero`, `unique`,
    `torch.where(condition)`, `repeat_interleave` with tensor repeats and no `output_size`, a boolean
    mask as an index (`x[mask]`; `x[mask] = v` of a tensor v)."""
    if func in _DATA_SIZED:
        return getattr(func, "__name__", str(func))
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "torch.where(condition)"
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs and (
            len(args) == 1 or isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)):
        return "repeat_interleave with tensor repeats (no output_size)"
    if func in _INDEXING and _has_mask(args, kwargs):
        value = args[2] if len(args) > 2 else kwargs.get("values")
        if func is torch.Tensor.__setitem__ and not isinstance(value, torch.Tensor):
            return None  # a number written under a mask is `masked_fill_`: no size needed
        return "a boolean mask as an index"
    return None


def _index(args: tuple, kwargs: dict) -> tuple:
    """An indexing call's index, as a tuple of its parts."""
    index = args[1] if len(args) > 1 else kwargs.get("indices")
    return index if isinstance(index, tuple) else (index,)


def _has_mask(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _index(args, kwargs))


def _refused(func, args: tuple, kwargs: dict) -> str | None:
    """Why a capture cannot hold `func(*args, **kwargs)`, or None."""
    name = getattr(func, "__name__", str(func))
    if func in HOST_READS or func in (torch.tensor, torch.as_tensor):
        return name  # a host read, or host values copied up at capture only
    if func is torch.Tensor.to and any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"
                                       for a in (*args[1:], kwargs.get("device")) if a is not None):
        return "a copy to the CPU"
    if func in _INDEXING and _has_mask(args, kwargs):
        return "a boolean mask as an index"  # `x[mask] = 1.0` too: keep captured passes to fixed indices
    if func in _INDEXING and any(isinstance(i, list) for i in _index(args, kwargs)):
        return "a list as an index (a host tensor made and copied up at capture)"
    return sized_by_data(func, args, kwargs)


def _from_numpy_refused(*_args, **_kwargs):
    raise HostReadInCapture("from_numpy inside a captured pass: host memory, read at capture only")


class _NoHostReads(TorchFunctionMode):
    """Refuses what a CUDA graph capture cannot do (`_refused`), and records each operation's `trace`:
    the tensors it read that were made before the pass (by address) and its host values, what a
    replay must read again."""

    def __init__(self):
        super().__init__()
        self.trace: list[tuple] = []
        self._made: set[int] = set()  # storages of tensors made inside the pass
        self._outside: set[int] = set()  # storages of tensors made before it (inputs, weights, buffers)

    def __enter__(self):
        self._numpy = contextlib.ExitStack()  # `from_numpy` takes no tensor: no mode sees it
        self._numpy.enter_context(_replaced(torch, "from_numpy", _from_numpy_refused))
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._numpy.close()
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _refused(func, args, kwargs)
        if reason is not None:
            raise HostReadInCapture(f"{reason} inside a captured pass: a graph replays device work of fixed "
                                    f"shapes only; do it before or after")
        name = getattr(func, "__name__", str(func))
        if name != "__get__":  # attribute reads (shape, device) are not work
            self.trace.append((name, *map(self._read, tree_flatten((args, kwargs))[0])))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage(t) not in self._outside:
                self._made.add(_storage(t))
        return out

    def _read(self, leaf):
        """What a replay must read again: a tensor made before the pass at its address, one made inside
        it by shape, a host value as it is."""
        if not isinstance(leaf, torch.Tensor):
            return leaf
        storage = _storage(leaf)
        if storage in self._made:
            return ("made", tuple(leaf.shape), leaf.dtype)
        self._outside.add(storage)
        return ("at", leaf.data_ptr(), tuple(leaf.shape), leaf.dtype)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


class CapturedPass:
    """`fn` captured per argument signature and replayed (module docstring).

    fn: a pass of fixed shapes with no host reads, returning a tensor or a tuple of tensors; static: the
    positions of arguments that are written in place and keep their addresses (a tensor or a list of
    tensors each; the cache's buffers); device: where the pass runs (CUDA graphs there, emulated
    elsewhere). `replays` and `captures` count the calls, for the launch budget (one graph per call).
    """

    def __init__(self, fn: Callable, static: tuple[int, ...], device: torch.device):
        self.fn, self.static, self.device = fn, set(static), torch.device(device)
        self.real = self.device.type == "cuda" and torch.cuda.is_available()
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.real else None
        self.captures = self.replays = 0

    def __call__(self, *args):
        key = tuple(_signature(a, i in self.static) for i, a in enumerate(args))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Graph(self.fn, args, self.static, self._pool, self.real)
            self.captures += 1
            while len(self._graphs) > KEPT:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        self.replays += 1
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, graph.replay(args))


def _signature(arg, static: bool):
    """What a graph is specific to: a dynamic tensor's shape and dtype, a static one's address too."""
    if arg is None or not isinstance(arg, (torch.Tensor, list, tuple)):
        return arg
    tensors = tree_flatten(arg)[0]
    return tuple((t.shape, t.dtype, t.data_ptr() if static else None) for t in tensors)


class _Graph:
    """One capture of fn: its static inputs, its outputs (rewritten by each replay) and the graph."""

    def __init__(self, fn: Callable, args: tuple, static: set[int], pool, real: bool):
        self.fn, self.static, self.real = fn, static, real
        # dynamic tensor arguments get buffers of their own; static ones and non-tensors are kept as given
        self.inputs = [a.clone() if i not in static and isinstance(a, torch.Tensor) else a
                       for i, a in enumerate(args)]
        if real:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # one run first: cuBLAS handles and workspaces outside the capture
                fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn(*self.inputs)
        else:
            with _NoHostReads() as capture:
                self.outputs = fn(*self.inputs)
            self.trace = capture.trace

    def replay(self, args: tuple):
        for i, a in enumerate(args):
            if i not in self.static and isinstance(a, torch.Tensor):
                self.inputs[i].copy_(a)
        if self.real:
            self.graph.replay()
        else:  # the emulation: the same work on the same buffers, the outputs rewritten in place
            with _NoHostReads() as replay:
                fresh = self.fn(*self.inputs)
            _same_reads(self.trace, replay.trace)
            for old, new in zip(tree_flatten(self.outputs)[0], tree_flatten(fresh)[0]):
                old.copy_(new)
        return self.outputs


def _same_reads(captured: list[tuple], replayed: list[tuple]) -> None:
    """Refuse a replay that ran other operations or read other tensors or host values than its capture
    (`ReplayMismatch`)."""
    ops = lambda trace: [step[0] for step in trace]
    if ops(captured) != ops(replayed):
        raise ReplayMismatch(f"a captured pass ran {len(replayed)} operations at replay, {len(captured)} at "
                             f"capture, not the same: its Python took another path (a CUDA graph replays "
                             f"the captured one)")
    for step, (then, now) in enumerate(zip(captured, replayed)):
        if then != now:
            raise ReplayMismatch(f"operation {step} ({then[0]}) of a captured pass read {now[1:]} at replay, "
                                 f"{then[1:]} at capture: a tensor rebound or moved, or a host value "
                                 f"changed, after capture (a CUDA graph replays what it captured)")
