"""``diloco`` and ``streaming_diloco`` in torchft's configuration (docs/diloco.md, "torchft's
configuration") against torchft's DiLoCo (``torchft/local_sgd.py``: ``DiLoCo`` over model
fragments, ``_StreamingDiLoCoFragment``) written out in the test, step by step, on 2 and 4 gloo
ranks, over fragment counts 1, 2 and 4, delays tau 0, 1 and 2 and mixings alpha 0, 0.25, 0.5 and 1.

The reference follows torchft's own bookkeeping, not ours: a step counter that restarts every
H / F steps, the fragment to sync read from the count of outer steps so far (``manager.current_step()
% F``), the pseudo-gradient ``original - local`` taken when the counter reaches H / F - tau and
averaged (summed, then divided by P in float32), and at H / F: the local parameters saved, the
replica restored to the original, one outer optimizer step (torch's SGD with Nesterov momentum,
torchft's example: lr 0.7, momentum 0.9) with the average as its gradient, the result saved as the
new original, then ``lerp`` towards the saved local parameters by alpha. Buffers are never
touched, there is no outer step at the end, the wire is float32, and the fragments are
consecutive layers (the pipeline stages torchft's example passes).

The toy model: four layers, each a point in R^2 with a floating buffer of its own (a running mean
of the point, updated after every inner step as BatchNorm updates its statistics in forward);
worker r minimises 0.5 * ||x - c_r||^2 with torch's momentum SGD.
"""

import pytest
import torch

from commlab.testing import drive, run_distributed
from test_diloco import flat
from test_streaming_diloco import DIM, LAYERS, X0, C, Points

INNER_LR, INNER_MOMENTUM = 0.2, 0.5
INNER = {"optimizer": "sgd", "lr": INNER_LR, "momentum": INNER_MOMENTUM, "batch_size": 1}
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # torchft's example's outer SGD (nesterov=True), our defaults
STEPS = 19  # ends inside a round for every case below

# docs/diloco.md, "torchft's configuration": the options that differ from our defaults
TORCHFT = {"buffers": "keep_local", "final_average": False}
TORCHFT_STREAMING = {**TORCHFT, "fragment_pattern": "sequential", "outer_precision": "fp32"}

# name: (method, H, F, tau, alpha)
CASES = {
    "diloco H4": ("diloco", 4, 1, 0, 0.0),
    "streaming F1 tau0 alpha0": ("streaming_diloco", 4, 1, 0, 0.0),
    "streaming F2 tau1 alpha0": ("streaming_diloco", 6, 2, 1, 0.0),
    "streaming F2 tau2 alpha0.5": ("streaming_diloco", 6, 2, 2, 0.5),
    "streaming F4 tau1 alpha0.25": ("streaming_diloco", 8, 4, 1, 0.25),
    "streaming F4 tau0 alpha1": ("streaming_diloco", 8, 4, 0, 1.0),
}


def options_of(case: str) -> dict:
    method, period, fragments, delay, alpha = CASES[case]
    if method == "diloco":
        return {**TORCHFT, "period": period}
    return {**TORCHFT_STREAMING, "period": period, "fragments": fragments, "delay": delay, "alpha": alpha}


class PointsWithStats(Points):
    """Streaming DiLoCo's toy layers (points x in R^2), each with a running mean ``stat`` of its
    point (a floating buffer)."""

    def __init__(self):
        super().__init__()
        for layer in self.layers:
            layer.register_buffer("stat", torch.zeros(DIM))


def update_stats(x: torch.Tensor, stat: torch.Tensor) -> None:
    """The buffers' update after an inner step: stat = (stat + x) / 2 (flat, in place)."""
    stat.mul_(0.5).add_(x, alpha=0.5)


