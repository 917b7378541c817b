"""Selection on a GPU (marked ``gpu``: ``make test-gpu``; skipped without CUDA): every registered
selector on CUDA against its CPU result on the same tensor, and Ok-Topk's count-bounded global
threshold (``compress.bounded.distributed_threshold``) on CUDA tensors, alone on NCCL and over
four gloo ranks sharing the GPU, against a brute-force count."""

from __future__ import annotations

import pytest
import torch

from commlab.compress.bounded import distributed_threshold
from commlab.core import Communicator
from commlab.registry import SELECTORS
from commlab.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")]


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    """Gradient-like values: Gaussian bulk times a log-normal scale (a few very large entries)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


@pytest.mark.parametrize("name", SELECTORS.names())
@pytest.mark.parametrize("n,k", [(100_000, 100), (2_000_000, 2_000)])
def test_every_selector_selects_on_cuda_what_it_selects_on_the_cpu(name, n, k):
    x = heavy_tailed(n, seed=n + k)
    on_cpu = SELECTORS.get(name)()(x, k)
    on_gpu = SELECTORS.get(name)()(x.cuda(), k)
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.int64
    on_gpu = on_gpu.cpu()
    if torch.equal(on_cpu, on_gpu):
        return
    # Thresholds computed from reductions (mean, std, max) may differ in their last bits between
    # devices, and a search that bisects between them then stops at another point of the same
    # acceptance band: the sets may differ, but only by a few entries, and each device's set is
    # still everything above its threshold (so the entries that differ lie between the two).
    differ = set(on_cpu.tolist()) ^ set(on_gpu.tolist())
    assert len(differ) <= max(2, k // 1000), (name, len(differ))
    for chosen in (on_cpu, on_gpu):
        assert_threshold_set(x, chosen)


def assert_threshold_set(x: torch.Tensor, chosen: torch.Tensor) -> None:
    """Every chosen entry is at least as large in magnitude as every entry not chosen."""
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    mask[chosen] = True
    assert x.abs()[mask].min() >= x.abs()[~mask].max()


def _threshold_on(rank: int, world: int, values: torch.Tensor, k_max: int, k_min: int):
    mine = values[rank::world].cuda()
    return distributed_threshold(Communicator(), mine, k_max=k_max, k_min=k_min)


@pytest.mark.parametrize("backend,world", [("nccl", 1), ("gloo", 4)])
def test_distributed_threshold_on_cuda_counts_what_brute_force_counts(backend, world):
    values = heavy_tailed(400_000, seed=3)
    k = 4_000
    results = run_distributed(_threshold_on, world, args=(values, k, k), backend=backend, device="cuda",
                              timeout_s=120)
    thresholds = set(results)
    assert len(thresholds) == 1  # every rank got the same threshold
    t = thresholds.pop()
    selected = int((values.abs() >= t).sum())
    assert selected == k  # exact top-k: no ties in continuous data
    exact = torch.topk(values.abs(), k + 1).values
    assert exact[k] < t <= exact[k - 1]


def special_values(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed values with NaN, infinities, signed zeros, a subnormal and entries tied at 1.5."""
    x = heavy_tailed(n, seed)
    x[: min(n, 9)] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -1.5, 1e-45,
                                   1.5])[: min(n, 9)]
    return x


@pytest.fixture
def kernels_at_any_size(monkeypatch):
    """The Triton kernels for selections of any size (by default only from 8M entries up)."""
    from commlab.compress import gpu_kernels

    monkeypatch.setattr(gpu_kernels, "MIN_ELEMENTS", 0)


@pytest.mark.parametrize("n", [0, 1, 33, 2047, 2048, 2049, 1_000_003])
def test_the_triton_kernels_select_and_count_as_torch_passes_do(n, kernels_at_any_size):
    """scan's selection and counts on CUDA float32 (the Triton kernels when Triton is there)
    against torch's passes on the same tensor (``portable_passes``), bit for bit, with room made
    in advance too small, right and too large."""
    from commlab.compress import scan

    x = special_values(n, seed=n).cuda()
    for t in (0.0, 1e-45, 0.5, 1.5, 3.0, 1e30, float("inf")):
        with scan.portable_passes():
            want_idx, want_vals = scan.select_pairs_at_least(x, t)
            want_counts = scan.counts_at_least(x, [t, 2 * t + 1e-30, 0.7])
        for selected in (None, 0, want_idx.numel(), 10 * want_idx.numel()):
            scratch = scan.Scratch()
            scratch.selected = selected
            idx, vals = scan.select_pairs_at_least(x, t, scratch)
            assert torch.equal(idx, want_idx), (n, t, selected)
            assert torch.equal(vals.view(torch.int32), want_vals.view(torch.int32)), (n, t, selected)
            assert scratch.selected == want_idx.numel()
        assert torch.equal(scan.select_at_least(x, t), want_idx)
        assert scan.counts_at_least(x, [t, 2 * t + 1e-30, 0.7]) == want_counts, (n, t)


def test_the_triton_kernels_are_used_on_cuda_float32():
    """With Triton importable (PyTorch's CUDA builds bring it), a CUDA float32 selection of 8M
    entries or more runs its kernels, a smaller one torch's passes (fewer launches), and a count
    its kernel at any size."""
    pytest.importorskip("triton")
    from commlab.compress import gpu_kernels, scan

    large = torch.ones(gpu_kernels.MIN_ELEMENTS, device="cuda")
    assert scan._gpu_kernels(large) is not None
    assert scan._gpu_kernels(large[:-1]) is None
    assert scan._gpu_kernels(large[:4], min_elements=0) is not None
    with scan.portable_passes():
        assert scan._gpu_kernels(large) is None
    assert scan._gpu_kernels(large.bfloat16()) is None


