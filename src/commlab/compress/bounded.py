"""Count-bounded thresholds over values spread across ranks (Ok-Topk's global selection, Li & Hoefler,
PPoPP'22, section 3, with the bounded threshold control of :mod:`commlab.algorithms.oktopk`).

:func:`distributed_threshold` finds a threshold t such that the number of entries with
|x| >= t, summed over every rank, lies in [k_min, k_max], without moving the values: a bisection
on the bit pattern of t (a non-negative float's bits order like the float), each probe one
allreduce of a single count (at most 2 elements sent per rank), at most one probe per bit plus
one: 32 probes for float32, 64 for float64. With k_min = k_max = k the result selects exactly the
global top-k (the entries strictly above the (k+1)-th largest); when ties at the boundary make an
exact count impossible it selects the largest set with at most k_max entries, so the cap holds
whatever the data. :func:`probe_cost_bound` is the worst-case number of elements it sends.

    t = distributed_threshold(comm, region_values, k_max=k, k_min=k)   # exact global top-k
"""

from __future__ import annotations

import torch

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_view(dtype: torch.dtype) -> torch.dtype:
    size = torch.empty((), dtype=dtype).element_size()  # host-side: only the dtype's width is read
    if size not in _BITS:
        raise ValueError(f"no integer view for values of dtype {dtype}")
    return _BITS[size]


def probe_rounds(dtype: torch.dtype) -> int:
    """Worst-case number of count probes of :func:`distributed_threshold` for ``dtype`` values."""
    return 8 * torch.empty((), dtype=dtype).element_size() + 1  # host-side: the dtype's width


def probe_cost_bound(dtype: torch.dtype, p: int) -> int:
    """Worst-case elements sent per rank by :func:`distributed_threshold` (2 per 1-element
    ring allreduce, nothing alone)."""
    return 0 if p == 1 else 2 * probe_rounds(dtype)


class _Counter:
    """|x| >= t counted over all ranks: local sorted magnitudes, one allreduce per probe."""

    def __init__(self, comm, values: torch.Tensor):
        self.comm = comm
        self.sorted = torch.sort(values.reshape(-1).abs()).values
        self.dtype = values.dtype
        self.ints = _int_view(values.dtype)
        self.probes = 0

    def value(self, bits: int) -> float:
        return float(torch.tensor([bits], dtype=self.ints).view(self.dtype).item())  # host-side: bit arithmetic

    def count(self, bits: int) -> int:
        t = self.value(bits)
        m = self.sorted.numel()
        if t <= 0:  # threshold 0 selects the non-zero entries
            probe = torch.zeros((), dtype=self.dtype, device=self.sorted.device)
            mine = m - int(torch.searchsorted(self.sorted, probe, right=True))
        else:  # searchsorted needs its value on the values' device
            probe = torch.tensor(t, dtype=self.dtype, device=self.sorted.device)
            mine = m - int(torch.searchsorted(self.sorted, probe, right=False))
        self.probes += 1
        if self.comm.size == 1:
            return mine
        total = torch.tensor([mine], dtype=torch.int64, device=self.sorted.device)
        self.comm.all_reduce(total, op="sum")
        self.comm.stats.relabel_last("sparse_threshold_probe")
        return int(total.item())


def distributed_threshold(comm, values: torch.Tensor, k_max: int, k_min: int | None = None) -> float:
    """A threshold selecting between ``k_min`` and ``k_max`` entries of all ranks' ``values``
    together (|x| >= t, x != 0), the smallest one selecting at most ``k_max`` when no threshold
    fits the band. Every rank of ``comm`` calls it with its own values and gets the same result."""
    k_min = k_max if k_min is None else k_min
    if not 0 <= k_min <= k_max:
        raise ValueError(f"need 0 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
    counter = _Counter(comm, values)
    if counter.count(0) <= k_max:
        return 0.0
    # Invariant: count(lo) > k_max >= count(hi); +inf selects nothing.
    inf = torch.tensor([float("inf")], dtype=values.dtype)  # host-side: the bit pattern of +inf
    lo, hi = 0, int(inf.view(counter.ints).item())
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = counter.count(mid)
        if k_min <= c <= k_max:
            return counter.value(mid)
        if c > k_max:
            lo = mid
        else:
            hi = mid
    return counter.value(hi)
