"""The passes every threshold selector is built from (docs/performance.md, "Selection passes").

A threshold selection reads the tensor, keeps the entries with |x| >= t and returns their
positions. Written naively it makes several passes: ``|x|`` into a buffer (read 4n, write 4n
bytes), the comparison (read 4n, write n), a count (read n), the compaction (read n): about 15
bytes moved per element against 4 for one read. The selectors here use three building blocks
instead:

* :func:`at_least` / :func:`above`: the mask of |x| >= t (or > t) with no |x| buffer: the
  comparison of x against t and -t in one kernel (``hardshrink`` at the largest value below t,
  which keeps exactly the entries outside [-t, t)), cast to a mask: read 4n, write 4n, read 4n,
  write n;
* :func:`compact`: the positions of a mask, which also counts it (its length): the one host sync
  of a selection. On the CPU numpy's compaction of a boolean array is several times faster than
  ``torch.nonzero`` and shares the memory; on a GPU ``torch.nonzero``;
* :func:`counts_at_least` / :func:`counts_above`: how many entries pass each of many thresholds,
  in one pass (``torch.bucketize`` against the thresholds and their negatives, then a histogram),
  so that a search over thresholds (a guard, a correction loop, RedSync's ratios) reads the
  tensor once per round instead of once per candidate, and the host reads one small vector.
* on the CPU, for float32: :mod:`commlab.compress.native`'s kernel, which selects (positions and
  values, :func:`select_pairs_at_least`; with a guard's raises counted and applied,
  :func:`select_pairs_guarded`) in one read and one call, and counts up to 16 thresholds in one
  read, when it could be built; numpy's passes otherwise;
* on a GPU, for float32: :mod:`commlab.compress.triton_select`'s kernels, which select in about
  one read and count up to 16 thresholds in one, when Triton can be imported (it comes with
  PyTorch's CUDA builds); ``COMMLAB_TRITON=0`` keeps torch's passes (same result).

A selection is then: a mask, a compaction and, only when its count misses, one multi-threshold
count and a second compaction. Thresholds are Python floats compared in the tensor's dtype (the
comparison rounds t to it, as ``x >= t`` does); NaN entries pass every threshold, so that a NaN
reaches the update instead of hiding in a residual. Example::

    >>> x = torch.tensor([0.5, -2.0, 1.0, 0.0, -1.0])
    >>> compact(at_least(x, 1.0))
    tensor([1, 2, 4])
    >>> counts_at_least(x, [0.5, 1.0, 3.0])
    [4, 3, 0]
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch

from commlab.compress import gpu_kernels
from commlab.compress.floatbits import compared, neighbour, next_up, pattern, to_bits
from commlab.compress.native import MAX_THRESHOLDS, Buffers, Kernel, kernel


class Scratch:
    """Buffers a selector reuses from call to call for its masks (a fresh multi-megabyte tensor
    per call costs page faults on the CPU and allocator traffic on a GPU). A mask made in them
    is valid until the next selection with the same scratch."""

    def __init__(self):
        self._values: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self.native = Buffers()  # the CPU kernel's work space
        self.selected: int | None = None  # the last selection's count (the GPU kernel's room for the next)

    def room(self) -> int | None:
        """How many entries the next selection makes room for before its count is read: twice
        the last count (a selector's counts drift slowly), None before the first."""
        return None if self.selected is None else 2 * self.selected + 1024

    def buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A values buffer like ``x`` and a boolean buffer of its length."""
        if self._values is None or self._values.shape != x.shape or self._values.dtype != x.dtype \
                or self._values.device != x.device:
            self._values = torch.empty_like(x)
            self._mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        return self._values, self._mask


_OWN_KERNELS = [True]  # the device's own kernels (numpy and C on the CPU, Triton on a GPU)


@contextmanager
def portable_passes():
    """Inside the block every device runs torch's passes (torch calls only, no kernel of our
    own), so that a :class:`commlab.bench.opcount.TrafficCounter`, which sees torch calls,
    measures their bytes, and a test can compare the kernels with them."""
    _OWN_KERNELS.append(False)
    try:
        yield
    finally:
        _OWN_KERNELS.pop()


def _numpy(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and _OWN_KERNELS[-1]


def _gpu_kernels(t: torch.Tensor, min_elements: int | None = None):
    """The Triton kernels for CUDA float32 ``t`` (None: torch's passes, also inside
    :func:`portable_passes`); a selection's from :data:`gpu_kernels.MIN_ELEMENTS` entries up."""
    return gpu_kernels.kernels_for(t, min_elements) if _OWN_KERNELS[-1] else None


