"""Selectors (compress/): threshold estimation and Gaussian-k against exact top-k and their
closed-form rules, every registered selector against the contract, and the residual memory."""

from __future__ import annotations

import json
import math

import pytest
import torch

from commlab.compress.base import k_for_density
from commlab.compress.gaussiank import GaussianOptions, gaussian_select, gaussian_threshold
from commlab.compress.residual import ResidualMemory
from commlab.compress.scan import Scratch
from commlab.compress.threshold import (
    ThresholdEstimator,
    ThresholdOptions,
    ThresholdSelector,
    kth_largest,
    kth_magnitude,
    largest_by_partition,
    largest_by_sort,
    select_top,
    top_candidates,
    top_magnitudes,
)
from commlab.registry import BENCHMARKS, SELECTORS


def sample(n: int = 20000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", SELECTORS.names())
def test_every_registered_selector_keeps_the_contract(name):
    x = sample()
    k = 200
    idx = SELECTORS.get(name)()(x, k)
    assert idx.dtype == torch.int64 and idx.dim() == 1
    assert idx.numel() == torch.unique(idx).numel()
    assert 0 < idx.numel() < x.numel() and int(idx.min()) >= 0 and int(idx.max()) < x.numel()


def test_first_threshold_call_is_exact_topk():
    x = sample()
    k = 137
    idx = ThresholdSelector()(x, k)
    assert torch.equal(idx, torch.sort(torch.topk(x.abs(), k).indices).values)


def test_threshold_reuse_nudges_and_recomputes():
    opts = ThresholdOptions(recompute_every=4, guard_loops=0)
    sel = ThresholdSelector(opts)
    x = sample()
    k = 200
    sel(x, k)
    exact = kth_largest(x.abs(), k)
    assert sel.threshold == pytest.approx(exact)
    # Twice the magnitudes: the reused threshold selects far more than 5k/4 -> raised by 1.012.
    idx = sel(2 * x, k)
    assert torch.equal(idx, torch.nonzero((2 * x).abs() >= exact).view(-1))
    assert sel.threshold == pytest.approx(exact * 1.012)
    # Half the magnitudes: too few -> lowered by 1.012.
    sel(0.5 * x, k)
    assert sel.threshold == pytest.approx(exact)
    sel(x, k)
    # Fifth call (index 4) recomputes exactly.
    sel(3 * x, k)
    assert sel.threshold == pytest.approx(kth_largest((3 * x).abs(), k))
    assert sel.estimator.exact_computations == 2


def test_guard_raises_a_reused_threshold_while_too_many_pass():
    est = ThresholdEstimator(ThresholdOptions(guard_factor=1.5, guard_scale=1.03, guard_loops=5))
    x = sample().abs()
    k = 100
    est.set_exact(kth_largest(x, k))
    start = est.value
    larger = x * 4                                 # every entry 4x larger: the guard runs out of loops
    idx, vals = est.select_pairs(larger, k, step=1)
    raised = start * 1.03**5
    assert torch.equal(idx, torch.nonzero(larger >= raised).view(-1)) and torch.equal(vals, larger[idx])
    assert est.value == pytest.approx(raised * 1.012)  # then nudged up: still more than 1.25k pass
    est.set_exact(start)
    idx, _ = est.select_pairs(x, k, step=1)          # k pass: no raise, no nudge
    assert idx.numel() == k and est.value == start


@pytest.mark.parametrize("n", [1, 2, 7, 1_000, 30_000])
def test_order_statistics_by_partition_and_by_sort_are_torch_topks(n):
    """The CPU's way to the r-th largest (numpy's partition) and the GPU's (one sort) give
    torch.topk's sorted values bit for bit, with ties, zeros, infinities and NaN (the largest),
    on values in the order an unsorted torch.topk leaves them (kthvalue's worst case)."""
    g = torch.Generator().manual_seed(n)
    x = torch.topk(torch.round(torch.randn(3 * n, generator=g) * 8).abs() / 8, n, sorted=False).values
    for special in ([], [math.inf], [math.nan], [math.nan, math.inf, 0.0, math.nan]):
        y, m = x.clone(), min(n, len(special))
        y[:m] = torch.tensor(special[:m])
        ranks = sorted({1, (n + 1) // 2, n, min(n, 3), math.ceil(7 * n / 8)})
        want = torch.topk(y, n, sorted=True).values[[r - 1 for r in ranks]]
        for got in (largest_by_partition(y, ranks), largest_by_sort(y, ranks)):
            assert torch.equal(bits(got), want.view(torch.int32)), (n, special, ranks)
    assert torch.equal(bits(largest_by_partition(y.bfloat16(), [1, n])), bits(largest_by_sort(y.bfloat16(), [1, n])))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_order_statistics_keep_the_values_dtype(dtype):
    """float64 values float32 cannot hold, and float16, come back exactly as torch.topk's (a
    float64 threshold rounded to float32 would select a different set)."""
    g = torch.Generator().manual_seed(5)
    x = torch.topk(torch.randn(3_000, generator=g, dtype=torch.float64).abs(), 1_000, sorted=False).values.to(dtype)
    ranks = [1, 125, 875, 1_000]
    want = torch.topk(x, 1_000, sorted=True).values[[r - 1 for r in ranks]].tolist()
    assert dtype != torch.float64 or want != torch.tensor(want).float().double().tolist()
    assert largest_by_partition(x, ranks) == want and largest_by_sort(x, ranks) == want


def bits(values: list[float]) -> torch.Tensor:
    """float32 bit patterns: equal where the values are, NaN included."""
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


def test_density_one_selects_every_nonzero():
    x = sample(1000)
    x[::7] = 0
    assert kth_largest(x.abs(), x.numel()) == 0.0
    idx = ThresholdSelector()(x, x.numel())
    assert torch.equal(idx, torch.nonzero(x).view(-1))


def test_gaussian_threshold_formula_and_count():
    x = sample(200000)
    k = k_for_density(x.numel(), 0.01)
    rho = k / x.numel()
    z = math.sqrt(2) * torch.erfinv(torch.tensor(1 - rho, dtype=torch.float64)).item()
    std, mean = torch.std_mean(x)
    assert gaussian_threshold(x, k) == pytest.approx(float(mean) + z * float(std), rel=1e-6)
    idx, thr = gaussian_select(x, k)
    assert torch.equal(idx, torch.nonzero(x.abs() > thr).view(-1))
    assert 0.75 * k <= idx.numel() <= 1.25 * k  # normal data: the fit is right


def test_gaussian_lowers_the_threshold_until_three_quarters_of_k_pass():
    x = sample(100000)
    x = x * (x.abs() < 2)            # no tail: the normal fit's threshold selects too few
    k = k_for_density(x.numel(), 0.02)
    idx, thr = gaussian_select(x, k, GaussianOptions(lower=0.75, down=1.012, max_loops=50))
    start = gaussian_threshold(x, k)
    loops = round(math.log(start / thr) / math.log(1.012))
    assert thr == pytest.approx(start / 1.012**loops)
    assert idx.numel() >= 0.75 * k
    assert int((x.abs() > thr * 1.012).sum()) < 0.75 * k   # one loop fewer would not have been enough


def test_residual_memory_keeps_what_was_not_applied():
    mem = ResidualMemory(6, torch.float64, "cpu")
    g1 = torch.tensor([1.0, -2.0, 3.0, 0.5, 0.0, 4.0], dtype=torch.float64)
    acc = mem.accumulate(g1)
    mem.keep(acc, torch.tensor([2, 5]))
    assert torch.equal(mem.residual, torch.tensor([1.0, -2.0, 0.0, 0.5, 0.0, 0.0], dtype=torch.float64))
    acc = mem.accumulate(g1)
    assert torch.equal(acc, g1 + mem.residual)
    mem.keep(acc, None)
    assert float(mem.residual.abs().sum()) == 0.0
    off = ResidualMemory(3, torch.float32, "cpu", enabled=False)
    acc = off.accumulate(torch.ones(3))
    off.keep(acc, torch.tensor([0]))
    assert float(off.residual.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="elements"):
        mem.accumulate(torch.ones(5))


def test_selection_benchmark_reports_every_selector(tmp_path, capsys):
    out = tmp_path / "sel.json"
    assert BENCHMARKS.get("selection")(["--sizes", "20000", "--calls", "3", "--devices", "cpu"], str(out)) == 0
    records = json.loads(out.read_text())["results"]
    names = {r["selector"] for r in records}
    assert set(SELECTORS.names()) <= names
    for r in records:
        assert r["ratio_topk"] > 0 and r["ratio_read"] > 0
        assert r["selector"] == "read (x.sum)" or r["selected"] > 0
    [ranked] = json.loads(out.read_text())["order_statistics"]
    assert ranked["k"] == 200 and min(ranked[f"{way}_s"] for way in ("kthvalue", "partition", "sort")) > 0
    assert (ranked["passing"], ranked["rank"]) == (251, 225)  # Ok-Topk's re-aim: > 5k/4 passing, the 9k/8-th
    printed = capsys.readouterr().out
    assert "| selector" in printed and "| partition ms" in printed


def test_selection_benchmark_leaves_the_cpus_kthvalue_out_above_its_limit(monkeypatch):
    from commlab.bench import selection as bench

    monkeypatch.setattr(bench, "MAX_CPU_KTHVALUE", 100)
    x = torch.randn(1_000, generator=torch.Generator().manual_seed(0))
    below, above = bench.order_statistics(x, 100, 2), bench.order_statistics(x, 101, 2)
    assert below["kthvalue_s"] > 0 and "kthvalue_s" not in above
    assert min(above["partition_s"], above["sort_s"]) > 0


def test_selection_benchmark_calls_every_entry_once_a_round_behind_changing_neighbours(monkeypatch):
    """What ran just before a call changes its time, so no entry may always follow the same one
    (a rotated order did); the order is seeded, so a run can be repeated."""
    from commlab.bench import selection

    def orders(seed):
        calls = []

        def timed(fn, device, clock=None):
            calls.append(fn)
            return 1e-3, fn()

        monkeypatch.setattr(selection, "_timed", timed)
        stream = selection.TensorStream(4096, torch.device("cpu"), seed=0)
        rows = selection.measure(stream, 40, calls=6, budget=60.0, min_seconds=0.0, seed=seed)
        entries = len(rows)
        assert len(calls) == 6 * entries
        rounds = [calls[r * entries:(r + 1) * entries] for r in range(6)]
        assert all(len(set(map(id, r))) == entries for r in rounds)  # each entry once a round
        first = [id(f) for f in rounds[0]]
        return [[first.index(id(f)) for f in r] for r in rounds]  # each round as places in the first

    rounds = orders(seed=3)
    before = {}
    for r in rounds:
        for prev, this in zip(r[:-1], r[1:], strict=True):
            before.setdefault(this, set()).add(prev)
    assert sum(len(p) > 1 for p in before.values()) >= len(before) // 2
    assert orders(seed=3) == rounds and orders(seed=4) != rounds


@pytest.mark.parametrize("guess", [None, 1e-30, 0.05, 0.5, 1.7, 2.5, 40.0, float("inf")])
def test_top_magnitudes_from_a_guess_are_torch_topks(guess):
    """Whatever the guess (far below, near, above the k-th largest, none), the r-th largest |x|
    are exactly those of torch.topk's sorted values, zeros and NaN included."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50_000, generator=g) * torch.rand(50_000, generator=g) ** 3
    x[::97] = 0.0
    for k in (1, 37, 500, 5_000, 49_000):
        want = torch.topk(x.abs(), k, sorted=True).values
        ranks = sorted({1, (k + 1) // 2, math.ceil(7 * k / 8), k})
        assert top_magnitudes(x, k, ranks, guess) == [float(want[r - 1]) for r in ranks], (k, guess)
        assert kth_magnitude(x, k, guess) == float(want[-1])
    x[123] = float("nan")
    got = top_magnitudes(x, 100, [1, 2, 100], 1.0)
    want = torch.topk(x.abs(), 100).values
    assert math.isnan(got[0]) and got[1:] == [float(want[1]), float(want[99])]
    assert kth_magnitude(x, x.numel(), 1.0) == 0.0


@pytest.mark.parametrize("guess", [None, 0.05, 0.5, 2.5, 40.0])
def test_select_top_keeps_among_candidates_what_a_selection_at_the_kth_largest_selects(guess):
    """select_top's pairs are exactly those of a selection over the whole tensor at the k-th
    largest |x| (ties at it included: values on a coarse grid), in ascending positions, and its
    ranked magnitudes are torch.topk's; the candidates it keeps them among hold them all."""
    g = torch.Generator().manual_seed(11)
    x = torch.round(torch.randn(40_000, generator=g) * torch.rand(40_000, generator=g) ** 3 * 64) / 64
    for k in (1, 300, 2_000, 39_000):
        want = torch.topk(x.abs(), k, sorted=True).values
        scratch = Scratch()
        idx, vals, ranked = select_top(x, k, guess, also=(math.ceil(7 * k / 8),), scratch=scratch)
        assert ranked == [float(want[math.ceil(7 * k / 8) - 1]), float(want[-1])]
        ref = torch.nonzero((x.abs() >= want[-1]) & (x != 0)).view(-1)
        assert torch.equal(idx, ref) and torch.equal(vals, x[ref]), (k, guess)
        assert idx.numel() >= k or float(want[-1]) == 0.0
        assert scratch.selected in (None, idx.numel())
        candidates = top_candidates(x, k, guess)
        if candidates is not None:
            assert set(ref.tolist()) <= set(candidates[0].tolist())
