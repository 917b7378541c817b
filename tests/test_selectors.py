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
from commlab.compress.threshold import (
    ThresholdEstimator,
    ThresholdOptions,
    ThresholdSelector,
    kth_largest,
    kth_magnitude,
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
    assert "| selector" in capsys.readouterr().out


@pytest.mark.parametrize("guess", [None, 1e-30, 0.05, 0.5, 1.7, 2.5, 40.0, float("inf")])
def test_top_magnitudes_from_a_guess_are_torch_topks(guess):
    """Whatever the guess (far below, near, above the k-th largest, none), the k largest |x|
    are exactly torch.topk's, zeros and NaN included."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50_000, generator=g) * torch.rand(50_000, generator=g) ** 3
    x[::97] = 0.0
    for k in (1, 37, 500, 5_000, 49_000):
        want = torch.topk(x.abs(), k, sorted=True).values
        assert torch.equal(top_magnitudes(x, k, guess), want), (k, guess)
        assert kth_magnitude(x, k, guess) == float(want[-1])
    x[123] = float("nan")
    got = top_magnitudes(x, 100, 1.0)
    assert torch.isnan(got[0]) and torch.equal(got[1:], torch.topk(x.abs(), 100).values[1:])
    assert kth_magnitude(x, x.numel(), 1.0) == 0.0
