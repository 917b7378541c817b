"""Sparse collectives shared by every sparse method (Li & Hoefler, PPoPP'22, section 3: Ok-Topk's
building blocks; docs/performance.md, "Sparse messages").

A sparse contribution is a pair of tensors: ``indices`` (positions in a flat tensor of ``n``
elements) and ``values``. On the wire the pairs of a message travel **in one integer tensor**
(:class:`Pairs`): one row per pair, the index in column 0 and the value's exact bit pattern
(``values.view(int)``) in column 1, in a word of :func:`wire_dtype` (int32 when the index fits
and the value has at most 4 bytes, else int64). So one collective moves both, nothing is ever
packed into floats (indices above 2^24 stay exact) and every value arrives bit for bit. The
Communicator charges a packed message what it carries: 2 elements per pair (an index and a
value) of the word's size, so 8 bytes per float32 pair with int32 indices, as two messages did.
Everything is built on the :class:`~commlab.core.Communicator`, so every element and byte is
counted, and works on gloo and NCCL alike: data stay on their device, only per-rank counts are
read on the host, once per exchange.

* :func:`allgatherv_pairs`: every rank gets every rank's pairs (uneven and empty contributions
  allowed): the counts (gathered first unless given), then one allgather of the packed pairs
  padded to the largest count, the padding counted as sent.
* :func:`split_and_reduce`: the index space is cut into P regions; every rank sends its pairs of
  region j to rank j (the counts exchanged first, read on the host once) and rank j sums what it
  receives. With ``schedule="alltoall"`` one ``all_to_all`` of packed pairs moves everything:
  gloo's alltoallv already posts its sends in rotated order (rank i sends to i+1, i+2, ... and
  receives from i-1, i-2, ...), which is the rotation of the paper. ``schedule="rounds"`` spells
  the rotation out as P-1 rounds in which rank i sends only to i+r and receives only from i-r (the
  release's pattern, for NCCL or real links where the backend's own order does not rotate).
* :func:`balanced_boundaries`: region boundaries proposed by each rank at the quantiles of its
  selected indices and averaged over the ranks (one allreduce of P-1 integers), so that every
  region receives about the same number of selected entries.
* :func:`allgather_balanced`: allgatherv preceded by a re-distribution that gives every rank the
  same number of pairs, so that the gather is a ring allgather of equal blocks (Ok-Topk's
  optional balancing step).

Usage::

    b = balanced_boundaries(comm, selected, n)             # P+1 boundaries, b[0]=0, b[P]=n
    idx, val = split_and_reduce(comm, selected, acc[selected], b, sorted_indices=True)
    all_idx, all_val, counts = allgatherv_pairs(comm, idx, val, n)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.core.communicator import Communicator, ring_chunks


def index_dtype(n: int) -> torch.dtype:
    """int32 when every index of an ``n``-element tensor fits (exact up to 2^31 - 1), else int64."""
    return torch.int32 if n < 2**31 else torch.int64


SCHEDULES = ("alltoall", "rounds")
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a value's bit pattern


def _as_index(indices: torch.Tensor, n: int) -> torch.Tensor:
    return indices.reshape(-1).to(index_dtype(n))


def _relabel(comm: Communicator, op: str) -> None:
    comm.stats.relabel_last(op)


# ---------------------------------------------------------------------- packed pairs
def wire_dtype(n: int, values: torch.dtype) -> torch.dtype:
    """The integer word of a packed pair of an ``n``-element tensor with ``values`` of this dtype:
    int32 when the index fits int32 and the value has at most 4 bytes, else int64 (a narrower
    index or value is widened to it; both stay exact)."""
    return torch.int32 if index_dtype(n) == torch.int32 and values.itemsize <= 4 else torch.int64


@dataclass
class Pairs:
    """(index, value) pairs packed in one integer tensor: ``packed`` has one row per pair, the
    index in column 0 and the value's bit pattern in column 1 (:func:`wire_dtype` words);
    ``dtype`` is the values' dtype. :meth:`pack` and :meth:`unpack` are exact inverses."""

    packed: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def pack(cls, indices: torch.Tensor, values: torch.Tensor, n: int, rows: int | None = None) -> Pairs:
        """Pack ``indices`` (< ``n``) and ``values``; ``rows`` > their number pads with zero rows."""
        idx, val = indices.reshape(-1), values.reshape(-1).contiguous()
        if idx.numel() != val.numel():
            raise ValueError(f"indices ({idx.numel()}) and values ({val.numel()}) differ in length")
        m = idx.numel()
        rows = m if rows is None else rows
        word = wire_dtype(n, val.dtype)
        make = torch.empty if rows == m else torch.zeros
        packed = make((rows, 2), dtype=word, device=val.device)
        packed[:m, 0] = idx
        packed[:m, 1] = val.view(_SAME_WIDTH_INT[val.element_size()])  # sign-extended bits: exact
        return cls(packed, val.dtype)

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 indices and the values, bit for bit as packed."""
        bits = self.packed[:, 1].to(_SAME_WIDTH_INT[self.dtype.itemsize])
        return self.packed[:, 0].long(), bits.contiguous().view(self.dtype)


def gather_counts(comm: Communicator, rows: int, device: torch.device) -> list[int]:
    """Every rank's row count (one all_gather of one int64 per rank)."""
    mine = torch.full((1,), rows, dtype=torch.int64, device=device)
    counts = comm.all_gather(mine).view(-1).tolist()
    _relabel(comm, "sparse_counts")
    return [int(c) for c in counts]


