"""Ok-Topk and the sparse baselines (TopkA, Gaussian-k, gTop-k) on 2, 3, 4 and 8 gloo ranks.

One world of 8 processes runs every check on gloo groups of its first 2, 3 and 4 ranks and on the
whole world. Gradients are random float64 with exact zeros; every rank draws every rank's
gradients from the same seeds, so references (dense averages, a brute-force gTop-k tree) are
computed in the test itself (gTop-k's tree on dense vectors, with no product merge).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commlab.algorithms.tensors import flat_grads
from commlab.config import load_config
from commlab.core.communicator import Communicator
from commlab.grid import borrowed_runs, resolve_grid
from commlab.testing import Driven, drive, run_distributed
from test_sparse_references import brute_top_k, dense, dense_tree

WORLDS = (2, 3, 4, 8)
STEPS = 10
RESIDUAL_CASES = {
    "oktopk": ("oktopk", {"density": 0.1, "warmup_steps": 2, "local_recompute_every": 3,
                          "global_recompute_every": 4, "repartition_every": 5}),
    "oktopk_release": ("oktopk", {"density": 0.1, "warmup_steps": 2, "local_recompute_every": 3,
                                  "global_recompute_every": 4, "repartition_every": 5,
                                  "threshold_control": "release"}),
    "oktopk_balanced_rounds": ("oktopk", {"density": 0.05, "warmup_steps": 0, "local_recompute_every": 2,
                                          "global_recompute_every": 3, "repartition_every": 4,
                                          "balance": True, "schedule": "rounds",
                                          "threshold_control": "release"}),
    "topk_allgather": ("topk_allgather", {"density": 0.1, "warmup_steps": 1}),
    "gaussiank": ("gaussiank", {"density": 0.1, "warmup_steps": 1}),
    "gtopk_exact": ("gtopk", {"density": 0.1, "warmup_steps": 1, "exact_values": True}),
}


def communicators(world: int) -> dict[int, Communicator]:
    out = {}
    for size in WORLDS:
        group = None if size == world else dist.new_group(list(range(size)))
        if dist.get_rank() < size:
            out[size] = Communicator(group, scope="global" if group is None else "local")
    return out


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 5)).double()


def make_algo(method: str, params: dict, comm: Communicator) -> Driven:
    """The method over ``comm``'s ranks, built as the loop builds it; its steps take this rank's
    gradients :func:`grad`."""
    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    return drive(method, params, model=model, comm=comm, train={"lr": 0.1}, steps_per_epoch=STEPS,
                 total_steps=STEPS, grads=lambda step: grad(comm.rank, step, n))


def grad(rank: int, step: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s gradient at ``step``: normal entries, a tenth of them exactly zero."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    return x * (torch.rand(n, generator=g) > 0.1)


def run_steps(driven: Driven, steps: int, start: int | None = None) -> list[torch.Tensor]:
    """The update each of the next ``steps`` steps applied (from step ``start`` if given): the
    synchronised gradient the optimizer stepped with."""
    if start is not None:
        driven.next_step = start
    params = list(driven.model.parameters())
    updates = []
    for _ in range(steps):
        driven.run(1)
        updates.append(flat_grads(params).clone())
    return updates


def checks_on(comm: Communicator) -> dict:
    size = comm.size
    out: dict = {"residual": {}}

    # Density 1: the same update as dense SSGD (and as the plain average), every step.
    ok = make_algo("oktopk", {"density": 1.0, "warmup_steps": 0, "local_recompute_every": 2,
                              "global_recompute_every": 3, "repartition_every": 2, "probe_every": 1}, comm)
    ssgd = make_algo("ssgd", {}, comm)
    n = ok.algo.n
    errs = []
    for step, update in enumerate(run_steps(ok, 6)):
        ssgd_update = run_steps(ssgd, 1, start=step)[0]
        mean = sum(grad(r, step, n) for r in range(size)) / size
        errs.append(max(float((update - ssgd_update).abs().max()), float((update - mean).abs().max())))
    out["density1_err"] = max(errs)
    out["density1_residual"] = float(ok.algo.memory.residual.abs().max())
    out["density1_probe"] = ok.algo.metrics()["probe_error"]   # top-k(dense average) with k = n: the average

    # Residuals: per rank, updates applied + residual account for every gradient.
    for case, (method, params) in RESIDUAL_CASES.items():
        driven = make_algo(method, params, comm)
        updates = run_steps(driven, STEPS)
        out["residual"][case] = {"update_sum": sum(updates), "residual": driven.algo.memory.residual.clone(),
                                 "metrics": driven.algo.metrics()}

    # TopkA moves exactly 2k(P-1) elements per sparse step.
    topka = make_algo("topk_allgather", {"density": 0.05, "warmup_steps": 0}, comm).run(3).algo
    out["topka_volume"] = (topka.metrics()["volume"], 2 * topka.k * (size - 1))

    # gTop-k (release residuals): rank 0's tree result equals the tree on dense vectors
    # (tests/test_sparse_references.py: no product merge; several steps there, one here).
    gt_driven = make_algo("gtopk", {"density": 0.1, "warmup_steps": 0}, comm)
    update, gt = run_steps(gt_driven, 1)[0], gt_driven.algo
    leaves = []
    for r in range(size):
        g = grad(r, 0, n)
        idx = brute_top_k(g, gt.k)
        leaves.append(dense(idx, g[idx], n))
    out["gtopk_err"] = float((update - dense_tree(leaves, gt.k) / size).abs().max())

    # Checkpoint: a fresh Ok-Topk loaded from the state continues identically.
    params = RESIDUAL_CASES["oktopk"][1]
    a = make_algo("oktopk", params, comm).run(7)
    b = make_algo("oktopk", params, comm)
    b.algo.load_state_dict(a.algo.state_dict())
    out["resume_equal"] = torch.equal(run_steps(a, 3)[-1], run_steps(b, 3, start=7)[-1])
    return out


def body(rank: int, world: int) -> dict:
    return {size: checks_on(comm) for size, comm in communicators(world).items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(body, max(WORLDS), timeout_s=120)


@pytest.mark.parametrize("size", WORLDS)
def test_density_one_equals_dense_allreduce(results, size):
    for res in results[:size]:
        assert res[size]["density1_err"] < 1e-12
        assert res[size]["density1_residual"] == 0.0
        assert res[size]["density1_probe"] < 1e-12


@pytest.mark.parametrize("case", sorted(RESIDUAL_CASES))
@pytest.mark.parametrize("size", WORLDS)
def test_residual_keeps_exactly_what_was_not_applied(results, size, case):
    per_rank = [res[size]["residual"][case] for res in results[:size]]
    n = per_rank[0]["residual"].numel()
    grads = sum(grad(r, step, n) for r in range(size) for step in range(STEPS))
    # Every rank applied the same averaged update.
    for other in per_rank[1:]:
        assert torch.allclose(other["update_sum"], per_rank[0]["update_sum"], rtol=0, atol=1e-12)
    applied = size * per_rank[0]["update_sum"] + sum(r["residual"] for r in per_rank)
    assert torch.allclose(applied, grads, rtol=0, atol=1e-9)
    # Something was held back (the method is sparse) and volume was measured.
    assert sum(float(r["residual"].abs().sum()) for r in per_rank) > 0
    assert per_rank[0]["metrics"]["volume_over_k"] > 0


@pytest.mark.parametrize("size", WORLDS)
def test_topk_allgather_volume_is_2k_p_minus_1(results, size):
    volume, expected = results[0][size]["topka_volume"]
    assert volume == expected


@pytest.mark.parametrize("size", WORLDS)
def test_gtopk_tree_matches_brute_force(results, size):
    assert results[0][size]["gtopk_err"] < 1e-12


@pytest.mark.parametrize("size", WORLDS)
def test_oktopk_resumes_from_its_state(results, size):
    assert all(res[size]["resume_equal"] for res in results[:size])


@pytest.mark.parametrize("scale", ["laptop", "laptop_full", "smoke", "paper"])
def test_grid_resolves(scale):
    configs = resolve_grid("oktopk", {}, scale=scale)
    methods = {c["method"] for c in configs.values()}
    lent = borrowed_runs("oktopk", scale=scale)  # the laptop grid reads the baseline grid's ssgd
    assert "oktopk" in methods and ("ssgd" in methods or {lender for lender in lent.values()} == {"baseline"})


def test_options_name_bad_values():
    with pytest.raises(Exception, match="schedule"):
        load_config(None, ["method=oktopk", "method_params={schedule: ring}"])
    with pytest.raises(Exception, match="threshold_control"):
        load_config(None, ["method=oktopk", "method_params={threshold_control: nudged}"])
    with pytest.raises(Exception, match="density"):
        load_config(None, ["method=gtopk", "method_params={density: 0}"])
