"""Sparse collectives shared by every sparse method (Li & Hoefler, PPoPP'22, section 3: Ok-Topk's building blocks).

A sparse contribution is a pair of tensors: ``indices`` (positions in a flat tensor of ``n``
elements) and ``values``. Indices always travel in their own integer tensor of
:func:`index_dtype` (int32 below 2^31 elements, int64 above), values in
their own dtype; nothing is packed into floats, so indices above 2^24 stay exact. Everything is
built on the :class:`~commlab.core.Communicator`, so every element and byte is counted, and works
on gloo and NCCL alike: data stay on their device, only the per-rank counts are read on the host.

* :func:`allgatherv_pairs`: every rank gets every rank's pairs (uneven and empty contributions
  allowed). The counts are gathered once for both tensors.
* :func:`split_and_reduce`: the index space is cut into P regions; every rank sends its pairs of
  region j to rank j (counts exchanged first) and rank j sums what it receives. With
  ``schedule="alltoall"`` one ``all_to_all`` per tensor moves everything: gloo's alltoallv already
  posts its sends in rotated order (rank i sends to i+1, i+2, ... and receives from i-1, i-2, ...),
  which is the rotation of the paper. ``schedule="rounds"`` spells the rotation out as P-1 rounds
  in which rank i sends only to i+r and receives only from i-r (the release's pattern, for NCCL or
  real links where the backend's own order does not rotate).
* :func:`balanced_boundaries`: region boundaries proposed by each rank at the quantiles of its
  selected indices and averaged over the ranks (one allreduce of P-1 integers), so that every
  region receives about the same number of selected entries.
* :func:`allgather_balanced`: allgatherv preceded by a re-distribution that gives every rank the
  same number of pairs, so that the gather is a ring allgather of equal blocks (Ok-Topk's
  optional balancing step).

Usage::

    b = balanced_boundaries(comm, selected, n)             # P+1 boundaries, b[0]=0, b[P]=n
    idx, val = split_and_reduce(comm, selected, acc[selected], b, sorted_indices=True)
    all_idx, all_val, counts = allgatherv_pairs(comm, idx, val)
"""

from __future__ import annotations

import torch

from commlab.core.communicator import Communicator, ring_chunks


def index_dtype(n: int) -> torch.dtype:
    """int32 when every index of an ``n``-element tensor fits (exact up to 2^31 - 1), else int64."""
    return torch.int32 if n < 2**31 else torch.int64


SCHEDULES = ("alltoall", "rounds")


def _as_index(indices: torch.Tensor, n: int) -> torch.Tensor:
    return indices.reshape(-1).to(index_dtype(n))


def _relabel(comm: Communicator, op: str) -> None:
    comm.stats.relabel_last(op)


def gather_counts(comm: Communicator, rows: int, device: torch.device) -> list[int]:
    """Every rank's row count (one all_gather of one int64 per rank)."""
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    counts = comm.all_gather(mine).view(-1).tolist()
    _relabel(comm, "sparse_counts")
    return [int(c) for c in counts]


