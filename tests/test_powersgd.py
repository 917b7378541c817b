"""PowerSGD on 4 gloo ranks against a single-process reference of the same arithmetic (the paper's
Algorithm 1 with error feedback, written here from scratch with QR instead of Gram-Schmidt), at
full rank against the dense mean, and its bytes against the ring allreduce of its factors."""

import pytest
import torch

from commlab.algorithms.base import parse_options
from commlab.algorithms.powersgd import Q_INIT_STREAM, PowerSGD, compressible
from commlab.core.communicator import ring_allreduce_cost
from commlab.core.runtime import rank_generator
from commlab.models.small import TinyMLP
from commlab.testing import drive, run_distributed

SEED = 7
WORLD = 4
STEPS = 4  # step 0 dense (warmup_steps=1), then three compressed steps (warm start, error feedback)


def _grads_at(model, rank, step):
    g = rank_generator(100 + step, rank, 3)
    return [torch.randn(p.shape, generator=g) * (1 + rank) for p in model.parameters()]


def _run(rank, world, params):
    torch.manual_seed(0)
    model = TinyMLP(hidden=32)
    driven = drive(PowerSGD, params, model=model, train={"lr": 0.1, "optimizer": "sgd"}, seed=SEED,
                   steps_per_epoch=10, total_steps=100, grads=lambda step: _grads_at(model, rank, step))
    stats = driven.comm.stats
    stats.counters = dict.fromkeys(stats.counters, 0)
    stats.drain()
    applied, totals = [], []
    for _ in range(STEPS):  # the gradients each step applied (the optimizer step leaves them)
        driven.run(1)
        applied.append([p.grad.clone() for p in model.parameters()])
        totals.append(dict(stats.totals()))
    return applied, totals, driven.algo.compressed_elements()


def _orthonormal(a):
    """Orthonormal columns spanning a's, signs as Gram-Schmidt gives them (positive diag of R)."""
    q, r = torch.linalg.qr(a.double())
    return (q * torch.sign(torch.diagonal(r))).to(a.dtype)


def _reference(rank_opt):
    """Every rank's applied gradients, computed in one process from all ranks' gradients."""
    torch.manual_seed(0)
    model = TinyMLP(hidden=32)
    shapes = [p.shape for p in model.parameters()]
    low = [i for i, s in enumerate(shapes) if compressible(s, rank_opt, 2.0)]
    gen = torch.Generator().manual_seed(SEED + Q_INIT_STREAM)
    qs = {i: _orthonormal(torch.randn(shapes[i][1], min(shapes[i][0], shapes[i][1], rank_opt), generator=gen))
          for i in low}
    errors = {(r, i): torch.zeros(shapes[i]) for r in range(WORLD) for i in low}
    out = []
    for step in range(STEPS):
        grads = [_grads_at(model, r, step) for r in range(WORLD)]
        mean = [torch.stack([grads[r][i] for r in range(WORLD)]).mean(0) for i in range(len(shapes))]
        if step == 0:
            out.append(mean)
            continue
        applied = list(mean)  # dense layers: the mean
        for i in low:
            ms = [grads[r][i] + errors[(r, i)] for r in range(WORLD)]
            p = _orthonormal(sum(m @ qs[i] for m in ms))
            q = sum(m.T @ p for m in ms) / WORLD
            approx = p @ q.T
            for r in range(WORLD):
                errors[(r, i)] = ms[r] - approx
            qs[i] = _orthonormal(q)  # warm start: next step begins from this Q, orthonormalised
            applied[i] = approx
        out.append(applied)
    return out


@pytest.fixture(scope="module")
def low_rank_runs():
    return run_distributed(_run, WORLD, ({"rank": 2, "warmup_steps": 1},))


def test_powersgd_matches_the_reference_on_every_rank(low_rank_runs):
    reference = _reference(2)
    for applied, _, _ in low_rank_runs:
        for step in range(STEPS):
            for ours, ref in zip(applied[step], reference[step], strict=True):
                torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    # Compressed steps are not the dense mean (the test would pass for ssgd otherwise).
    torch.manual_seed(0)
    dense = torch.stack([torch.cat([g.reshape(-1) for g in _grads_at(TinyMLP(hidden=32), r, 2)])
                         for r in range(WORLD)]).mean(0)
    ours = torch.cat([g.reshape(-1) for g in low_rank_runs[0][0][2]])
    assert (ours - dense).norm() > 0.1 * dense.norm()


def test_powersgd_bytes_are_two_ring_allreduces_of_the_factors(low_rank_runs):
    model = TinyMLP(hidden=32)
    n_dense = sum(p.numel() for p in model.parameters())
    for rank, (_, totals, compressed) in enumerate(low_rank_runs):
        first = totals[0]
        assert first["bytes_sent"] == 4 * ring_allreduce_cost(n_dense, WORLD, rank)[0]
        # Linear(784,32) and Linear(32,10) weights at rank 2: P (n x 2) with the biases, then Q (m x 2).
        p_elems, q_elems = 32 * 2 + 10 * 2 + 32 + 10, 784 * 2 + 32 * 2
        assert compressed == p_elems + q_elems
        step = totals[1]["bytes_sent"] - first["bytes_sent"]
        assert step == 4 * (ring_allreduce_cost(p_elems, WORLD, rank)[0] + ring_allreduce_cost(q_elems, WORLD, rank)[0])
        assert totals[-1]["reductions_global"] == STEPS
        assert step < first["bytes_sent"] / 10  # the point of it: over 10x fewer bytes than dense


def test_powersgd_at_full_rank_applies_the_dense_mean():
    runs = run_distributed(_run, WORLD, ({"rank": 64, "warmup_steps": 0, "min_compression_rate": 0.1},))
    torch.manual_seed(0)
    model = TinyMLP(hidden=32)
    for step in range(STEPS):
        grads = [_grads_at(model, r, step) for r in range(WORLD)]
        mean = [torch.stack([grads[r][i] for r in range(WORLD)]).mean(0) for i in range(len(grads[0]))]
        for applied, _, _ in runs:
            for ours, ref in zip(applied[step], mean, strict=True):
                # float32 orthogonalisation of a full-rank 64-column factor: a few entries in 320
                # drift by up to ~3e-4 from the exact mean (seen under load); a wrong update is off by O(0.1)
                torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("params,match", [({"rank": 0}, "rank"), ({"warmup_steps": -1}, "warmup_steps"),
                                          ({"min_compression_rate": 0}, "min_compression_rate")])
def test_powersgd_rejects_bad_options(params, match):
    with pytest.raises(ValueError, match=match):
        parse_options(PowerSGD.Options, params)
