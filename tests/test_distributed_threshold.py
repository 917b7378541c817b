"""Ok-Topk's count-bounded global threshold (compress/bounded.py) on 1, 3 and 4 gloo ranks
against brute force: the band when it is reachable, the cap when ties make it unreachable, the
same threshold on every rank, at most 4 histogram rounds for float32 with 256 bins, no more
elements sent than :func:`probe_cost_bound` says, and a search with an element budget that stops
within it, under the cap."""

from __future__ import annotations

import pytest
import torch

from commlab.compress.bounded import (
    Spread,
    Window,
    bins_within,
    distributed_threshold,
    local_spread,
    max_rounds,
    probe_cost_bound,
    round_cost,
    search_rounds,
    threshold_search,
)
from commlab.compress.floatbits import from_bits, to_bits
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


def budget_body(rank: int, world: int) -> dict:
    """Exact top-1000 of float64 values: without a budget, with one paying two rounds, with one
    paying as many rounds as the unbudgeted search took, with a limit of two rounds, and with a
    budget paying less than a round (each budget also pays the spread's allgather, 3 elements to
    each other rank)."""
    comm, values = Communicator(), heavy(40_000, 2, torch.float64)
    mine, spread, per_round = values[rank::world], 3 * (world - 1), round_cost(8, world)
    out = {"free": threshold_search(comm, mine, 1000, bins=8)}
    for name, rounds in (("short", 2), ("enough", out["free"].rounds)):
        s0, budget = comm.stats.counters["elements_sent"], spread + rounds * per_round
        out[name] = threshold_search(comm, mine, 1000, bins=8, budget=budget)
        out[f"{name}_sent"], out[f"{name}_budget"] = comm.stats.counters["elements_sent"] - s0, budget
    out["limited"] = threshold_search(comm, mine, 1000, bins=8, round_limit=2)
    try:
        threshold_search(comm, mine, 1000, bins=8, budget=spread + per_round - 1)
    except ValueError as error:
        out["refused"] = str(error)
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_a_budget_stops_the_search_within_it_and_under_the_cap(world):
    per_rank = run_distributed(budget_body, world, timeout_s=120)
    values = heavy(40_000, 2, torch.float64).abs()

    def count(t: float) -> int:
        return int((values >= t).sum())

    free, short, enough = (per_rank[0][name] for name in ("free", "short", "enough"))
    assert not free.cut and count(free.threshold) == 1000 and free.rounds > 2
    assert short.cut and short.rounds == 2 and count(short.threshold) < 1000  # short of the band, under the cap
    assert short.threshold > free.threshold
    assert not enough.cut and enough.threshold == free.threshold and enough.rounds == free.rounds
    assert per_rank[0]["limited"] == short                                   # two rounds, by a round limit
    for rank in per_rank:
        assert rank["short"] == short and rank["enough"] == enough             # every rank alike
        assert rank["short_sent"] <= rank["short_budget"] and rank["enough_sent"] <= rank["enough_budget"]
        assert "cannot pay one round" in rank["refused"]


def test_bins_fit_the_worst_case_or_split_finest_within_the_budget():
    """Magnitudes from 2 to 64 (5 octaves): 2^25.3 float32 patterns, 2^54.3 float64 ones."""
    spread32, spread64 = (Spread(nonzero=10_000, hi=to_bits(64.0, dtype), lo=to_bits(2.0, dtype))
                          for dtype in (torch.float32, torch.float64))
    assert bins_within(10**6, torch.float64, 4, spread64) == 256                 # 7 rounds: the worst case fits
    # float32 at P = 16: 256 bins take 4 rounds of 480, 128 bins 4 of 240, 64 bins 5 of 120
    assert bins_within(1000, torch.float32, 16, spread32) == 128
    assert bins_within(900, torch.float32, 16, spread32) == 64
    # 110 elements at P = 16, float64 (no worst case fits): 8 bins (16 a round) split 3 bits in
    # each of 6 rounds, 4 bins 2 in each of 8, 16 bins 4 in each of 3
    assert round_cost(4, 16) == 8 and round_cost(8, 16) == 16 and round_cost(16, 16) == 32
    assert bins_within(110, torch.float64, 16, spread64) == 8
    assert bins_within(0, torch.float64, 1, spread64) == 256                     # alone: no cost