def _allgather_padded(comm: Communicator, pairs: Pairs, counts: list[int]) -> Pairs:
    """Ring allgather of every rank's packed pairs, each padded to the largest count (the padding
    is sent and counted); returns the pairs of every rank in rank order, padding dropped."""
    return Pairs(torch.cat(comm.all_gatherv(pairs.packed, counts)), pairs.dtype)


def allgatherv_pairs(comm: Communicator, indices: torch.Tensor, values: torch.Tensor, n: int,
                     counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Gather every rank's (indices, values) pairs; returns them concatenated in rank order.

    ``n`` is the length of the dense tensor the indices point into (it fixes the wire word).
    ``counts`` (every rank's number of pairs) skips the count exchange when already known.
    Returned indices are int64, values keep their dtype. Cost per rank: (P-1) counts unless given,
    then (P-1)·max_j n_j packed pairs (2 elements each): the allgather of the largest
    contribution, which every rank pays (the busiest rank's cost of an allgatherv)."""
    if indices.numel() != values.numel():
        raise ValueError(f"indices ({indices.numel()}) and values ({values.numel()}) differ in length")
    if counts is None:
        counts = gather_counts(comm, indices.numel(), values.device)
    if comm.size == 1:
        return indices.reshape(-1).long(), values.reshape(-1).clone(), counts
    if max(counts) == 0:
        return indices.reshape(-1).long(), values.reshape(-1), counts
    every = _allgather_padded(comm, Pairs.pack(indices, values, n), counts)
    _relabel(comm, "sparse_allgatherv")
    all_idx, all_val = every.unpack()
    return all_idx, all_val, counts


# ---------------------------------------------------------------------- regions
def equal_boundaries(n: int, p: int) -> list[int]:
    """P+1 boundaries cutting ``n`` indices into P contiguous regions of (almost) equal length."""
    chunks = ring_chunks(n, p)
    bounds = [0]
    for c in chunks:
        bounds.append(bounds[-1] + c)
    return bounds


def balanced_boundaries(comm: Communicator, selected: torch.Tensor, n: int) -> list[int]:
    """Region boundaries with about equal numbers of selected entries per region.

    ``selected`` are this rank's selected indices, sorted ascending. Each rank proposes the
    indices at positions j·m/P (j = 1..P-1) of its m selected entries (equal regions when it
    selected fewer than P); the proposals are summed with one allreduce of P-1 int64 and divided by
    P. Returns P+1 non-decreasing boundaries from 0 to n."""
    p = comm.size
    if p == 1:
        return [0, n]
    sel = selected.reshape(-1)
    m = sel.numel()
    if m >= p:
        pos = torch.arange(1, p, device=sel.device, dtype=torch.int64) * (m // p)
        proposal = sel[pos].to(torch.int64)
    else:
        proposal = torch.tensor(equal_boundaries(n, p)[1:p], dtype=torch.int64, device=sel.device)
    comm.all_reduce(proposal, op="sum")
    _relabel(comm, "sparse_repartition")
    inner = (proposal // p).tolist()
    return [0, *[int(b) for b in inner], n]


class Regions:
    """P+1 region boundaries and their inner P-1 on the device, made once per change of the
    boundaries (a Python list turned into a device tensor at every step would be a blocking
    host-to-device copy)."""

    def __init__(self, boundaries: list[int]):
        self.bounds = [int(b) for b in boundaries]
        self._inner: dict[tuple, torch.Tensor] = {}

    def inner(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (str(device), dtype)
        if key not in self._inner:
            self._inner[key] = torch.tensor(self.bounds[1:-1], dtype=dtype, device=device)
        return self._inner[key]


def _region_counts(comm: Communicator, indices: torch.Tensor, regions: Regions, sorted_indices: bool
                   ) -> tuple[torch.Tensor | None, list[int], list[int]]:
    """Order that groups ``indices`` by region (None when they are sorted), and this rank's send
    and receive counts per region: counted on the device, exchanged with one all_to_all of P
    int64, and read on the host once for both."""
    p = comm.size
    inner = regions.inner(indices.device, indices.dtype)
    if sorted_indices:
        order = None
        cuts = torch.searchsorted(indices, inner, right=False)
        edges = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), indices.numel())])
        send = edges[1:] - edges[:-1]
    else:
        region = torch.searchsorted(inner, indices, right=True)
        order = torch.argsort(region, stable=True)
        send = torch.zeros(p, dtype=torch.int64, device=indices.device).index_add_(
            0, region, torch.ones_like(region))
    send = send.to(torch.int64).to(comm.device)
    recv, _ = comm.all_to_all_single(send, [1] * p, [1] * p)
    _relabel(comm, "sparse_split_counts")
    both = torch.cat([send, recv]).tolist()
    return order, both[:p], both[p:]


def canonical_order(indices: torch.Tensor, values: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """A permutation that sorts pairs by index, and equal indices by their value's bit pattern: the
    same order whatever order the pairs came in (ties are identical pairs, so their order is moot).
    ``n``, when given, bounds the indices (all < n)."""
    bits = values.view(_SAME_WIDTH_INT[values.element_size()])
    if values.element_size() <= 4 and n is not None and n <= 2**31:
        # One sort of a 64-bit key, the index in the high half and the value bits, offset to be
        # non-negative (same order as the signed bits), in the low half: the order of the two
        # stable sorts below, about twice as fast.
        offset = 1 << (8 * values.element_size() - 1)
        return torch.argsort((indices.long() << 32) | (bits.long() + offset))
    by_value = torch.argsort(bits, stable=True)
    return by_value[torch.argsort(indices[by_value], stable=True)]


def reduce_pairs(indices: torch.Tensor, values: torch.Tensor, n: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the values of equal indices: returns sorted unique indices (int64) and their sums.
    ``n`` (optional) bounds the indices, which lets the canonical order take one sort instead of two.

    Bitwise independent of the order of the pairs, so replicas that reduce the same gathered pairs
    on their own (TopkA, Gaussian-k, RedSync) stay identical: the pairs are put in
    :func:`canonical_order` and each run of equal indices is summed by ``torch.segment_reduce``,
    which has a fixed summation order on every device. (``index_add_`` adds in arrival order on the
    CPU and with atomics, in no fixed order, on CUDA.)"""
    if indices.numel() == 0:
        return indices.reshape(-1).long(), values.reshape(-1)
    idx, val = indices.reshape(-1).long(), values.reshape(-1)
    order = canonical_order(idx, val, n)
    idx, val = idx[order], val[order]
    uniq, counts = torch.unique_consecutive(idx, return_counts=True)
    # unsafe: the lengths come from unique_consecutive, so the host-side check (a sync) is moot
    return uniq, torch.segment_reduce(val, "sum", lengths=counts, unsafe=True)


def split_and_reduce(comm: Communicator, indices: torch.Tensor, values: torch.Tensor,
                     boundaries: list[int] | Regions, sorted_indices: bool = False, schedule: str = "alltoall"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each pair to the rank owning its region and sum there.

    ``boundaries`` has P+1 entries (region j = [b_j, b_{j+1}), b_P = n), as a list or as
    :class:`Regions` (which keeps their device copy between calls). Returns this rank's reduced
    region: sorted unique int64 indices (the union of what every rank sent into the region) and
    the sums of their values. ``sorted_indices=True`` promises ascending indices and saves a sort.
    Cost per rank: P-1 counts each way, then sent = the pairs of other regions, received = the
    pairs other ranks sent into this region (2 elements per pair)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    p = comm.size
    regions = boundaries if isinstance(boundaries, Regions) else Regions(boundaries)
    if len(regions.bounds) != p + 1:
        raise ValueError(f"need {p + 1} region boundaries for {p} ranks, got {len(regions.bounds)}")
    n = regions.bounds[-1]
    idx = indices.reshape(-1)
    val = values.reshape(-1)
    if idx.numel() != val.numel():
        raise ValueError(f"indices ({idx.numel()}) and values ({val.numel()}) differ in length")
    if p == 1:
        return reduce_pairs(idx, val, n)
    order, send_counts, recv_counts = _region_counts(comm, idx, regions, sorted_indices)
    if order is not None:
        idx, val = idx[order], val[order]
    if schedule == "alltoall":
        got, _ = comm.all_to_all_single(Pairs.pack(idx, val, n).packed, send_counts, recv_counts)
        _relabel(comm, "sparse_split_pairs")
        got_idx, got_val = Pairs(got, val.dtype).unpack()
    else:
        got_idx, got_val = _rotated_rounds(comm, _as_index(idx, n), val, send_counts, recv_counts)
    return reduce_pairs(got_idx, got_val, n)


def _rotated_rounds(comm: Communicator, idx: torch.Tensor, val: torch.Tensor, send_counts: list[int],
                    recv_counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """P-1 rounds; in round r rank i sends region (i+r)'s block and receives from rank i-r.

    The counts are known before the first round (one exchange for all of them), and a round only
    enqueues its two all_to_alls (the Communicator never waits for the device), so the rounds add
    no host synchronisation, whatever P."""
    p, me = comm.size, comm.rank
    starts = [0]
    for c in send_counts:
        starts.append(starts[-1] + c)
    got_idx: list[torch.Tensor | None] = [None] * p
    got_val: list[torch.Tensor | None] = [None] * p
    got_idx[me] = idx[starts[me]:starts[me + 1]]
    got_val[me] = val[starts[me]:starts[me + 1]]
    for r in range(1, p):
        dst, src = (me + r) % p, (me - r) % p
        sc, rc = [0] * p, [0] * p
        sc[dst], rc[src] = send_counts[dst], recv_counts[src]
        block = slice(starts[dst], starts[dst + 1])
        got_idx[src], _ = comm.all_to_all_single(idx[block], sc, rc)
        _relabel(comm, "sparse_split_indices")
        got_val[src], _ = comm.all_to_all_single(val[block], sc, rc)
        _relabel(comm, "sparse_split_values")
    return torch.cat(got_idx), torch.cat(got_val)


def _overlaps(starts: list[int], sizes: list[int], lo: int, hi: int) -> list[int]:
    """Length of the overlap of [lo, hi) with each block [starts[j], starts[j] + sizes[j])."""
    return [max(0, min(hi, s + c) - max(lo, s)) for s, c in zip(starts, sizes, strict=True)]


def balance_pairs(comm: Communicator, pairs: Pairs, counts: list[int]) -> tuple[Pairs, list[int]]:
    """Re-distribute packed pairs so that rank j holds the j-th of P (almost) equal slices of the
    rank-ordered concatenation of everyone's pairs. ``counts`` are every rank's pair counts (from
    :func:`gather_counts`), so no further count exchange is needed. Only the surplus moves: rank i
    sends the part of its block that falls outside its slice (one all_to_all of packed pairs).
    Returns this rank's slice and every rank's slice size."""
    p, me = comm.size, comm.rank
    owned = ring_chunks(sum(counts), p)
    src_start = [sum(counts[:j]) for j in range(p)]
    dst_start = [sum(owned[:j]) for j in range(p)]
    send = _overlaps(dst_start, owned, src_start[me], src_start[me] + counts[me])
    recv = _overlaps(src_start, counts, dst_start[me], dst_start[me] + owned[me])
    got, _ = comm.all_to_all_single(pairs.packed, send, recv)
    _relabel(comm, "sparse_balance_pairs")
    return Pairs(got, pairs.dtype), owned


def allgather_equal(comm: Communicator, pairs: Pairs, owned: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring allgather of balanced slices of packed pairs (sizes ``owned`` differ by at most one;
    the shorter ones are padded by one pair, and the padding is counted as sent). Returns int64
    indices and values in rank order."""
    every = _allgather_padded(comm, pairs, owned)
    _relabel(comm, "sparse_allgather_pairs")
    return every.unpack()


def allgather_balanced(comm: Communicator, indices: torch.Tensor, values: torch.Tensor, n: int,
                       counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Allgatherv in two steps (Ok-Topk's balancing): :func:`balance_pairs`, then
    :func:`allgather_equal`. Same result as :func:`allgatherv_pairs`, in the same order."""
    if counts is None:
        counts = gather_counts(comm, indices.numel(), values.device)
    if comm.size == 1 or sum(counts) == 0:
        return indices.reshape(-1).long(), values.reshape(-1).clone(), counts
    balanced, owned = balance_pairs(comm, Pairs.pack(indices, values, n), counts)
    all_idx, all_val = allgather_equal(comm, balanced, owned)
    return all_idx, all_val, counts


def scatter_dense(indices: torch.Tensor, values: torch.Tensor, n: int, accumulate: bool = True
                  ) -> torch.Tensor:
    """A dense tensor of ``n`` zeros with ``values`` added (or written) at ``indices``."""
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    if indices.numel():
        out.index_put_((indices.long(),), values, accumulate=accumulate)
    return out