def _array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (no copy). For the CPU-only arithmetic below: the
    GPU's path makes no host read there, so neither does this."""
    return np.asarray(t)


def at_least(x: torch.Tensor, t: float, scratch: Scratch | None = None) -> torch.Tensor:
    """Boolean mask of the entries of ``x`` with |x| >= t and x != 0 (t <= 0: x != 0; NaN passes),
    in ``scratch``'s buffers when given. On a GPU one comparison of x against t and -t with no
    |x| buffer; on the CPU numpy's comparison of |x| (its kernels are several times faster there
    than torch's)."""
    t = compared(t, x.dtype)
    values, mask = scratch.buffers(x) if scratch is not None else (torch.empty_like(x), None)
    mask = torch.empty(x.shape, dtype=torch.bool, device=x.device) if mask is None else mask
    if _numpy(x) and x.dtype != torch.bfloat16:
        magnitudes = np.abs(_array(x), out=_array(values))
        np.logical_not(np.less(magnitudes, t, out=_array(mask)), out=_array(mask))
        return mask
    # hardshrink(x, l) keeps x where x > l or x < -l: with l the value below t, where |x| >= t
    return mask.copy_(torch.hardshrink(x, neighbour(t, x.dtype, 0.0), out=values))


def above(x: torch.Tensor, t: float, scratch: Scratch | None = None) -> torch.Tensor:
    """Boolean mask of the entries with |x| > t (t < 0: x != 0)."""
    return at_least(x, next_up(t, x.dtype) if t >= 0 else 0.0, scratch)


def compact(mask: torch.Tensor) -> torch.Tensor:
    """The int64 positions of the true entries of a flat ``mask``, ascending: the one pass whose
    result the host must see (its length is the count). On the CPU numpy's compaction of a
    boolean array, several times faster than ``torch.nonzero`` (its ``.numpy()`` stands for the
    host read of the GPU's)."""
    flat = mask.reshape(-1)
    if _numpy(flat):
        return torch.from_numpy(np.flatnonzero(flat.numpy()))
    return torch.nonzero(flat).view(-1)


def select_at_least(x: torch.Tensor, t: float, scratch: Scratch | None = None) -> torch.Tensor:
    """Sorted int64 positions of the entries of flat ``x`` with |x| >= t, x != 0 (NaN passes). On
    the CPU, for float32, the one-pass kernel of :mod:`commlab.compress.native` when it could be
    built (the mask and the compaction in one read); else :func:`at_least` and :func:`compact`."""
    return _select(x.reshape(-1), t, scratch, values=False)


