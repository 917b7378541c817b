"""The sparse baselines' selections against references written in this file, on 2, 3 and 4 gloo ranks.

Every rank draws every rank's gradients from the same seeds, so each reference runs in one
process over all ranks, step by step, carrying its own residuals (and momenta), and never calls
the product's selectors or merges:

* TopkA: every rank's brute-force top-k of |g + residual| (``torch.topk`` on the whole tensor),
  summed and divided by P; the residual is the accumulation with that top-k zeroed.
* Gaussian-k: the threshold rule written out: mean + Phi^-1(1 - k/2n) * standard deviation
  (Python's ``statistics`` over the accumulation), |x| > threshold, divided by 1.012 while fewer
  than 3k/4 pass (50 times at most).
* gTop-k: the tree on dense vectors: each rank's top-k, then in round r every node at an
  odd multiple of 2^r is added to its left neighbour and the top-k of the dense sum kept;
  the release's values and the ``exact_values`` reading (every rank's own values at the final
  indices, summed).
* RedSync and DGC, per layer: u = m*u + g, v = v + u (Nesterov: v + m*u + g); exact top-k of |v|
  for the exact and trimmed top-k layers, and for the binary-search layer the brute-force top
  set of the size it chose, which must lie in (k/2, 2k); v and u zeroed where sent; tiny layers
  averaged dense with their momentum kept.

The tests assert the update applied at every step and the final residuals (and momenta).
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist

import pytest
import torch
from torch import nn

from commlab.compress.base import k_for_density
from commlab.testing import drive, run_distributed

WORLDS = (2, 3, 4)
N, DENSITY, STEPS, WARMUP = 3_000, 0.02, 6, 1
K = k_for_density(N, DENSITY)


class Flat(nn.Module):
    """One float64 parameter vector of n elements (gradients are set directly)."""

    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n, dtype=torch.float64))


def gradient(rank: int, step: int) -> torch.Tensor:
    """Normal entries scaled by the rank on even steps, uniform ones on odd steps (light tails:
    the Gaussian fit passes too few there), a twentieth of them exactly zero."""
    g = torch.Generator().manual_seed(7_919 * step + 31 * rank + 5)
    x = torch.randn(N, generator=g, dtype=torch.float64) * (1 + rank) if step % 2 == 0 else \
        torch.rand(N, generator=g, dtype=torch.float64) * 2 - 1
    return x * (torch.rand(N, generator=g, dtype=torch.float64) > 0.05)


def brute_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest |x| by a full sort (continuous values: no ties)."""
    return torch.sort(x.abs(), descending=True).indices[:k]


def dense(indices: torch.Tensor, values: torch.Tensor, n: int = N) -> torch.Tensor:
    out = torch.zeros(n, dtype=values.dtype)
    out[indices] = values
    return out


def gaussian_rule(acc: torch.Tensor, k: int) -> tuple[torch.Tensor, bool]:
    """Gaussian-k's selection written out, and whether its correction loop lowered the threshold."""
    values = acc.tolist()
    threshold = statistics.fmean(values) + NormalDist().inv_cdf(1 - k / N / 2) * statistics.stdev(values)
    lowered = False
    for _ in range(50):
        if int((acc.abs() > threshold).sum()) >= 0.75 * k:
            break
        threshold /= 1.012
        lowered = True
    return torch.nonzero(acc.abs() > threshold).view(-1), lowered


def dense_tree(nodes: list[torch.Tensor], k: int) -> torch.Tensor:
    """gTop-k's tree on dense vectors: node i absorbs node i + s in the round of step s when i is a
    multiple of 2s, keeping the top-k of the dense sum; returns node 0."""
    nodes, s = list(nodes), 1
    while s < len(nodes):
        for i in range(0, len(nodes), 2 * s):
            if i + s < len(nodes):
                total = nodes[i] + nodes[i + s]
                keep = brute_top_k(total, k)
                nodes[i] = dense(keep, total[keep], total.numel())
        s *= 2
    return nodes[0]


