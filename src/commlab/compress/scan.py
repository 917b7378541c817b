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

A selection is then: a mask, a compaction and, only when its count misses, one multi-threshold
count and a second compaction. Thresholds are Python floats compared in the tensor's dtype (the
comparison rounds t to it, as ``x >= t`` does); NaN entries pass every threshold, so that a NaN
reaches the update instead of hiding in a residual. Example::

    >>> x = torch.tensor([0.5, -2.0, 1.0, 0.0, -1.0])
    >>> compact(at_least(x, 1.0))
    tensor([1, 2, 4])
    >>> counts_at_least(x, [0.5, 1.0, 3.0]).tolist()
    [4, 3, 0]
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
import torch.nn.functional as F

# Float formats by their bit patterns, in plain Python: thresholds are host numbers, and host
# arithmetic done with torch scalars would read like device work.
_FORMATS = {torch.float64: ("<d", "<Q"), torch.float32: ("<f", "<I"), torch.float16: ("<e", "<H")}


def to_bits(t: float, dtype: torch.dtype) -> int:
    """The bit pattern of ``t`` rounded (to nearest even) to ``dtype``."""
    if dtype == torch.bfloat16:  # the high half of a float32, rounded to nearest even
        high = to_bits(t, torch.float32)
        if math.isnan(t):
            return high >> 16
        return (high + 0x7FFF + ((high >> 16) & 1)) >> 16
    if dtype not in _FORMATS:
        raise ValueError(f"no float format for dtype {dtype}")
    value, bits = _FORMATS[dtype]
    try:
        return struct.unpack(bits, struct.pack(value, t))[0]
    except OverflowError:  # beyond the format's largest finite value: rounds to infinity
        return to_bits(math.copysign(math.inf, t), dtype)


def from_bits(bits: int, dtype: torch.dtype) -> float:
    """The value of a bit pattern of ``dtype``."""
    if dtype == torch.bfloat16:
        return from_bits(bits << 16, torch.float32)
    value, pattern = _FORMATS[dtype]
    return struct.unpack(value, struct.pack(pattern, bits))[0]


def in_dtype(t: float, dtype: torch.dtype) -> float:
    """``t`` rounded to ``dtype``, as a comparison with a tensor of that dtype rounds it."""
    return from_bits(to_bits(t, dtype), dtype)


def _step(t: float, dtype: torch.dtype, toward: float) -> float:
    """The neighbour of ``t`` >= 0 (rounded to ``dtype``) in ``dtype``, toward ``toward``."""
    bits = to_bits(t, dtype)
    if bits == 0 or (toward == 0 and math.copysign(1.0, from_bits(bits, dtype)) < 0):
        return from_bits(1, dtype) if toward > 0 else 0.0  # from +-0: the smallest positive value
    return from_bits(bits + (1 if toward > from_bits(bits, dtype) else -1), dtype)


def next_up(t: float, dtype: torch.dtype) -> float:
    """The smallest value of ``dtype`` above ``t`` (>= 0): |x| > t is |x| >= next_up(t)."""
    return _step(t, dtype, math.inf)


def _tiny(dtype: torch.dtype) -> float:
    """The smallest positive value of ``dtype``: |x| >= it is x != 0."""
    return from_bits(1, dtype)


def at_least(x: torch.Tensor, t: float) -> torch.Tensor:
    """Boolean mask of the entries of ``x`` with |x| >= t and x != 0 (t <= 0: x != 0), from one
    comparison of x against t and -t (no |x| buffer)."""
    t = max(in_dtype(t, x.dtype), _tiny(x.dtype))
    # hardshrink(x, l) keeps x where x > l or x < -l: with l the value below t, where |x| >= t
    return F.hardshrink(x, _step(t, x.dtype, 0.0)).bool()


def above(x: torch.Tensor, t: float) -> torch.Tensor:
    """Boolean mask of the entries with |x| > t (t < 0: x != 0)."""
    return at_least(x, next_up(t, x.dtype) if t >= 0 else 0.0)


def compact(mask: torch.Tensor) -> torch.Tensor:
    """The int64 positions of the true entries of a flat ``mask``, ascending: the one pass whose
    result the host must see (its length is the count)."""
    flat = mask.reshape(-1)
    if flat.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(flat.numpy()))
    return torch.nonzero(flat).view(-1)


def select_at_least(x: torch.Tensor, t: float) -> torch.Tensor:
    """Sorted int64 positions of the entries of flat ``x`` with |x| >= t, x != 0."""
    return compact(at_least(x.reshape(-1), t))


def select_above(x: torch.Tensor, t: float) -> torch.Tensor:
    """Sorted int64 positions of the entries of flat ``x`` with |x| > t."""
    return compact(above(x.reshape(-1), t))


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
    return torch.zeros(bins, dtype=torch.int64, device=slots.device).index_add_(
        0, slots, torch.ones_like(slots, dtype=torch.int64))


def counts_at_least(x: torch.Tensor, thresholds: list[float]) -> torch.Tensor:
    """For each threshold t (in the given order), how many entries have |x| >= t and x != 0: one
    pass over x (an int64 tensor on x's device; the caller reads it when it needs to)."""
    flat = x.reshape(-1)
    dtype = flat.dtype
    rounded = [max(in_dtype(t, dtype), _tiny(dtype)) for t in thresholds]
    ts = sorted(set(rounded))
    m = len(ts)
    # With right=True, bucketize counts the boundaries <= x: x >= t_j passes the j-th positive
    # boundary; x <= -t_j is x < -(value below t_j), which a negative boundary there separates.
    bounds = [-_step(t, dtype, 0.0) for t in reversed(ts)] + ts
    slots = torch.bucketize(flat, host_values(bounds, dtype, flat.device), right=True)
    hist = _histogram(slots.reshape(-1), 2 * m + 1)
    high = hist.flip(0).cumsum(0).flip(0)  # high[i]: entries in slots >= i
    low = hist.cumsum(0)  # low[i]: entries in slots <= i
    j = torch.arange(m, device=flat.device)
    per = high[m + 1 + j] + low[m - 1 - j]  # ascending thresholds
    if rounded == ts:
        return per
    if rounded == ts[::-1]:
        return per.flip(0)
    return per[host_values([ts.index(t) for t in rounded], torch.int64, flat.device)]


def counts_above(x: torch.Tensor, thresholds: list[float]) -> torch.Tensor:
    """For each threshold t, how many entries have |x| > t (one pass)."""
    return counts_at_least(x, [next_up(t, x.dtype) if t >= 0 else 0.0 for t in thresholds])