# The estimator's option sets run on CUDA: the default (exact every 32 steps, guarded) and exact
# every 3 steps (so that steps from a guess run: candidates, keeping among them, their ranks).
# Ok-Topk's bounded control (exact k) has its own test in tests/test_oktopk_local.py.
ESTIMATORS = {"guarded": {}, "guarded_tau3": {"recompute_every": 3}}


@pytest.mark.parametrize("min_elements", [0, None, 100_000], ids=["kernels", "default_size", "mixed"])
@pytest.mark.parametrize("options", list(ESTIMATORS))
def test_threshold_estimation_on_a_drifting_stream_selects_on_cuda_what_it_selects_on_the_cpu(
        options, min_elements, monkeypatch):
    """Step by step, the same entries, threshold and counters on CUDA as on the CPU: the exact
    steps, reused thresholds, the nudges, the guard's raises (which on CUDA the selection kernel
    counts as it writes the entries, kept with the count known); with
    the kernels at every size, at their default size (this tensor is below it: torch's passes),
    and mixed (the tensor through the kernels, a guard's or candidates' subset through torch's)."""
    from commlab.compress import gpu_kernels
    from commlab.compress.threshold import ThresholdOptions

    if min_elements is not None:
        monkeypatch.setattr(gpu_kernels, "MIN_ELEMENTS", min_elements)
    g = torch.Generator().manual_seed(5)
    x = heavy_tailed(300_000, seed=5)
    make = SELECTORS.get("threshold_estimation")
    on_cpu, on_gpu = make(ThresholdOptions(**ESTIMATORS[options])), make(ThresholdOptions(**ESTIMATORS[options]))
    k, raises = 3_000, 0
    for step in range(12):
        before = on_cpu.threshold
        chosen = on_cpu(x, k)
        assert torch.equal(on_gpu(x.cuda(), k).cpu(), chosen), step
        assert on_gpu.threshold == on_cpu.threshold, step
        raises += before is not None and on_cpu.threshold > before * 1.012 * 1.0001  # beyond a nudge: the guard
        x = 0.9 * x + 1.15 ** step * torch.randn(x.shape, generator=g)
    cpu, gpu = on_cpu.estimator, on_gpu.estimator
    assert (gpu.exact_computations, gpu.recomputes) == (cpu.exact_computations, cpu.recomputes)
    assert raises >= 2  # the guard's branch ran


def test_a_selection_at_the_kernels_default_size_selects_as_torch_passes_do():
    """From gpu_kernels.MIN_ELEMENTS entries up a selection runs the kernels without any setting
    (over a thousand blocks): pairs and a guard's choice as torch's passes give them."""
    from commlab.compress import gpu_kernels, scan

    x = special_values(gpu_kernels.MIN_ELEMENTS + 3, seed=8).cuda()
    for t in (0.5, 3.0):
        raises = [t * 1.03 ** j for j in range(1, 6)]
        with scan.portable_passes():
            want_idx, want_vals = scan.select_pairs_at_least(x, t)
            want_counts = scan.counts_at_least(x, raises)
        idx, vals = scan.select_pairs_at_least(x, t, scan.Scratch())
        assert torch.equal(idx, want_idx) and torch.equal(vals.view(torch.int32), want_vals.view(torch.int32)), t
        idx, vals, j = scan.select_pairs_guarded(x, t, raises, want_counts[1], scan.Scratch())
        assert j == 1 and vals.numel() == want_counts[1], t
        with scan.portable_passes():
            assert torch.equal(idx, scan.select_at_least(x, raises[1])), t


def test_a_guarded_selection_counts_its_raises_on_cuda_as_torch_passes_do(kernels_at_any_size):
    from commlab.compress import scan

    x = special_values(1_000_003, seed=2).cuda()
    for t in (0.5, 1.5, 3.0):
        raises = [t * 1.03 ** j for j in range(1, 6)]
        with scan.portable_passes():
            want_idx, want_vals = scan.select_pairs_at_least(x, t)
            want_counts = scan.counts_at_least(x, raises)
        assert want_counts[0] > want_counts[1]  # so that a limit between them picks the second raise
        for selected in (None, 0, 10 * want_idx.numel()):  # room unknown, too small, larger than needed
            scratch = scan.Scratch()
            scratch.selected = selected
            idx, vals, j = scan.select_pairs_guarded(x, t, raises, 10**12, scratch)  # within the limit
            assert j is None and torch.equal(idx, want_idx)
            assert torch.equal(vals.view(torch.int32), want_vals.view(torch.int32)), (t, selected)
        for limit, want_j in ((want_counts[1], 1), (0, 4)):  # the first raise within; none is: the last
            idx, vals, j = scan.select_pairs_guarded(x, t, raises, limit, scan.Scratch())
            assert j == want_j and vals.numel() == want_counts[j], (t, limit)
            with scan.portable_passes():
                assert torch.equal(idx, scan.select_at_least(x, raises[j]))
                assert scan.select_pairs_guarded(x, t, raises, limit)[2] == j