def reference(method: str, world: int) -> dict:
    """Per step the update, and at the end every rank's residual, computed in one process."""
    residual = [torch.zeros(N, dtype=torch.float64) for _ in range(world)]
    updates, lowered = [], []
    for step in range(STEPS):
        acc = [gradient(r, step) + residual[r] for r in range(world)]
        if step < WARMUP:  # dense: the average, nothing held back
            updates.append(sum(acc) / world)
            residual = [torch.zeros(N, dtype=torch.float64) for _ in range(world)]
            continue
        if method == "gaussiank":
            picked = [gaussian_rule(a, K) for a in acc]
            chosen = [idx for idx, _ in picked]
            lowered += [low for _, low in picked]
        else:
            chosen = [brute_top_k(a, K) for a in acc]
        if method in ("topk_allgather", "gaussiank"):
            update = sum(dense(idx, a[idx]) for idx, a in zip(chosen, acc, strict=True)) / world
            applied = chosen
        else:
            root = dense_tree([dense(idx, a[idx]) for idx, a in zip(chosen, acc, strict=True)], K)
            kept = root != 0
            applied = [idx[kept[idx]] for idx in chosen]
            if method == "gtopk_exact":  # every rank's own values at the global indices it selected
                update = sum(dense(idx, a[idx]) for idx, a in zip(applied, acc, strict=True)) / world
            else:
                update = root / world
        updates.append(update)
        for r in range(world):
            residual[r] = acc[r].clone()
            residual[r][applied[r]] = 0
    return {"updates": updates, "residual": residual, "lowered": lowered}


SPARSE = {"topk_allgather": ("topk_allgather", {}), "gaussiank": ("gaussiank", {}),
          "gtopk": ("gtopk", {}), "gtopk_exact": ("gtopk", {"exact_values": True})}

# RedSync / DGC: layers of 12,800 (binary search), 200 (exact top-k), 10,000 (trimmed top-k),
# 50 (dense), 500 (exact top-k) and 10 (dense) elements with these size thresholds.
POLICY = {"binary_search_above": 10_000, "trimmed_topk_above": 5_000, "dense_at_most": 64}
MOMENTUM = {"redsync": ("redsync", {"density": 0.05, "momentum": 0.9, **POLICY}),
            "redsync_nesterov": ("redsync", {"density": 0.05, "momentum": 0.9, "nesterov": True, **POLICY}),
            "dgc": ("dgc", {"density": 0.05, "momentum": 0.9, "dense_at_most": 64})}


def layered_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 50), nn.ReLU(), nn.Linear(50, 10))


