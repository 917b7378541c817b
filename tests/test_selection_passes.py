"""The selectors' building blocks (compress/scan.py) against brute force: masks of |x| >= t and
|x| > t with no |x| buffer, one compaction, counts at many thresholds in one pass, and the float
formats' host arithmetic (rounding and neighbours) against torch's."""

from __future__ import annotations

import math
import random

import pytest
import torch

from commlab.bench.opcount import HostSyncCounter, TrafficCounter
from commlab.compress.floatbits import in_dtype, next_up
from commlab.compress.scan import (
    _counts_bucketize,
    _counts_cpu,
    at_least,
    compact,
    counts_above,
    counts_at_least,
    portable_passes,
    select_above,
    select_at_least,
)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def sample(dtype: torch.dtype, n: int = 4000, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed values with exact zeros, ties and +-pairs."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(torch.randn(n, generator=g, dtype=torch.float64)))
    x = x.to(dtype)
    x[::7] = 0
    x[3] = -x[5]
    x[10] = x[11]
    return x


def thresholds(x: torch.Tensor) -> list[float]:
    a = x.abs().double()
    picks = [float(a[i]) for i in torch.randint(0, x.numel(), (6,), generator=torch.Generator().manual_seed(1))]
    return [*picks, 0.0, -1.0, 1e-30, float(a.max()), float(a.max()) * 2, 0.1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_masks_counts_and_compaction_match_brute_force(dtype):
    x = sample(dtype)
    a = x.abs()
    ts = thresholds(x)
    # >= t compares in x's dtype (t rounded to it, as x >= t does); t <= 0 selects the non-zeros
    want_ge = [((a >= in_dtype(t, dtype)) & (x != 0)) if t > 0 else x != 0 for t in ts]
    want_gt = [(a > in_dtype(t, dtype)) if t >= 0 else x != 0 for t in ts]
    assert counts_at_least(x, ts) == [int(m.sum()) for m in want_ge]
    assert counts_above(x, ts) == [int(m.sum()) for m in want_gt]
    assert counts_at_least(x, ts[::-1]) == [int(m.sum()) for m in want_ge[::-1]]
    # among a selection that holds every entry passing the lowest positive threshold
    positive = [t for t in ts if t > 0]
    among = select_at_least(x, min(positive))
    want = [int(m.sum()) for t, m in zip(ts, want_ge, strict=True) if t > 0]
    assert counts_at_least(x, positive, among=among) == want
    for t, ge, gt in zip(ts, want_ge, want_gt, strict=True):
        assert torch.equal(at_least(x, t), ge)
        with portable_passes():  # what a GPU runs
            assert torch.equal(at_least(x, t), ge)
            assert torch.equal(select_above(x, t), torch.nonzero(gt).view(-1))
        assert torch.equal(select_at_least(x, t), torch.nonzero(ge).view(-1))
        assert torch.equal(select_above(x, t), torch.nonzero(gt).view(-1))


def test_compaction_is_one_host_sync_and_the_mask_reads_no_abs_buffer():
    x = sample(torch.float32, n=100_000)
    syncs = HostSyncCounter()
    with syncs:
        idx = select_at_least(x, 2.0)
    assert syncs.total == 1 and idx.numel() == int((x.abs() >= 2.0).sum())
    traffic = TrafficCounter()
    with portable_passes(), traffic:
        at_least(x, 2.0)
    # one float pass (read 4, write 4 bytes), one cast to a mask (read 4, write 1): no |x| buffer
    # on top, which would add 8 bytes (write |x|, read it back)
    assert traffic.bytes == (4 + 4 + 4 + 1) * x.numel()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gpu_counting_pass_counts_what_the_cpu_counts_and_reads_the_tensor_once(dtype):
    """A GPU counts many thresholds with one bucketize pass (run here on the CPU tensor); the CPU
    counts with numpy, narrowing to the few entries left once a threshold is selective."""
    x = sample(dtype, n=100_000)
    ts = sorted({in_dtype(t, dtype) for t in thresholds(x) if in_dtype(t, dtype) > 0})
    traffic = TrafficCounter()
    with traffic:
        on_gpu = _counts_bucketize(x, ts)
    assert on_gpu.tolist() == _counts_cpu(x, ts) == counts_at_least(x, ts)
    # one read of x and its bucket ids (8 bytes each), one small histogram: not a pass per threshold
    assert traffic.bytes < (x.element_size() + 8 + 8) * x.numel() + 4096


def test_float_formats_round_and_step_like_torch():
    rng = random.Random(0)
    for dtype in DTYPES:
        for _ in range(500):
            t = abs(rng.gauss(0, 1)) * 10 ** rng.randint(-45, 40)
            ref = torch.tensor(t, dtype=torch.float64).to(dtype)
            assert in_dtype(t, dtype) == float(ref) or math.isinf(float(ref))
            if math.isinf(float(ref)):
                continue
            assert next_up(t, dtype) == float(torch.nextafter(ref, torch.tensor(math.inf, dtype=dtype)))


def test_compact_on_cpu_and_torch_nonzero_agree():
    m = torch.rand(10_000, generator=torch.Generator().manual_seed(3)) < 0.01
    got = compact(m)
    assert got.dtype == torch.int64 and torch.equal(got, torch.nonzero(m).view(-1))
    assert compact(torch.zeros(0, dtype=torch.bool)).numel() == 0


def test_a_gpu_kernel_failing_on_first_use_warns_once_then_torch_passes_take_over(monkeypatch):
    """A Triton that cannot compile a kernel here costs speed, not the run: one warning naming the
    kernel and the error, then torch's passes (None) for that kernel only; once a kernel has run,
    its errors (out of memory, say) are errors."""
    import warnings

    from commlab.compress import gpu_kernels

    monkeypatch.setattr(gpu_kernels, "WORKED", set())
    monkeypatch.setattr(gpu_kernels, "BROKEN", set())

    def broken(x):
        raise RuntimeError("PTX assembly failed")

    def fine(x):
        return 2 * x

    with pytest.warns(RuntimeWarning, match="kernel broken failed .*PTX assembly failed.*COMMLAB_TRITON=0"):
        assert gpu_kernels.run(broken, 1) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and no second try
        assert gpu_kernels.run(broken, 1) is None
    assert gpu_kernels.run(fine, 3) == 6

    state = {"fail": False}

    def flaky(x):
        if state["fail"]:
            raise RuntimeError("CUDA out of memory")
        return x

    assert gpu_kernels.run(flaky, 1) == 1
    state["fail"] = True
    with pytest.raises(RuntimeError, match="out of memory"):
        gpu_kernels.run(flaky, 1)


def test_the_gpu_kernels_are_for_cuda_float32_only_and_can_be_turned_off(monkeypatch):
    from commlab.compress import gpu_kernels, scan

    assert scan._gpu_kernels(torch.ones(3)) is None  # the CPU has its own
    monkeypatch.setenv("COMMLAB_TRITON", "0")
    gpu_kernels.module.cache_clear()
    try:
        assert gpu_kernels.module() is None
    finally:
        gpu_kernels.module.cache_clear()


def test_a_guard_raise_with_its_count_known_keeps_its_subset_with_no_host_read():
    """On torch's passes (a GPU's without Triton, or below the kernels' size) keeping a raise's
    subset with its count known compacts with nonzero_static of that size, not nonzero: no host
    read. The guarded selection gives the CPU kernel's pairs."""
    from commlab.compress.scan import keep_at_least, select_pairs_at_least, select_pairs_guarded

    x = sample(torch.float32, n=50_000, seed=4)
    t = float(x.abs().quantile(0.98))
    raises = [t * 1.03**j for j in range(1, 6)]
    with portable_passes():
        idx, vals = select_pairs_at_least(x, t)
        counts = counts_at_least(vals, raises)
        counter = HostSyncCounter()
        with counter:
            kept_idx, kept_vals = keep_at_least(idx, vals, raises[2], counts[2])
        assert counter.total == 0, counter.sites
        guarded = select_pairs_guarded(x, t, raises, idx.numel() // 2)
    assert torch.equal(kept_idx, select_at_least(x, raises[2])) and torch.equal(kept_vals, x[kept_idx])
    native = select_pairs_guarded(x, t, raises, idx.numel() // 2)
    assert guarded[2] == native[2] is not None
    assert torch.equal(guarded[0], native[0]) and torch.equal(guarded[1], native[1])