def allgatherv_pairs(comm: Communicator, indices: torch.Tensor, values: torch.Tensor, n: int,
                     counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Gather every rank's (indices, values) pairs; returns them concatenated in rank order.

    ``n`` is the length of the dense tensor the indices point into (it fixes the index dtype).
    ``counts`` (every rank's number of pairs) skips the count exchange when already known.
    Returned indices are int64, values keep their dtype. Cost per rank i: sent (P-1)·n_i pairs,
    received sum_{j!=i} n_j pairs (each pair = one index + one value element)."""
    if indices.numel() != values.numel():
        raise ValueError(f"indices ({indices.numel()}) and values ({values.numel()}) differ in length")
    rows = indices.numel()
    if counts is None:
        counts = gather_counts(comm, rows, values.device)
    p = comm.size
    idx = _as_index(indices, n)
    val = values.reshape(-1)
    if p == 1:
        return idx.long(), val.clone(), counts
    # Every rank receives the same block: an all_to_all whose P send blocks are copies of ours.
    out_idx, _ = comm.all_to_all_single(idx.repeat(p), [rows] * p, counts)
    _relabel(comm, "sparse_allgatherv_indices")
    out_val, _ = comm.all_to_all_single(val.repeat(p), [rows] * p, counts)
    _relabel(comm, "sparse_allgatherv_values")
    return out_idx.long(), out_val, counts


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


def _region_counts(indices: torch.Tensor, boundaries: list[int], sorted_indices: bool
                   ) -> tuple[torch.Tensor, list[int]]:
    """Order that groups ``indices`` by region, and the number of indices in each region."""
    p = len(boundaries) - 1
    inner = torch.tensor(boundaries[1:p], dtype=indices.dtype, device=indices.device)
    if sorted_indices:
        cuts = torch.searchsorted(indices, inner, right=False).tolist()
        edges = [0, *cuts, indices.numel()]
        return None, [edges[j + 1] - edges[j] for j in range(p)]
    region = torch.searchsorted(inner, indices, right=True)
    order = torch.argsort(region, stable=True)
    counts = torch.bincount(region, minlength=p).tolist()
    return order, [int(c) for c in counts]


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    return uniq, torch.segment_reduce(val, "sum", lengths=counts)


def split_and_reduce(comm: Communicator, indices: torch.Tensor, values: torch.Tensor,
                     boundaries: list[int], sorted_indices: bool = False, schedule: str = "alltoall"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each pair to the rank owning its region and sum there.

    ``boundaries`` has P+1 entries (region j = [b_j, b_{j+1}), b_P = n). Returns this rank's
    reduced region: sorted unique int64 indices (the union of what every rank sent into the
    region) and the sums of their values. ``sorted_indices=True`` promises ascending indices and
    saves a sort. Cost per rank: P-1 counts each way, then sent = the pairs of other regions,
    received = the pairs other ranks sent into this region."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    p = comm.size
    if len(boundaries) != p + 1:
        raise ValueError(f"need {p + 1} region boundaries for {p} ranks, got {len(boundaries)}")
    n = boundaries[-1]
    idx = indices.reshape(-1)
    val = values.reshape(-1)
    if idx.numel() != val.numel():
        raise ValueError(f"indices ({idx.numel()}) and values ({val.numel()}) differ in length")
    order, send_counts = _region_counts(idx, boundaries, sorted_indices)
    if order is not None:
        idx, val = idx[order], val[order]
    if p == 1:
        return reduce_pairs(idx, val, n)
    recv_counts = comm.exchange_counts(send_counts)
    _relabel(comm, "sparse_split_counts")
    idx = _as_index(idx, n)
    if schedule == "alltoall":
        got_idx, _ = comm.all_to_all_single(idx, send_counts, recv_counts)
        _relabel(comm, "sparse_split_indices")
        got_val, _ = comm.all_to_all_single(val, send_counts, recv_counts)
        _relabel(comm, "sparse_split_values")
    else:
        got_idx, got_val = _rotated_rounds(comm, idx, val, send_counts, recv_counts)
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


def balance_pairs(comm: Communicator, indices: torch.Tensor, values: torch.Tensor, n: int,
                  counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Re-distribute pairs so that rank j holds the j-th of P (almost) equal slices of the
    rank-ordered concatenation of everyone's pairs. ``counts`` are every rank's pair counts (from
    :func:`gather_counts`), so no further count exchange is needed. Only the surplus moves: rank i
    sends the part of its block that falls outside its slice. Returns this rank's slice (indices in
    the wire dtype) and every rank's slice size."""
    p, me = comm.size, comm.rank
    owned = ring_chunks(sum(counts), p)
    src_start = [sum(counts[:j]) for j in range(p)]
    dst_start = [sum(owned[:j]) for j in range(p)]
    send = _overlaps(dst_start, owned, src_start[me], src_start[me] + counts[me])
    recv = _overlaps(src_start, counts, dst_start[me], dst_start[me] + owned[me])
    bal_idx, _ = comm.all_to_all_single(_as_index(indices, n), send, recv)
    _relabel(comm, "sparse_balance_indices")
    bal_val, _ = comm.all_to_all_single(values.reshape(-1), send, recv)
    _relabel(comm, "sparse_balance_values")
    return bal_idx, bal_val, owned


def allgather_equal(comm: Communicator, indices: torch.Tensor, values: torch.Tensor, owned: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring allgather of balanced slices (sizes ``owned`` differ by at most one; the shorter ones
    are padded by one pair, and the padding is counted as sent). Returns int64 indices and values
    in rank order."""
    p = comm.size
    width = max(owned)
    pad = width - indices.numel()
    if pad:
        indices = torch.cat([indices, indices.new_zeros(pad)])
        values = torch.cat([values, values.new_zeros(pad)])
    all_idx = comm.all_gather(indices)
    _relabel(comm, "sparse_allgather_indices")
    all_val = comm.all_gather(values)
    _relabel(comm, "sparse_allgather_values")
    return (torch.cat([all_idx[j, :owned[j]] for j in range(p)]).long(),
            torch.cat([all_val[j, :owned[j]] for j in range(p)]))


def allgather_balanced(comm: Communicator, indices: torch.Tensor, values: torch.Tensor, n: int,
                       counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Allgatherv in two steps (Ok-Topk's balancing): :func:`balance_pairs`, then
    :func:`allgather_equal`. Same result as :func:`allgatherv_pairs`, in the same order."""
    if counts is None:
        counts = gather_counts(comm, indices.numel(), values.device)
    if comm.size == 1 or sum(counts) == 0:
        return indices.reshape(-1).long(), values.reshape(-1).clone(), counts
    bal_idx, bal_val, owned = balance_pairs(comm, indices, values, n, counts)
    all_idx, all_val = allgather_equal(comm, bal_idx, bal_val, owned)
    return all_idx, all_val, counts


def scatter_dense(indices: torch.Tensor, values: torch.Tensor, n: int, accumulate: bool = True
                  ) -> torch.Tensor:
    """A dense tensor of ``n`` zeros with ``values`` added (or written) at ``indices``."""
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    if indices.numel():
        out.index_put_((indices.long(),), values, accumulate=accumulate)
    return out