def layer_gradients(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(104_729 * step + rank)
    return [torch.randn(p.shape, generator=g) * (1 + rank) for p in layered_model().parameters()]


def body(rank: int, world: int) -> dict:
    out = {}
    for name, (method, params) in SPARSE.items():
        driven = drive(method, {"density": DENSITY, "warmup_steps": WARMUP, **params}, model=Flat(N),
                       train={"lr": 0.1}, total_steps=STEPS, grads=lambda step: gradient(rank, step))
        updates = [driven.run(1).model.w.grad.clone() for _ in range(STEPS)]
        out[name] = {"updates": updates, "residual": driven.algo.memory.residual.clone()}
    for name, (method, params) in MOMENTUM.items():
        driven = drive(method, params, model=layered_model(), train={"lr": 0.1, "weight_decay": 0.0},
                       total_steps=STEPS, grads=lambda step: layer_gradients(rank, step))
        steps = []
        for _ in range(STEPS):
            driven.run(1)
            steps.append({"update": [p.grad.clone() for p in driven.model.parameters()],
                          "sent": [None if layer.last_indices is None else layer.last_indices.clone()
                                   for layer in driven.algo.layers]})
        out[name] = {"steps": steps, "selectors": [layer.selector_name for layer in driven.algo.layers],
                     "u": [layer.u.clone() for layer in driven.algo.layers],
                     "v": [layer.v.clone() for layer in driven.algo.layers]}
    return out


@pytest.fixture(scope="module", params=WORLDS)
def results(request):
    return request.param, run_distributed(body, request.param, timeout_s=300)


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_update_and_residual_equal_the_reference(results, name):
    world, per_rank = results
    want = reference(name, world)
    for rank, res in enumerate(per_rank):
        got = res[name]
        for step, (mine, theirs) in enumerate(zip(got["updates"], want["updates"], strict=True)):
            assert torch.allclose(mine, theirs, rtol=0, atol=1e-12), (name, rank, step)
        assert torch.allclose(got["residual"], want["residual"][rank], rtol=0, atol=1e-12), (name, rank)
    sparse_update = want["updates"][-1]
    assert 0 < int((sparse_update != 0).sum()) <= world * 2 * K   # sparse, and not empty
    if name == "gaussiank":  # the normal fit passes too few on the uniform steps: the loop ran
        assert any(want["lowered"]) and not all(want["lowered"])


def momentum_reference(method: str, params: dict, world: int, chosen_sizes) -> dict:
    """RedSync's / DGC's steps written out per layer; ``chosen_sizes[step][rank][layer]`` is the
    size of the binary-search layer's selection (its top set is recomputed here)."""
    shapes = [p.shape for p in layered_model().parameters()]
    sizes = [math.prod(s) for s in shapes]
    m, nesterov = params["momentum"], params.get("nesterov", False)
    u = [[torch.zeros(n, dtype=torch.float64) for n in sizes] for _ in range(world)]
    v = [[torch.zeros(n, dtype=torch.float64) for n in sizes] for _ in range(world)]
    kinds = [selector_kind(method, n) for n in sizes]
    updates = []
    for step in range(STEPS):
        update = [torch.zeros(n, dtype=torch.float64) for n in sizes]
        for r in range(world):
            for i, g in enumerate(layer_gradients(r, step)):
                g = g.reshape(-1).double()
                u[r][i] = m * u[r][i] + g
                v[r][i] = v[r][i] + (m * u[r][i] + g if nesterov else u[r][i])
                if kinds[i] == "dense":
                    update[i] += v[r][i] / world
                    v[r][i] = torch.zeros_like(v[r][i])
                    continue
                k = k_for_density(sizes[i], params["density"])
                size = chosen_sizes[step][r][i] if kinds[i] == "binary_search" else k
                sent = brute_top_k(v[r][i], size)
                update[i][sent] += v[r][i][sent] / world
                v[r][i][sent] = 0
                u[r][i][sent] = 0
        updates.append(update)
    return {"updates": updates, "u": u, "v": v, "kinds": kinds}


def selector_kind(method: str, n: int) -> str:
    if n <= POLICY["dense_at_most"]:
        return "dense"
    if method == "dgc":
        return "exact_topk"
    return "binary_search" if n > POLICY["binary_search_above"] else \
        "trimmed_topk" if n > POLICY["trimmed_topk_above"] else "exact_topk"


@pytest.mark.parametrize("name", sorted(MOMENTUM))
def test_momentum_corrected_updates_and_residuals_equal_the_reference(results, name):
    world, per_rank = results
    method, params = MOMENTUM[name]
    sizes = [[[None if sent is None else sent.numel() for sent in step["sent"]] for step in res[name]["steps"]]
             for res in per_rank]
    chosen_sizes = [[sizes[r][step] for r in range(world)] for step in range(STEPS)]
    want = momentum_reference(method, params, world, chosen_sizes)
    assert [kind if kind != "dense" else None for kind in want["kinds"]] == per_rank[0][name]["selectors"]
    assert len(set(want["kinds"])) == (4 if method == "redsync" else 2)   # every selector ran
    for rank, res in enumerate(per_rank):
        got = res[name]
        for step in range(STEPS):
            for i, (mine, theirs) in enumerate(zip(got["steps"][step]["update"], want["updates"][step], strict=True)):
                assert torch.allclose(mine.reshape(-1).double(), theirs, rtol=1e-5, atol=1e-5), (name, rank, step, i)
            for i, kind in enumerate(want["kinds"]):
                if kind == "binary_search":
                    k = k_for_density(got["v"][i].numel(), params["density"])
                    assert k / 2 < chosen_sizes[step][rank][i] < 2 * k, (name, rank, step)
        for i in range(len(want["kinds"])):
            assert torch.allclose(got["v"][i].double(), want["v"][rank][i], rtol=1e-5, atol=1e-5), (name, rank, i)
            assert torch.allclose(got["u"][i].double(), want["u"][rank][i], rtol=1e-5, atol=1e-5), (name, rank, i)
