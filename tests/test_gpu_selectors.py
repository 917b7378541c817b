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
