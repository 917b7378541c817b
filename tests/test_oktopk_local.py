"""Ok-Topk's local selection under the bounded control (``ThresholdOptions(exact_k=True)``) against its
rule written out with sorted top-k's over the whole tensor.

The rule: the selection is the exact top-k of |x| at every step. The threshold kept between steps
is the aim-th largest |x| (aim = ceil((1 + upper)/2 * k)), set when due, when fewer than k entries
pass it (a recompute from below) and when more than upper * k pass (a recompute from above,
among those passing: the aim-th largest of a top set that holds at least aim entries is the
tensor's); otherwise it is kept as it is. On a GPU (marked ``gpu``, skipped without CUDA) it
selects what it selects on the CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from commlab.compress.threshold import ThresholdEstimator, ThresholdOptions


def rule(x: torch.Tensor, k: int, value: float | None, due: bool, upper: float) -> tuple[torch.Tensor, float, str]:
    """(sorted positions of the top-k, the threshold kept for the next step, what the step did)."""
    ranked = torch.sort(x.abs(), descending=True)
    top = torch.sort(ranked.indices[:k]).values
    aim = min(x.numel() - 1, math.ceil((1 + upper) / 2 * k))
    at_aim = float(ranked.values[aim - 1])
    if due:
        return top, at_aim, "due"
    passing = int(((x.abs() >= value) & (x != 0)).sum())
    if passing < k:
        return top, at_aim, "low"
    if passing > upper * k:
        return top, at_aim, "high"
    return top, value, "kept"


def test_exact_k_selects_the_top_k_of_every_step_with_the_rule_s_thresholds():
    o = ThresholdOptions(recompute_every=7, guard_loops=0, exact_k=True)
    est = ThresholdEstimator(o)
    g = torch.Generator().manual_seed(11)
    base = torch.randn(30_000, generator=g, dtype=torch.float64) * torch.rand(30_000, generator=g,
                                                                             dtype=torch.float64) ** 2
    k, value, kinds, exact, recomputes = 300, None, [], 0, 0
    for step, scale in enumerate([1.0, 1.05, 0.97, 0.8, 1.0, 1.02, 1.6, 2.5, 2.4, 1.0, 0.9, 1.3, 1.25, 0.6]):
        x = base * scale + 0.02 * torch.randn(30_000, generator=g, dtype=torch.float64) * base.abs().mean()
        due = step % o.recompute_every == 0
        top, value, kind = rule(x, k, value, due, o.upper)
        idx, vals = est.select_pairs(x, k, step)
        kinds.append(kind)
        exact += kind in ("due", "low")
        recomputes += kind in ("low", "high")
        assert torch.equal(idx, top) and torch.equal(vals, x[top]), step
        assert est.value == value, (step, kind)
        assert est.exact_computations == exact and est.recomputes == recomputes, step
    assert set(kinds) == {"due", "low", "high", "kept"}, kinds   # every branch ran


def test_exact_k_takes_every_non_zero_entry_when_fewer_than_k_are_non_zero():
    est = ThresholdEstimator(ThresholdOptions(guard_loops=0, exact_k=True))
    x = torch.zeros(1000, dtype=torch.float64)
    x[[3, 70, 500]] = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    for step in range(3):
        idx, vals = est.select_pairs(x, 10, step)
        assert idx.tolist() == [3, 70, 500] and vals.tolist() == [1.0, -2.0, 0.5]
    assert est.value == 0.0 and est.recomputes == 0   # threshold 0 passes every non-zero: no recompute
    idx, _ = est.select_pairs(torch.ones(5, dtype=torch.float64), 10, 3)   # k beyond the tensor
    assert idx.tolist() == [0, 1, 2, 3, 4]


def test_exact_k_replaces_the_guard():
    with pytest.raises(ValueError, match="exact_k replaces the guard"):
        ThresholdOptions(exact_k=True).validate()   # the guard is on by default


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")
def test_exact_k_selects_on_cuda_what_it_selects_on_the_cpu():
    """Step by step on a drifting float32 stream: the same entries, thresholds and counters (the
    selection kernels' pass, the trims, the recomputes from below and above)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300_000, generator=g) * torch.exp(torch.randn(300_000, generator=g))
    o = ThresholdOptions(recompute_every=5, guard_loops=0, exact_k=True)
    on_cpu, on_gpu, k = ThresholdEstimator(o), ThresholdEstimator(o), 3_000
    for step in range(12):
        idx, vals = on_cpu.select_pairs(x, k, step)
        got_idx, got_vals = on_gpu.select_pairs(x.cuda(), k, step)
        assert torch.equal(got_idx.cpu(), idx) and torch.equal(got_vals.cpu(), vals), step
        assert on_gpu.value == on_cpu.value, step
        x = 0.9 * x + 1.15 ** step * torch.randn(x.shape, generator=g)
    assert (on_gpu.exact_computations, on_gpu.recomputes) == (on_cpu.exact_computations, on_cpu.recomputes)
    assert on_cpu.recomputes >= 2
