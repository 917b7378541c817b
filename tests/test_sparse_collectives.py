"""Sparse collectives (core/sparse.py) on 2, 3, 4 and 8 gloo ranks against dense references.

One world of 8 processes runs every check on gloo groups of its first 2, 3 and 4 ranks and on the
whole world (spawning a world costs far more than the checks); the 2^24 test is a world of 2.
Every rank draws every rank's random sparse contribution from the same seeds, so each rank can
compute the reference itself; values are integers stored as float64, so sums are exact whatever
the order and results are compared with torch.equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commlab.core.communicator import Communicator
from commlab.core.sparse import (
    allgather_balanced,
    allgatherv_pairs,
    balanced_boundaries,
    equal_boundaries,
    reduce_pairs,
    split_and_reduce,
)
from commlab.testing import run_distributed


def contribution(seed: int, rank: int, n: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s pairs: ``rows`` distinct random indices (unsorted), integer values."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    idx = torch.randperm(n, generator=g)[:rows]
    val = torch.randint(-50, 51, (rows,), generator=g).to(torch.float64)
    return idx, val


def dense_sum(pairs: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float64)
    for idx, val in pairs:
        out.index_add_(0, idx, val)
    return out


def counters(comm: Communicator) -> tuple[int, int]:
    c = comm.stats.counters
    return c["elements_sent"], c["bytes_sent"]


WORLDS = (2, 3, 4, 8)


def communicators(world: int) -> dict[int, Communicator]:
    """A Communicator over the first s ranks for every s in WORLDS (new_group is collective)."""
    out = {}
    for size in WORLDS:
        group = None if size == world else dist.new_group(list(range(size)))
        if dist.get_rank() < size:
            out[size] = Communicator(group, scope="global" if group is None else "local")
    return out


def body(rank: int, world: int) -> dict:
    return {size: checks_on(comm) for size, comm in communicators(world).items()}


def checks_on(comm: Communicator) -> dict:
    rank, world = comm.rank, comm.size
    n = 1000 + 7 * world
    checks: dict[str, bool] = {}
    for case, rows_of in (("uneven", lambda r: 3 * r), ("empty", lambda r: 0),
                          ("dense", lambda r: n // 2 + r)):
        pairs = [contribution(world, r, n, rows_of(r)) for r in range(world)]
        idx, val = pairs[rank]

        # allgatherv: every rank's pairs, in rank order, exactly; byte accounting exact.
        e0, b0 = counters(comm)
        g_idx, g_val, counts = allgatherv_pairs(comm, idx, val, n)
        e1, b1 = counters(comm)
        checks[f"{case}_allgatherv"] = (torch.equal(g_idx, torch.cat([p[0] for p in pairs]))
                                        and torch.equal(g_val, torch.cat([p[1] for p in pairs]))
                                        and counts == [rows_of(r) for r in range(world)])
        # one count per rank, then the largest contribution's packed pairs from every rank: 2
        # elements per pair, in int64 words (float64 values), the padding of the smaller ones counted
        widest = max(rows_of(r) for r in range(world))
        checks[f"{case}_allgatherv_bytes"] = (
            e1 - e0 == (world - 1) * (1 + 2 * widest)
            and b1 - b0 == (world - 1) * (8 + widest * 16))
        bal_idx, bal_val, _ = allgather_balanced(comm, idx, val, n)
        checks[f"{case}_balanced"] = torch.equal(bal_idx, g_idx) and torch.equal(bal_val, g_val)

        # split-and-reduce: region of the dense sum, restricted to the union of selected indices.
        total = dense_sum(pairs, n)
        union = torch.zeros(n, dtype=torch.bool)
        for p_idx, _ in pairs:
            union[p_idx] = True
        cuts = sorted(torch.randint(0, n + 1, (world - 1,), generator=torch.Generator().manual_seed(world)).tolist())
        for name, bounds in (("equal", equal_boundaries(n, world)), ("random", [0, *cuts, n]),
                             ("balanced", balanced_boundaries(comm, torch.sort(idx).values, n))):
            lo, hi = bounds[rank], bounds[rank + 1]
            want = torch.nonzero(union[lo:hi]).view(-1) + lo
            for schedule in ("alltoall", "rounds"):
                e0, b0 = counters(comm)
                r_idx, r_val = split_and_reduce(comm, idx, val, bounds, schedule=schedule)
                e1, b1 = counters(comm)
                ok = torch.equal(r_idx, want) and torch.equal(r_val, total[want])
                checks[f"{case}_{name}_{schedule}_split_reduce"] = ok
                away = int(((idx < lo) | (idx >= hi)).sum())
                # counts, then the pairs for other regions: packed in int64 words (16 bytes a pair)
                # by the all_to_all, an int32 index and a float64 value (12 bytes) by the rounds
                pair_bytes = 16 if schedule == "alltoall" else 12
                checks[f"{case}_{name}_{schedule}_split_bytes"] = (
                    e1 - e0 == (world - 1) + 2 * away and b1 - b0 == 8 * (world - 1) + pair_bytes * away)
            s_idx, order = torch.sort(idx)
            r_idx, r_val = split_and_reduce(comm, s_idx, val[order], bounds, sorted_indices=True)
            checks[f"{case}_{name}_sorted_split_reduce"] = torch.equal(r_idx, want) and torch.equal(r_val, total[want])
        checks[f"{case}_boundaries_monotone"] = bounds[0] == 0 and bounds[-1] == n and all(
            a <= b for a, b in zip(bounds, bounds[1:], strict=False))
    return {"checks": checks, "bounds": bounds}


def test_sparse_collectives_match_dense_references():
    results = run_distributed(body, max(WORLDS))
    for size in WORLDS:
        on_size = [res[size] for res in results[:size]]
        for rank, res in enumerate(on_size):
            failed = [name for name, ok in res["checks"].items() if not ok]
            assert not failed, f"{size} ranks, rank {rank}: {failed}"
        # Balanced boundaries are the same on every rank.
        assert all(res["bounds"] == on_size[0]["bounds"] for res in on_size)
        assert len(on_size[0]["checks"]) == 3 * (3 + 3 * 5 + 1)


BIG = 2**24 + 2**20 + 5  # more elements than float32 represents exactly as integers


def big_body(rank: int, world: int) -> dict:
    """A dense tensor of BIG elements; selected entries above 2^24 must keep their exact index."""
    comm = Communicator()
    acc = torch.zeros(BIG, dtype=torch.float32)
    high = torch.tensor([2**24 + 1, 2**24 + 3 + 2 * rank, BIG - 1, BIG - 2 - rank], dtype=torch.int64)
    low = torch.tensor([5 + rank, 2**20 + 1], dtype=torch.int64)
    idx = torch.cat([low, high])
    acc[idx] = torch.arange(1, idx.numel() + 1, dtype=torch.float32) * (rank + 1)
    selected = torch.nonzero(acc).view(-1)
    g_idx, g_val, _ = allgatherv_pairs(comm, selected, acc[selected], BIG)
    r_idx, r_val = split_and_reduce(comm, selected, acc[selected], equal_boundaries(BIG, world),
                                    sorted_indices=True)
    return {"selected": selected, "values": acc[selected], "g_idx": g_idx, "g_val": g_val,
            "r_idx": r_idx, "r_val": r_val}


def test_indices_above_2_pow_24_survive():
    results = run_distributed(big_body, 2)
    every_idx = torch.cat([r["selected"] for r in results])
    every_val = torch.cat([r["values"] for r in results])
    assert int(every_idx.max()) > 2**24
    total = torch.zeros(BIG, dtype=torch.float64)
    total.index_add_(0, every_idx, every_val.double())
    for res in results:
        assert torch.equal(res["g_idx"], every_idx)
        assert torch.equal(res["g_val"], every_val)
    reduced_idx = torch.cat([r["r_idx"] for r in results])
    reduced_val = torch.cat([r["r_val"] for r in results])
    assert torch.equal(reduced_idx, torch.unique(every_idx))
    assert torch.equal(reduced_val.double(), total[reduced_idx])
    assert (reduced_idx % 2 == 1).any() and int(reduced_idx.max()) == BIG - 1


def _gathered_pairs(ranks: int, k: int, n: int, seed: int, dtype=torch.float32):
    """What an allgatherv hands every rank: each rank's k distinct indices, many shared by 3 or more
    ranks (drawn from a small pool), with heavy-tailed values, concatenated in rank order."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.unique(torch.randint(0, n, (4 * k,), generator=g))[: 2 * k]
    pool = pool[torch.randperm(pool.numel(), generator=g)]
    idx = torch.cat([pool[torch.randperm(2 * k, generator=g)[:k]] for _ in range(ranks)])
    val = (torch.randn(ranks * k, generator=g) * torch.exp(3 * torch.randn(ranks * k, generator=g))).to(dtype)
    return idx, val


