"""Replicas stay bit-identical (docs/cluster.md, "GPUs"): every registered method, driven on 4 gloo
ranks for enough steps to leave its warm-up, keeps the tensors it promises to keep equal
(``Algorithm.replicated_tensors``: the parameters, or SSD/OD-SGD's global replica, after the run's
final average for the methods that average on a schedule) bitwise equal on every rank.

The gradients are heavy-tailed and their large entries sit at indices most ranks share, so the
sparse methods gather the same index from 3 or more ranks every step: the case where a reduction
each rank computes on its own must not depend on the order the pairs arrive in."""

from __future__ import annotations

import torch
from torch import nn

from commlab.registry import ALGORITHMS
from commlab.testing import drive, run_distributed
from commlab.testing.quick import quick_params

WORLD, STEPS = 4, 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))


def _heavy_tailed_grads(rank: int, step: int, model: nn.Module) -> list[torch.Tensor]:
    """A heavy-tailed pattern shared by all ranks (log-normal magnitudes), times per-rank noise."""
    shared = torch.Generator().manual_seed(1000 + step)
    mine = torch.Generator().manual_seed(10_000 * (rank + 1) + step)
    out = []
    for p in model.parameters():
        base = torch.randn(p.shape, generator=shared) * torch.exp(2 * torch.randn(p.shape, generator=shared))
        out.append(base * (1 + 0.3 * torch.randn(p.shape, generator=mine)))
    return out


def _batches(rank: int):
    gen = torch.Generator().manual_seed(rank)
    return lambda step: (torch.randn(16, 32, generator=gen) * 3, torch.randint(0, 10, (16,), generator=gen))


def _replicas(rank: int, world: int, methods: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for method in methods:
        model = _model()
        params = quick_params(method, world)  # kstep_hier: groups of 2 ranks
        if ALGORITHMS.get(method).forward_model is not ALGORITHMS.get("ssgd").forward_model:
            source = {"batches": _batches(rank)}  # DDP synchronises inside backward: real batches
        else:
            source = {"grads": lambda step, model=model: _heavy_tailed_grads(rank, step, model)}
        driven = drive(method, params, model=model, steps=STEPS, train={"lr": 0.01, "momentum": 0.9},
                       workers_per_node=2, **source)
        driven.finish()
        out[method] = torch.cat([t.detach().reshape(-1) for t in driven.algo.replicated_tensors()])
    return out


def test_every_method_keeps_its_replicas_bitwise_equal():
    # the package's own methods (`commlab list`), not plugins another test registered in this process
    methods = ALGORITHMS.package_names()
    results = run_distributed(_replicas, WORLD, args=(methods,), timeout_s=300)
    drifted = [f"{m}: rank {r} differs in {int((results[r][m] != results[0][m]).sum())} of "
               f"{results[0][m].numel()} elements" for m in methods for r in range(1, WORLD)
               if not torch.equal(results[r][m], results[0][m])]
    assert drifted == []
    # and the methods did move the replicas (a test of a model nobody touched could not fail)
    untouched = _model()
    start = torch.cat([p.detach().reshape(-1) for p in untouched.parameters()])
    for m in methods:
        if results[0][m].numel() == start.numel():
            assert not torch.equal(results[0][m], start), m
