"""A pass captured once and replayed: `CapturedPass`, CUDA graphs for `StaticPasses(mode="graph")`.

On a GPU a decoding pass of a small model is hundreds of kernel launches of a few µs of host time each,
so a round costs its launches, not its arithmetic. A CUDA graph records the launches of one call and
replays them with one launch, on the same addresses: every tensor the pass reads must sit where it sat
at capture, and every tensor it returns is rewritten by the next replay. So a `CapturedPass`

- keeps static input buffers: each call copies its arguments into them (the arguments named `static`,
  the KV cache's buffers, are the caller's own, written in place, and must keep their addresses: a new
  address is a new capture);
- copies the outputs out after each replay: the caller may keep them across replays (the draft loop of
  the eager static path keeps every step's);
- captures one graph per argument signature (shapes, dtypes, the static buffers' addresses), all graphs
  of one pass drawing on one memory pool, and keeps the `KEPT` most recently used: the engine's
  `CachePool` keeps addresses per batch size and capacity, but a pool set that grows leaves the old
  set's graphs unused, and an unbounded set would hold their buffers forever.

Off CUDA the same object emulates the graph, so the semantics are tested without a GPU: the capture
runs the pass once with host reads refused (a capture cannot read the device), and a replay runs it
again on the static inputs and writes its outputs into the same output buffers, which the caller then
sees overwritten by the next replay unless it copied them (as `__call__` does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

KEPT = 16  # graphs kept per pass, least recently used dropped first (those in use stay)
_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
               torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}


class HostReadInCapture(RuntimeError):
    """A captured pass read a device value on the host (its replay could not)."""


# what else a capture cannot hold: results whose size depends on the data (a host sync), tensors made
# from host values (a host-to-device copy at capture time, not at replay)
_DATA_SIZED = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
               torch.unique, torch.Tensor.unique, torch.tensor, torch.as_tensor}


class _NoHostReads(TorchFunctionMode):
    """Refuses what a CUDA graph capture cannot do: a host read of a tensor's value, a result sized by the
    data, a tensor made from host values, a copy to the CPU, a boolean mask as an index."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_cpu = func is torch.Tensor.to and any(
            (isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu")
            for a in (*args[1:], kwargs.get("device")) if a is not None)
        mask_index = func is torch.Tensor.__getitem__ and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if func in _HOST_READS or func in _DATA_SIZED or to_cpu or mask_index:
            raise HostReadInCapture(f"{getattr(func, '__name__', func)} inside a captured pass: a graph "
                                    f"replays device work of fixed shapes only; do it before or after")
        return func(*args, **kwargs)


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
            with _NoHostReads():
                self.outputs = fn(*self.inputs)

    def replay(self, args: tuple):
        for i, a in enumerate(args):
            if i not in self.static and isinstance(a, torch.Tensor):
                self.inputs[i].copy_(a)
        if self.real:
            self.graph.replay()
        else:  # the emulation: the same work on the same buffers, the outputs rewritten in place
            with _NoHostReads():
                fresh = self.fn(*self.inputs)
            for old, new in zip(tree_flatten(self.outputs)[0], tree_flatten(fresh)[0]):
                old.copy_(new)
        return self.outputs