@pytest.mark.parametrize("n,dtype", [(10_000, torch.float32), (3 * 2**31, torch.float32), (10_000, torch.float64)])
def test_reduce_pairs_does_not_depend_on_the_order_pairs_arrive_in(n, dtype):
    """Replicas that reduce the same gathered pairs must agree bit for bit whatever order the pairs
    reach them in: the guarantee CUDA's atomic index_add_ lacks."""
    idx, val = _gathered_pairs(ranks=8, k=500, n=n, seed=1, dtype=dtype)
    shared = torch.unique(idx, return_counts=True)[1]
    assert int((shared >= 3).sum()) > 100  # the case that matters: 3+ ranks chose the index
    u, s = reduce_pairs(idx, val, n)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        perm = torch.randperm(idx.numel(), generator=g)
        u2, s2 = reduce_pairs(idx[perm], val[perm], n)
        assert torch.equal(u, u2) and torch.equal(s, s2)  # bitwise
        u3, s3 = reduce_pairs(idx[perm], val[perm])  # without the bound on the indices: two sorts, same sums
        assert torch.equal(u, u3) and torch.equal(s, s3)
    if n < 2**20:  # the sums themselves, against float64 ones
        reference = torch.zeros(n, dtype=torch.float64).index_add_(0, idx, val.double())
        assert torch.equal(u, torch.unique(idx))
        torch.testing.assert_close(s.double(), reference[u], rtol=1e-6 if dtype == torch.float32 else 1e-12,
                                   atol=1e-6 * float(val.abs().max()))


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor operations that read a result on the host (a device sync on CUDA)."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.cpu, torch.Tensor.nonzero, torch.nonzero, torch.unique,
             torch.unique_consecutive, torch.Tensor.unique, torch.Tensor.unique_consecutive}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def _host_reads_of_split_and_reduce(rank, world):
    out = {}
    for size, comm in communicators(world).items():
        n = 500
        idx, val = contribution(size, comm.rank, n, 40)
        for schedule in ("alltoall", "rounds"):
            with HostReads() as reads:
                split_and_reduce(comm, idx, val, equal_boundaries(n, size), schedule=schedule)
            out[(size, schedule)] = reads.count
    return out


def test_rounds_schedule_reads_the_host_as_often_as_one_all_to_all_on_any_world():
    results = run_distributed(_host_reads_of_split_and_reduce, max(WORLDS))
    counts = {key: value for res in results for key, value in res.items()}
    assert counts[(2, "alltoall")] > 0  # the counter sees the count exchange
    assert len(set(counts.values())) == 1, counts  # no host read per round: the same on 2 ... 8 ranks
