"""A CUDA device emulated on the CPU, for the code paths only CUDA takes, on machines without a GPU.

Inside `VirtualCuda()`, a tensor moved to "cuda" (`.cuda()`, `.to("cuda")`, a factory's
`device="cuda"`, `module(model)` for a model's weights) still computes on the CPU but reports
`device cuda:0`, and so does whatever is computed from it. As on CUDA:
- an operation given tensors of both devices raises (CPU scalars, 0-dim, may join CUDA tensors;
  indexing, `copy_` and `index_put_` cross devices);
- `.numpy()` of a CUDA tensor raises, `.cpu()` copies, and host reads (`.cpu()`, `.item()`,
  `.tolist()`, `int()`, `bool()`, `torch.equal`, `allclose`, a `copy_` into host memory, `synchronize()`)
  complete the work queued so far, counted (`host_reads`), and so does an operation whose result's size
  comes from device data, which the host reads first (`nonzero`, `unique`, `masked_select`, `bincount`,
  `torch.where(condition)`, `repeat_interleave` without `output_size`, a boolean mask as an index:
  `graphs.sized_by_data`);
- a copy from the host to the device (`.to("cuda")`, `.cuda()`, `torch.tensor(..., device="cuda")`, a
  `copy_` from host memory, host tensors as indices or values of a CUDA tensor) waits for the work
  queued so far, as CUDA's copy from pageable memory does and torch's blocking copy does, counted
  (`host_uploads`; a 0-dim host tensor copied into device memory too), except a `non_blocking=True`
  copy from pinned memory (`pin_memory()`, a factory's `pin_memory=True`), which is queued like a kernel:
  `syncs` is both counts;
- each operation with a CUDA result counts as one kernel launch (`kernel_launches`): a write, a result in
  new memory (one of a tuple's: `sort`, `max(dim)`; advanced indexing), an `out=`, a dtype conversion;
  a view (a slice, `view`, `detach`) launches nothing. A captured pass's replay
  (`selfspec.backends.graphs`) is one graph launch (`graph_launches`), its own operations not counted,
  after one copy launch for each argument copied into the graph's input buffers: what a GPU's host pays a
  launch each; captures are counted apart (`graph_captures`);
- `torch.cuda.Event` times with `perf_counter`, and `elapsed_time` raises unless a host read or
  `synchronize` came after both events were recorded (CUDA's "device not ready");
- selfspec's compiled CPU kernels raise when given a CUDA tensor.
What it cannot show: CUDA's own kernels and numerics. Tags live on storages (a view shares its
base's device), held by weak references: memory freed is untagged, so a CPU tensor that reuses its
address is a CPU tensor, and a long emulation holds no more memory than the same run on the CPU.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from selfspec.backends.graphs import HOST_READS, sized_by_data

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
              torch.randn, torch.rand, torch.randint, torch.eye, torch.linspace, torch.empty_strided,
              torch.scalar_tensor, torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
              torch.rand_like, torch.randn_like}
_ALLOCATIONS = {torch.empty, torch.empty_like, torch.empty_strided}  # memory only: no kernel
_CROSS = {torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
          torch.Tensor.index_put}


class _Queue:
    """Events recorded so far, how many of them a sync has completed, and the syncs (each a wait for
    the device: what a round's budget counts): host reads and uploads from pageable memory."""
    recorded = 0
    completed = 0
    reads = 0
    uploads = 0
    kernels = 0
    graphs = 0
    captures = 0
    in_replay = 0


class Event:
    """`torch.cuda.Event` on the virtual device (see the module docstring)."""

    def __init__(self, enable_timing: bool = False, **_):
        self.time, self.seq = None, None

    def record(self, stream=None) -> None:
        _Queue.recorded += 1
        self.time, self.seq = time.perf_counter(), _Queue.recorded

    def synchronize(self) -> None:
        """The host waits for the work before the event: a sync, unless a sync since has completed it."""
        if self.seq is not None and self.seq > _Queue.completed:
            _Queue.reads += 1
            _Queue.completed = self.seq

    def query(self) -> bool:
        return self.seq is not None and self.seq <= _Queue.completed

    def elapsed_time(self, end: Event) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready (an event read before the work it marks ended)")
        return (end.time - self.time) * 1e3


def _host_read() -> None:
    _Queue.completed = _Queue.recorded
    _Queue.reads += 1


def _upload() -> None:
    _Queue.completed = _Queue.recorded
    _Queue.uploads += 1


class VirtualCuda(TorchFunctionMode):
    """The virtual device (module docstring). Use as a context manager; `module(model)` moves a model."""

    def __init__(self):
        super().__init__()
        self._storages = {}  # data_ptr -> StorageWeakRef of the storage there
        self._empty = {}  # id -> weakref: tagged tensors without memory (data_ptr 0)
        self._pinned = {}  # data_ptr -> StorageWeakRef: host memory from `pin_memory`
        self._patches = contextlib.ExitStack()

    def __enter__(self):
        from selfspec.backends import graphs
        from selfspec.model import kernels

        patch = self._patches.enter_context
        patch(_replaced(torch.cuda, "Event", Event))
        patch(_replaced(torch.cuda, "synchronize", lambda *a, **k: _host_read()))
        # foreach kernels (AdamW, clipping) group tensors by device: a CUDA tensor's group is CUDA's
        patch(_replaced(torch._C, "_group_tensors_by_device_and_dtype",
                        self._grouped(torch._C._group_tensors_by_device_and_dtype)))
        patch(_replaced(graphs._Graph, "replay", _one_launch(graphs._Graph.replay)))
        patch(_replaced(graphs._Graph, "__init__", _counted_capture(graphs._Graph.__init__)))
        # the kernels checked for this thread or task (and threads started with a copy of its context)
        patch(kernels.wrapped(lambda module: _CheckedKernels(module, self)))
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._patches.close()
        return out

    @property
    def host_reads(self) -> int:
        """Host reads of device values so far (`.cpu()`, `.item()`, `synchronize()`, ...)."""
        return _Queue.reads

    @property
    def host_uploads(self) -> int:
        """Copies to the device so far that waited for it: from pageable memory, or blocking."""
        return _Queue.uploads

    @property
    def kernel_launches(self) -> int:
        """Operations with a CUDA result so far, outside graph replays: a kernel launch each."""
        return _Queue.kernels

    @property
    def graph_launches(self) -> int:
        """Replays of captured passes so far: a graph launch each."""
        return _Queue.graphs

    @property
    def graph_captures(self) -> int:
        """Captures of passes so far (each a warm-up run, counted in `kernel_launches`, and a graph)."""
        return _Queue.captures

    @property
    def syncs(self) -> int:
        """Every wait for the device so far: host reads and waiting uploads."""
        return _Queue.reads + _Queue.uploads

    def _grouped(self, group):
        def by_device(tensorlistlist, with_indices=False):
            out = {}
            for (device, dtype), value in group(tensorlistlist, with_indices).items():
                first = next(t for t in value[0][0] if t is not None)
                out[CUDA if self.on_cuda(first) else device, dtype] = value
            return out
        return by_device

    def pinned(self, t) -> bool:
        return isinstance(t, torch.Tensor) and _alive(self._pinned, t.untyped_storage().data_ptr())

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self._pinned[storage.data_ptr()] = StorageWeakRef(storage)
        return t

    def _upload_from(self, src, non_blocking) -> None:
        """A copy of `src` (host memory) to the device: a sync unless it is queued (pinned, non_blocking)."""
        if not (non_blocking and self.pinned(src)):
            _upload()

    def on_cuda(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ptr = t.untyped_storage().data_ptr()
        if ptr:
            return _alive(self._storages, ptr)
        ref = self._empty.get(id(t))
        return ref is not None and ref() is t

    def _tag(self, out):
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr():
                self._storages[storage.data_ptr()] = StorageWeakRef(storage)
            else:
                self._empty[id(t)] = weakref.ref(t)
        return out

    def module(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module.cuda()`: each parameter and buffer copied and tagged (a Parameter keeps its identity)."""
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                t.data = t.data.clone()
                self._tag(t)
        return module

    def _to(self, func, args, kwargs):
        src, target, rest = args[0], kwargs.pop("device", None), []
        non_blocking = kwargs.get("non_blocking", False) or any(a is True for a in args[1:3])
        for a in args[1:]:
            if isinstance(a, (str, torch.device)) and target is None:
                target = a
            elif isinstance(a, torch.Tensor):  # .to(other): its device and dtype
                target, rest = (CUDA if self.on_cuda(a) else CPU), [*rest, a.dtype]
            else:
                rest.append(a)
        out = func(src, *rest, **kwargs)
        to_cuda = self.on_cuda(src) if target is None else torch.device(target).type == "cuda"
        if to_cuda == self.on_cuda(src):
            if to_cuda and out is not src and not _Queue.in_replay:
                _Queue.kernels += 1  # a conversion (dtype, layout) on the device
            return self._tag(out) if to_cuda else out
        if to_cuda:
            self._upload_from(src, non_blocking)
        else:
            _host_read()
        out = out.clone() if out is src else out
        return self._tag(out) if to_cuda else out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.device.__get__:
            return CUDA if self.on_cuda(args[0]) else CPU
        if func == torch.Tensor.is_cuda.__get__:
            return self.on_cuda(args[0])
        if func is torch.Tensor.cuda:
            if self.on_cuda(args[0]):
                return args[0]
            self._upload_from(args[0], kwargs.get("non_blocking", False))
            return self._tag(args[0].clone())
        if func is torch.Tensor.pin_memory:
            if self.on_cuda(args[0]):
                raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
            return self._pin(args[0].clone())
        if func is torch.Tensor.is_pinned:
            return self.pinned(args[0])
        if func is torch.Tensor.cpu:
            if not self.on_cuda(args[0]):
                return args[0]
            _host_read()
            return args[0].clone()
        if func is torch.Tensor.to:
            return self._to(func, args, kwargs)
        if func is torch.Tensor.numpy and self.on_cuda(args[0]):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        if func in _FACTORIES:
            device, pin = kwargs.get("device"), kwargs.pop("pin_memory", False)
            if device is not None and torch.device(device).type == "cuda":
                if func in (torch.tensor, torch.as_tensor) and not self.on_cuda(args[0]):
                    _upload()  # host values copied up: through pageable memory
                elif func not in _ALLOCATIONS and not _Queue.in_replay:
                    _Queue.kernels += 1  # a fill, a range, random numbers: a kernel
                return self._tag(func(*args, **{**kwargs, "device": "cpu"}))
            out = func(*args, **kwargs)
            if pin:
                return self._pin(out)
            like = func.__name__.endswith("_like") and device is None and self.on_cuda(args[0])
            return self._tag(out) if like else out
        tensors = _tensors((args, kwargs))
        on = {self.on_cuda(t) for t in tensors if t.dim() > 0 or self.on_cuda(t)}
        if len(on) > 1 and func not in _CROSS:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                               f"devices, cuda:0 and cpu! ({getattr(func, '__name__', func)})")
        # (`.cpu()` and `.numpy()`, reads too, are answered above)
        if True in on and (func in HOST_READS or sized_by_data(func, args, kwargs)):
            _host_read()
        if func in _CROSS and (len(on) > 1 or self._scalar_up(func, args)):
            self._copy_across(func, args, kwargs)
        out = func(*args, **kwargs)
        # a copy into, an index of or an assignment into a tensor stays on that tensor's device
        device_of_out = self.on_cuda(args[0]) if func in _CROSS else True in on
        if device_of_out and not _Queue.in_replay and _launches_kernel(func, tensors, kwargs, out):
            _Queue.kernels += 1
        return self._tag(out) if device_of_out and out is not None else out

    def _scalar_up(self, func, args) -> bool:
        """A 0-dim host tensor copied into device memory (`x.copy_(t)`, `x[i] = t`): a copy up, which the
        same-device check above lets pass as a scalar operand."""
        value = {torch.Tensor.copy_: 1, torch.Tensor.__setitem__: 2}.get(func)
        value = args[value] if value is not None else None
        return (isinstance(value, torch.Tensor) and value.dim() == 0 and not self.on_cuda(value)
                and self.on_cuda(args[0]))


    def _copy_across(self, func, args, kwargs) -> None:
        """A copy between the devices inside `copy_` or an index: a host read into host memory, else an
        upload of the host tensors (indices, values), which torch copies blocking."""
        if not self.on_cuda(args[0]):
            if not (kwargs.get("non_blocking", False) and self.pinned(args[0])):
                _host_read()
            return
        source = args[1] if func is torch.Tensor.copy_ else None
        if source is not None:
            self._upload_from(source, kwargs.get("non_blocking", False) or (len(args) > 2 and args[2]))
        else:
            _upload()


COUNTS = ("host_reads", "host_uploads", "kernel_launches", "graph_launches")


def counts_per_round(device: VirtualCuda, generator, prompts: list, drafter: str, k: int,
                     **sampling) -> tuple[dict, int]:
    """Each of `COUNTS` per decoding round of `generator` on `prompts`, counted on `device` as what a
    longer decode adds per round it adds (three decodes of growing length: the first captures and warms
    up, so the call's own start, prefill and captures, is left out), and the rounds of the longest."""
    counts, rounds = [], []
    for new in (4, 8, 24):
        before = [getattr(device, c) for c in COUNTS]
        out = generator.generate(prompts, max_new_tokens=new, drafter=drafter, num_speculations=k,
                                 eos_token_id=[], **sampling)
        counts.append([getattr(device, c) - b for c, b in zip(COUNTS, before)])
        rounds.append(out.stats.rounds)
    added = rounds[2] - rounds[1]
    assert added > 0, rounds
    per_round = {c: (later - earlier) / added for c, earlier, later in zip(COUNTS, counts[1], counts[2])}
    return per_round, rounds[2]


class _CheckedKernels:
    """selfspec's compiled kernel module, each function refusing CUDA tensors as a CPU kernel must."""

    def __init__(self, module, device: VirtualCuda):
        self._module, self._device = module, device

    def __getattr__(self, name):
        value = getattr(self._module, name)
        # the calls' typed state (`Passes`, `Head`, `Rounds`) holds tensors too: its constructors are checked
        if (isinstance(value, type) and name not in ("Passes", "Head", "Rounds")) or not callable(value):
            return value

        def checked(*args, **kwargs):
            if any(self._device.on_cuda(t) for t in _tensors((args, kwargs))):
                raise RuntimeError(f"the CPU kernel {name} was given a CUDA tensor")
            return value(*args, **kwargs)
        return checked


def _tensors(tree) -> list:
    """The tensors in `tree` (tensors, lists, tuples, dicts of them), in no set order: what torch's pytree
    flattening finds in an operation's arguments and results, at a fraction of its cost (the
    emulator's hottest path: every operation's inputs and outputs)."""
    out, stack = [], [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return out


def _alive(tags: dict, ptr: int) -> bool:
    """Whether `tags` holds the memory at `ptr`: tagged, and not freed since (its tag then dropped)."""
    ref = tags.get(ptr)
    if ref is None:
        return False
    if ref.expired():
        del tags[ptr]
        return False
    return True


def _launches_kernel(func, inputs: list, kwargs: dict, out) -> bool:
    """Whether an operation launches a kernel on CUDA: a write into a tensor does (in place, `out=`), a
    result in new memory does (of a tuple's results any: `sort`, `max(dim)`, `topk`), a view of one (a
    result on an input's memory: `view`, `detach`, a slice, `contiguous` of a contiguous one) does not."""
    name = getattr(func, "__name__", "")
    if func is torch.Tensor.__setitem__ or (name.endswith("_") and not name.startswith("__")) \
            or name.startswith("__i") or kwargs.get("out") is not None:
        return True
    held = {t.untyped_storage().data_ptr() for t in inputs}
    return any(t.untyped_storage().data_ptr() not in held for t in _tensors(out))


def _counted_capture(capture):
    def counted(graph, *args, **kwargs):
        _Queue.captures += 1
        capture(graph, *args, **kwargs)
    return counted


def _one_launch(replay):
    """A captured pass's replay as one graph launch after a copy launch for each argument copied into the
    graph's input buffers (`_Graph.replay`): the operations the graph reruns are not launches."""
    def counted(graph, args):
        _Queue.kernels += sum(1 for i, a in enumerate(args)
                              if i not in graph.static and isinstance(a, torch.Tensor))
        _Queue.graphs += 1
        _Queue.in_replay += 1
        try:
            return replay(graph, args)
        finally:
            _Queue.in_replay -= 1
    return counted


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)
