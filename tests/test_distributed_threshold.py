"""Ok-Topk's count-bounded global threshold (compress/bounded.py) on 1, 3 and 4 gloo ranks
against brute force: the band when it is reachable, the cap when ties make it unreachable, the
same threshold on every rank, at most 4 histogram rounds for float32 with 256 bins, and no more
elements sent than :func:`probe_cost_bound` says."""

from __future__ import annotations

import pytest
import torch

from commlab.compress.bounded import (
    Spread,
    Window,
    distributed_threshold,
    local_spread,
    max_rounds,
    probe_cost_bound,
    search_rounds,
)
from commlab.compress.floatbits import from_bits
from commlab.core import Communicator
from commlab.testing import run_distributed


def heavy(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(2 * torch.randn(n, generator=g,
                                                                                          dtype=torch.float64))).to(dtype)


def ties(n: int) -> torch.Tensor:
    x = torch.zeros(n)
    x[: n // 10] = 2.0
    x[n // 10: 3 * n // 10] = -1.0
    return x


CASES = {  # values, [(k_max, k_min), ...]
    "heavy32": (heavy(40_000, 0), [(1000, 1000), (1000, 700), (1, 1), (39_000, 38_000), (40_000, 0), (5, 3)]),
    "heavy64": (heavy(20_000, 1, torch.float64), [(500, 500), (900, 800)]),
    "ties": (ties(1000), [(150, 150), (100, 100), (350, 250), (50, 50), (300, 300)]),
    "zeros": (torch.zeros(100), [(10, 10)]),
}


def body(rank: int, world: int) -> dict:
    comm = Communicator()
    out = {}
    for name, (values, cases) in CASES.items():
        mine = values[rank::world]
        for k_max, k_min in cases:
            c0, s0 = comm.stats.counters["collectives_global"], comm.stats.counters["elements_sent"]
            t = distributed_threshold(comm, mine, k_max, k_min)
            calls = [c.op for c in comm.stats.drain()]
            out[(name, k_max, k_min)] = {
                "t": t, "rounds": calls.count("sparse_threshold_histogram"),
                "collectives": comm.stats.counters["collectives_global"] - c0,
                "sent": comm.stats.counters["elements_sent"] - s0}
    return out


@pytest.fixture(scope="module", params=[1, 3, 4])
def results(request):
    return request.param, run_distributed(body, request.param, timeout_s=120)


def test_every_rank_gets_a_threshold_in_the_band_or_the_largest_set_under_the_cap(results):
    world, per_rank = results
    for name, (values, cases) in CASES.items():
        a = values.abs()
        for k_max, k_min in cases:
            got = {r[(name, k_max, k_min)]["t"] for r in per_rank}
            assert len(got) == 1, (name, k_max, got)          # the same on every rank
            t = got.pop()
            count = int(((a >= t) & (values != 0)).sum()) if t > 0 else int((values != 0).sum())
            if k_min <= count <= k_max:
                continue
            if t == 0:  # fewer non-zero entries than k_min: all of them
                assert count == int((values != 0).sum()) <= k_max
                continue
            # unreachable band: the smallest threshold keeping at most k_max, so one step lower
            # (the largest value kept out) would keep more than k_max
            assert count <= k_max, (name, k_max, count)
            below = a[(a < t) & (values != 0)]
            assert below.numel() and int((a >= below.max()).sum()) > k_max
            reachable = any(k_min <= int((a >= v).sum()) <= k_max for v in a[values != 0].unique())
            assert not reachable, (name, k_max, k_min, t, count)


def test_exact_top_k_where_no_ties_and_float32_needs_at_most_4_rounds(results):
    world, per_rank = results
    values = CASES["heavy32"][0]
    exact = torch.sort(values.abs(), descending=True).values
    for k in (1000, 1):
        rec = per_rank[0][("heavy32", k, k)]
        assert exact[k] < rec["t"] <= exact[k - 1]       # exactly the top-k
        if world > 1:                                    # alone, a round is no collective
            assert 1 <= rec["rounds"] <= 4 == max_rounds(torch.float32, 256)
    for rec in per_rank[0].values():
        if world > 1:                                    # the spread's allgather, then the rounds
            assert rec["collectives"] == rec["rounds"] + 1


def test_elements_sent_stay_within_the_bound(results):
    world, per_rank = results
    for name, (values, _) in CASES.items():
        bound = probe_cost_bound(values.dtype, world)
        for rank in per_rank:
            for (case, *_), rec in rank.items():
                if case == name:
                    assert rec["sent"] <= bound, (name, rec)


def test_round_bounds():
    assert search_rounds(2**31, 256) == 4 and search_rounds(256, 256) == 1 and search_rounds(257, 256) == 2
    assert max_rounds(torch.float64, 256) == 8
    spread = Spread(nonzero=10, hi=2**20 + 5, lo=6)
    assert probe_cost_bound(torch.float32, 4, 256, spread) == 3 * 384  # 3 rounds of 2*256*3/4
    assert probe_cost_bound(torch.float32, 1) == 0


def test_a_window_histogram_counts_every_edge_and_starts_a_search_where_the_count_crosses():
    values = heavy(20_000, 5)
    a = values.abs()
    t = float(torch.sort(a, descending=True).values[1000])
    window = Window.around(t, values.dtype, 16)
    at = window.at_edges(window.local_counts(values).tolist())
    assert at == [int((a >= from_bits(e, values.dtype)).sum()) for e in window.edges]
    spread = Spread.combine([local_spread(values).tolist()])
    for k_max in (200, 1000, 1500, 19_000):
        lo, hi, above = window.start(at, k_max, spread)
        assert lo <= hi and above == int((a >= from_bits(hi + 1, values.dtype)).sum()) <= k_max
        assert int((a >= from_bits(lo, values.dtype)).sum()) > k_max       # the count crosses k_max inside