def select_pairs_at_least(x: torch.Tensor, t: float, scratch: Scratch | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_at_least`'s positions and the values there. The CPU kernel keeps each value
    as it reads it (no second, cache-missing gather); elsewhere the values are gathered."""
    return _select(x.reshape(-1), t, scratch, values=True)


def _select(flat: torch.Tensor, t: float, scratch: Scratch | None, values: bool):
    gpu = _gpu_kernels(flat)
    if gpu is not None:
        bits = pattern(t, flat.dtype)
        out = gpu_kernels.run(gpu.select, flat, bits, values, scratch.room() if scratch is not None else None)
        if out is not None:
            if scratch is not None:
                scratch.selected = out[0].numel()
            return out if values else out[0]
    if _numpy(flat) and Kernel.supports(flat):
        native = kernel()
        if native is not None:
            t = compared(t, flat.dtype)
            return native.select(flat, t, scratch.native if scratch is not None else None, values=values)
    idx = compact(at_least(flat, t, scratch))
    return (idx, flat[idx]) if values else idx


def first_within(counts: list[int], ok) -> int:
    """The first index whose count satisfies ``ok``, else the last index (a bounded search of
    the candidates of a guard or correction loop: after its last step it stops unchecked)."""
    return next((j for j, c in enumerate(counts[:-1]) if ok(c)), len(counts) - 1)


def select_pairs_guarded(x: torch.Tensor, t: float, raises: list[float], limit: float,
                         scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """:func:`select_pairs_at_least` at ``t``, guarded: when more than ``limit`` entries pass and
    ``raises`` (ascending thresholds above t) are given, the pairs passing the first raise that
    lets at most ``limit`` pass (the last one when none does). Returns (positions, values, the
    index of the raise kept or None). A raise keeps a subset of the selection, counted among the
    selected entries: no second pass over x. On the CPU and on a GPU the selection's own kernel
    counts the raises as it selects, and the count is read with its total (no further host read
    on a GPU; on the CPU the C side applies this rule itself and gathers the kept pairs in the
    same call, which ``tests/test_native_select.py`` checks against the rule written out);
    elsewhere they are counted among the selected values."""
    flat = x.reshape(-1)
    if raises and _numpy(flat) and Kernel.supports(flat) and len(raises) <= MAX_THRESHOLDS:
        native = kernel()
        if native is not None:
            guards = [compared(u, flat.dtype) for u in raises]
            return native.select_guarded(flat, compared(t, flat.dtype), guards, limit,
                                         scratch.native if scratch is not None else None)
    gpu, out = _gpu_kernels(flat), None
    if gpu is not None and 0 < len(raises) <= gpu.MAX_GUARDS:
        guards = [pattern(u, flat.dtype) for u in raises]
        room = scratch.room() if scratch is not None else None
        out = gpu_kernels.run(gpu.select_counting, flat, pattern(t, flat.dtype), guards, room)
        if out is not None and scratch is not None:
            scratch.selected = out[0].numel()
    # the GPU kernels count the raises among the entries they select; torch's passes do not
    idx, vals, counts = out if out is not None else (*_select(flat, t, scratch, values=True), None)
    if not raises or idx.numel() <= limit:
        return idx, vals, None
    counts = counts if counts is not None else counts_at_least(vals, raises)
    j = first_within(counts, lambda c: c <= limit)
    return (*keep_at_least(idx, vals, raises[j], counts[j]), j)


def keep_at_least(idx: torch.Tensor, vals: torch.Tensor, t: float, count: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of a selection whose values have |value| >= t (a raised threshold keeps a subset:
    no pass over the tensor). ``count``, how many they are when known, spares a GPU its host read:
    the Triton kernels take it as their total, and torch's passes compact with
    ``nonzero_static`` of that size instead of ``nonzero``, whose length the host must read."""
    gpu = _gpu_kernels(vals) if count is not None else None
    if gpu is not None:
        bits = pattern(t, vals.dtype)
        out = gpu_kernels.run(gpu.select, vals, bits, True, None, count)
        if out is not None:
            return idx.index_select(0, out[0]), out[1]
    if count is not None and not _numpy(vals):
        keep = torch.nonzero_static(at_least(vals.reshape(-1), t), size=count).view(-1)
        return idx.index_select(0, keep), vals.index_select(0, keep)
    keep, kept = select_pairs_at_least(vals, t)
    return idx.index_select(0, keep), kept


def select_above(x: torch.Tensor, t: float, scratch: Scratch | None = None) -> torch.Tensor:
    """Sorted int64 positions of the entries of flat ``x`` with |x| > t."""
    return select_at_least(x, next_up(t, x.dtype) if t >= 0 else 0.0, scratch)


def magnitude_stats(x: torch.Tensor, who: str) -> tuple[torch.Tensor, float, float]:
    """``x`` flat (as floats), with its mean |x| and max |x| read on the host together (no |x|
    buffer); a NaN or infinity raises a ValueError naming ``who``."""
    flat = x.reshape(-1)
    if not flat.dtype.is_floating_point:
        flat = flat.float()
    low, high = torch.aminmax(flat)
    both = torch.stack([torch.linalg.vector_norm(flat, ord=1) / flat.numel(), torch.maximum(-low, high)])
    mean, top = both.tolist()
    if not (math.isfinite(mean) and math.isfinite(top)):
        raise ValueError(f"{who}: the tensor holds NaN or infinite values")
    return flat, mean, top


def host_values(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few host numbers on ``device`` without making the host wait: through pinned memory with
    an asynchronous copy on a GPU (a plain ``torch.tensor(list, device="cuda")`` blocks)."""
    host = torch.tensor(values, dtype=dtype)  # host-side: staged for the device
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _histogram(slots: torch.Tensor, bins: int) -> torch.Tensor:
    if slots.device.type == "cpu":
        return torch.bincount(slots, minlength=bins)
    # bincount sizes its output from the data on a GPU (a host sync); an integer index_add does not
    ones = torch.ones((), dtype=torch.int64, device=slots.device).expand(slots.numel())
    return torch.zeros(bins, dtype=torch.int64, device=slots.device).index_add_(0, slots, ones)


COMPACT_FRACTION = 1 / 64  # the CPU's counts continue on the entries passing a threshold this selective


def counts_at_least(x: torch.Tensor, thresholds: list[float], among: torch.Tensor | None = None) -> list[int]:
    """For each threshold t (in the given order), how many entries have |x| >= t and x != 0, read
    on the host: one pass over x and one host sync for all of them. ``among`` (positions known to
    hold every entry that passes the lowest threshold: a selection at or below it) restricts the
    count to those few entries, no pass over x at all.

    On a GPU the pass is one ``bucketize`` against the thresholds and their negatives, then a
    histogram. On the CPU, where torch's bucketize is slow, numpy counts the thresholds from the
    lowest, and continues on the (sorted) entries that pass once a threshold leaves few."""
    flat = x.reshape(-1)
    if among is not None:
        flat = flat[among]
    dtype = flat.dtype
    rounded = [compared(t, dtype) for t in thresholds]
    ts = sorted(set(rounded))
    per = _counts_cpu(flat, ts) if _numpy(flat) else _counts_gpu(flat, ts)
    at = dict(zip(ts, per, strict=True))
    return [at[t] for t in rounded]


NATIVE_COUNT_THRESHOLDS = 16  # the CPU kernel counts up to this many thresholds per pass (a compare each)


def _counts_cpu(flat: torch.Tensor, ts: list[float]) -> list[int]:
    """Counts of |x| >= t for ascending ``ts`` on the CPU (NaN passes, as the masks let it). Its
    ``.numpy()`` stands for the one host read of the GPU's counts. A few thresholds of a float32
    tensor: the native kernel's one pass; else numpy, from the lowest threshold, continuing on the
    sorted entries that pass once few do."""
    native = kernel() if Kernel.supports(flat) and len(ts) <= NATIVE_COUNT_THRESHOLDS else None
    if native is not None:
        return native.count(flat, ts)
    a = np.abs((flat.float() if flat.dtype == torch.bfloat16 else flat).numpy())
    n, work, out = a.size, None, []
    below = np.empty(n, dtype=bool)
    for t in ts:
        if work is None:
            np.less(a, t, out=below)
            count = n - int(np.count_nonzero(below))
            if count <= COMPACT_FRACTION * n:  # later thresholds: among these few only
                work = np.sort(a[~below])
        else:
            count = work.size - int(np.searchsorted(work, t, side="left"))
        out.append(count)
    return out


def _counts_gpu(flat: torch.Tensor, ts: list[float]) -> list[int]:
    """Counts of |x| >= t for ascending ``ts`` off the CPU: the Triton kernel's one pass for up to
    16 thresholds of a CUDA float32 tensor, else one bucketize pass."""
    gpu = _gpu_kernels(flat, min_elements=0) if len(ts) <= NATIVE_COUNT_THRESHOLDS else None
    if gpu is not None:
        out = gpu_kernels.run(gpu.count, flat, [to_bits(t, flat.dtype) for t in ts])
        if out is not None:
            return out
    return _counts_bucketize(flat, ts).tolist()


def _counts_bucketize(flat: torch.Tensor, ts: list[float]) -> torch.Tensor:
    """Counts of |x| >= t for ascending ``ts`` in one bucketize pass (on x's device)."""
    dtype, m = flat.dtype, len(ts)
    # With right=True, bucketize counts the boundaries <= x: x >= t_j passes the j-th positive
    # boundary; x <= -t_j is x < -(value below t_j), which a negative boundary there separates.
    bounds = [-neighbour(t, dtype, 0.0) for t in reversed(ts)] + ts
    slots = torch.bucketize(flat, host_values(bounds, dtype, flat.device), right=True, out_int32=True)
    hist = _histogram(slots.reshape(-1), 2 * m + 1)
    high = hist.flip(0).cumsum(0).flip(0)  # high[i]: entries in slots >= i
    low = hist.cumsum(0)  # low[i]: entries in slots <= i
    j = torch.arange(m, device=flat.device)
    return high[m + 1 + j] + low[m - 1 - j]


def counts_above(x: torch.Tensor, thresholds: list[float], among: torch.Tensor | None = None) -> list[int]:
    """For each threshold t, how many entries have |x| > t (as :func:`counts_at_least`)."""
    return counts_at_least(x, [next_up(t, x.dtype) if t >= 0 else 0.0 for t in thresholds], among)