def torchft_reference(world: int, period: int, fragments: int, delay: int, alpha: float) -> dict:
    """torchft's DiLoCo over ``fragments`` consecutive-layer fragments (the module docstring):
    every worker's parameters and buffers after every step, and the original (global) parameters
    at the end."""
    spacing = period // fragments  # torchft's self._sync_every
    coords = [torch.arange(f * LAYERS // fragments * DIM, (f + 1) * LAYERS // fragments * DIM)
              for f in range(fragments)]
    xs = [X0.clone() for _ in range(world)]
    stats = [torch.zeros(LAYERS * DIM) for _ in range(world)]
    inner_bufs: list[torch.Tensor | None] = [None] * world
    original = X0.clone()  # the fragments' original_parameters
    outer_bufs: dict[int, torch.Tensor] = {}  # the outer SGD's momentum buffer, per fragment
    local_step, commits, prepared = 0, 0, None
    trace = []
    for _ in range(STEPS):
        for r in range(world):  # torch's momentum SGD, then the buffers' update
            grad = xs[r] - C[r]
            inner_bufs[r] = grad.clone() if inner_bufs[r] is None else inner_bufs[r].mul_(INNER_MOMENTUM).add_(grad)
            xs[r].add_(inner_bufs[r], alpha=-INNER_LR)
            update_stats(xs[r], stats[r])
        local_step += 1  # the inner optimizer's step post-hook
        if local_step == spacing - delay:  # prepare_sync: the pseudo-gradients, allreduced (SUM, / P)
            f = commits % fragments
            total = None
            for x in xs:
                sent = original[coords[f]] - x[coords[f]]
                total = sent if total is None else total + sent
            prepared = (f, total / world)
        if local_step == spacing:  # perform_sync
            f, grad = prepared
            idx = coords[f]
            local = [x[idx].clone() for x in xs]  # _save_local_parameters
            theta = original[idx].clone()  # restore_parameters, then the outer step (torch SGD, Nesterov)
            buf = outer_bufs[f] = grad.clone() if f not in outer_bufs else outer_bufs[f].mul_(OUTER_MOMENTUM).add_(grad)
            theta.add_(grad.add(buf, alpha=OUTER_MOMENTUM), alpha=-OUTER_LR)
            original[idx] = theta  # save_parameters
            for x, mine in zip(xs, local, strict=True):  # _merge_parameters: lerp towards local by alpha
                x[idx] = theta.lerp(mine, alpha)
            commits += 1  # should_commit: the manager's step
            local_step = 0
        trace.append(([x.clone() for x in xs], [s.clone() for s in stats]))
    return {"trace": trace, "original": original}


def _run(rank: int, world: int, case: str) -> dict:
    model = PointsWithStats()
    trace = []

    def watch(point, driven, info):
        if point == "stepped":  # after the inner step, before the method's hook (BatchNorm's place)
            with torch.no_grad():
                for layer in model.layers:
                    update_stats(layer.x, layer.stat)
        if point == "done":
            trace.append((flat(model.parameters()), flat(model.buffers())))

    method = CASES[case][0]
    driven = drive(method, options_of(case), model=model, steps=STEPS, train=INNER,
                   grads=lambda step: flat(model.parameters()) - C[rank], watch=watch)
    driven.finish()
    return {"trace": trace, "anchors": flat(driven.algo.anchors),
            "reductions": driven.comm.stats.totals()["reductions_global"]}


def _everything(rank, world):
    return {case: _run(rank, world, case) for case in CASES}


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def runs(request):
    world = request.param
    return world, run_distributed(_everything, world, timeout_s=180)


@pytest.mark.parametrize("case", list(CASES))
def test_torchft_configuration_computes_torchfts_diloco_step_by_step(runs, case):
    world, results = runs
    _, period, fragments, delay, alpha = CASES[case]
    want = torchft_reference(world, period, fragments, delay, alpha)
    spacing = period // fragments
    for rank, out in enumerate(results):
        got = out[case]
        assert len(got["trace"]) == STEPS
        for step, ((x, stat), (xs, stats)) in enumerate(zip(got["trace"], want["trace"], strict=True)):
            # buffers are each worker's own: no outer step touches them
            if world == 2:  # a sum of two is one rounding in any order: the same operations, bit for bit
                assert torch.equal(x, xs[rank]) and torch.equal(stat, stats[rank]), (case, rank, step)
            else:  # gloo's ring adds four in an order of its own
                torch.testing.assert_close(x, xs[rank], atol=1e-5, rtol=0, msg=f"{case} rank {rank} step {step}")
                torch.testing.assert_close(stat, stats[rank], atol=1e-5, rtol=0, msg=f"{case} rank {rank} step {step}")
        if world == 2:
            assert torch.equal(got["anchors"], want["original"]), case
        else:
            torch.testing.assert_close(got["anchors"], want["original"], atol=1e-5, rtol=0)
        # one reduction per outer step launched; none at the end (a launch whose outer step would
        # come after the last step is not made: torchft's would never be applied)
        launches = sum(1 for s in range(STEPS) if (s + delay + 1) % spacing == 0 and s + delay < STEPS)
        assert got["reductions"] == launches, case
    # the replicas do not end as one model (no final outer step), and the buffers differ per rank
    last = [out[case]["trace"][-1] for out in results]
    assert not torch.equal(last[0][0], last[1][0]) and not torch.equal(last[0][1], last[1][1])
