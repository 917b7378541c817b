"""What eager torch calls cost beyond their arithmetic: host synchronisations and bytes moved
(docs/performance.md). Both are counted by intercepting torch calls with a
:class:`torch.overrides.TorchFunctionMode`, so they run on the CPU with no GPU present.

**Host syncs.** On a GPU the host queues kernels and runs ahead of them; a call whose result the
host must read (a Python number, a shape that depends on the data, a host copy) makes it wait for
every queued kernel, and the queue runs dry. :class:`HostSyncCounter` counts, per call site, the
calls that do that on CUDA: reads (``.item()``, ``.tolist()``, ``bool/int/float()`` of a tensor,
``torch.equal``), data-dependent shapes (``nonzero``, ``argwhere``, one-argument ``where``,
boolean-mask indexing and assignment, ``masked_select``, ``unique``, ``unique_consecutive``,
``bincount``, ``repeat_interleave`` without ``output_size``, ``segment_reduce`` without
``unsafe=True``, which checks its lengths on the host), and host copies (``.cpu()`` and
``.numpy()`` always, ``.to("cpu")`` of a tensor on another device; ``.to(device)`` toward the
run's device, the collective's device under NCCL, is no host copy). On the CPU these calls cost
nothing extra, which is why they are counted rather than timed; where CUDA is present
:func:`cuda_sync_warnings` also counts what ``torch.cuda.set_sync_debug_mode`` reports. Not
visible on the CPU: host-to-device copies of Python data (``torch.tensor(list,
device="cuda")``), which only the CUDA count sees. Host arithmetic on Python numbers made with
torch scalars reads like a sync: the code under measurement keeps such arithmetic in Python.

**Bytes moved.** :class:`TrafficCounter` adds up, per torch call, the bytes of the tensors it
reads and writes (for indexing calls only the indices and the elements gathered or written, not
the whole source): a model of the memory traffic of an eager sequence of kernels, the quantity
that bounds a selection on a GPU. Work inside one kernel (a radix select's passes in
``torch.topk``) is not seen: it is a lower bound for such calls.

Example::

    >>> counter = HostSyncCounter()
    >>> x = torch.randn(100)
    >>> with counter:
    ...     idx = torch.nonzero(x > 0)        # 1: a data-dependent shape
    ...     y = x[x > 0]                      # 1: boolean-mask indexing
    ...     z = (x * 2).sum()                 # 0
    >>> counter.total
    2
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# name of the torch call -> the kind of host sync it makes on CUDA (always)
ALWAYS = {
    "item": "read", "tolist": "read", "__bool__": "read", "__int__": "read", "__float__": "read",
    "__index__": "read", "__complex__": "read", "equal": "read", "allclose": "read", "is_nonzero": "read",
    "nonzero": "shape", "argwhere": "shape", "masked_select": "shape", "unique": "shape",
    "unique_consecutive": "shape", "bincount": "shape",
    "cpu": "copy", "numpy": "copy",
}
INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_", "_index_put_impl_"}
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _name(func) -> str:
    return getattr(func, "__name__", "") or str(func)


def _has_bool_index(index) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(_has_bool_index(i) for i in index)
    return False


def sync_kind(func, args: tuple, kwargs: dict) -> str | None:
    """The kind of host sync a call of ``func`` with these arguments makes on CUDA, or None."""
    name = _name(func)
    if name in ALWAYS:
        return ALWAYS[name]
    if name in INDEXING:
        index = args[1] if len(args) > 1 else kwargs.get("indices")
        return "shape" if _has_bool_index(index) else None
    if name == "where":
        return "shape" if len(args) + len(kwargs) == 1 else None
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if len(args) == 1 and isinstance(args[0], torch.Tensor) and "repeats" not in kwargs:
            repeats = args[0]  # torch.repeat_interleave(repeats)
        return "shape" if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None else None
    if name == "segment_reduce":
        return None if kwargs.get("unsafe") else "check"
    if name == "to":  # a copy to the host from another device (on the CPU: never)
        target = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        source = args[0].device.type if isinstance(args[0], torch.Tensor) else "cpu"
        return "copy" if source != "cpu" and any(torch.device(t).type == "cpu" for t in target) else None
    return None


def _call_site() -> str:
    """``file:line`` of the innermost caller outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_TORCH) or path.startswith(_HERE + os.sep + "opcount")):
            parts = path.split(os.sep)
            short = os.sep.join(parts[parts.index("commlab"):]) if "commlab" in parts else parts[-1]
            return f"{short}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostSyncCounter(TorchFunctionMode):
    """Counts the calls that make the host wait for a CUDA device (see the module notes) while
    entered. ``total``, ``by_kind`` (read / shape / check / copy) and ``sites`` (``file:line
    name`` -> count) accumulate until :meth:`reset`; ``paused()`` stops counting in a block."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_kind: Counter = Counter()
        self.sites: Counter = Counter()
        self._paused = 0

    def reset(self) -> None:
        self.total = 0
        self.by_kind.clear()
        self.sites.clear()

    @contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            kind = sync_kind(func, args, kwargs)
            if kind is not None:
                self.total += 1
                self.by_kind[kind] += 1
                self.sites[f"{_call_site()} {_name(func)}"] += 1
        return func(*args, **kwargs)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


# indexing calls: only the indices and the elements gathered or written move, not the source
_GATHERS = {"__getitem__", "index_select", "take", "gather", "take_along_dim"}
_SCATTERS = {"__setitem__", "index_put", "index_put_", "index_copy", "index_copy_", "index_add", "index_add_",
             "index_fill", "index_fill_", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
             "scatter_reduce_"}


class TrafficCounter(TorchFunctionMode):
    """Adds up the bytes each torch call reads and writes while entered (``bytes``, per call name
    in ``by_call``): a model of the memory traffic of eager kernels (see the module notes)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.by_call: Counter = Counter()

    def reset(self) -> None:
        self.bytes = 0
        self.by_call.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        if name in _GATHERS:
            moved = 2 * _nbytes(out) + _nbytes(args[1:]) + _nbytes(list(kwargs.values()))
        elif name in _SCATTERS:
            rest = [a for a in args[1:] if isinstance(a, (torch.Tensor, tuple, list))]
            moved = 2 * _nbytes(rest) + _nbytes(list(kwargs.values()))
        elif name in ("size", "dim", "numel", "element_size", "__len__", "view", "reshape", "__get__",
                      "data_ptr", "is_contiguous", "stride", "storage_offset", "unbind", "split", "chunk",
                      "empty", "empty_like", "empty_strided"):
            moved = 0  # metadata, views, zero-copy splits and allocations
        elif "out" in kwargs:  # reads its inputs, writes the given output
            rest = {k: v for k, v in kwargs.items() if k != "out"}
            moved = _nbytes(args) + _nbytes(list(rest.values())) + _nbytes(kwargs["out"])
        else:
            same = id(out) in {id(a) for a in args}  # in-place calls return their input
            moved = _nbytes(args) + _nbytes(list(kwargs.values())) + (0 if same else _nbytes(out))
        self.bytes += moved
        self.by_call[name] += moved
        return out


@contextmanager
def cuda_sync_warnings():
    """Count what ``torch.cuda.set_sync_debug_mode("warn")`` reports inside the block: yields a
    list that holds one message per synchronising CUDA call once the block ends (empty without
    CUDA)."""
    found: list[str] = []
    if not torch.cuda.is_available():
        yield found
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            found.extend(str(w.message).splitlines()[0] for w in caught
                         if "synchroniz" in str(w.message).lower())
