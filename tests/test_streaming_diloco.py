"""Streaming DiLoCo (Douillard et al., arXiv 2501.18512) against written-out references on 2 and 4
gloo ranks: a simulation of every worker in the test (fragments synced in turn, the allreduce
started tau steps early, the mixing alpha, pseudo-gradients summed in bfloat16 or float32, the
final outer step), one fragment with tau = 0 and alpha = 0 against DiLoCo bit for bit, the bytes
each fragment sent, the asynchronous launch, the buffers that go with their fragment, a bitwise
resume with a fragment in flight, and the fragmenting of layers against brute force."""

import itertools
import random

import pytest
import torch
from torch import nn

from commlab.algorithms.base import parse_options
from commlab.algorithms.streaming_diloco import model_layers, partition
from commlab.registry import ALGORITHMS
from commlab.testing import drive, run_distributed
from test_ddp_compressed import ring_sums
from test_diloco import ADAM, batch, flat, gathered, net, optimizer_state, resumed_run, state_of

LAYERS, DIM = 4, 2  # the toy model: four layers, each a point in R^2
X0 = torch.tensor([4.0, -2.0, 1.0, 3.0, -5.0, 2.0, 0.5, -1.0])
C = torch.tensor([[0.0, 1.0, -2.0, 1.0, 3.0, 0.0, 2.0, 1.0], [2.0, -1.0, 1.0, 5.0, 0.0, 2.0, -3.0, 1.0],
                  [1.0, 1.0, 4.0, -2.0, 1.0, 1.0, 0.0, 2.0], [-1.0, 3.0, 0.0, 0.0, 2.0, -4.0, 1.0, 1.0]])
INNER_LR = 0.3
TOY_SGD = {"optimizer": "sgd", "lr": INNER_LR, "momentum": 0.0, "batch_size": 1}
WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Points(nn.Module):
    """Layers that are points: worker r minimises 0.5 * ||x - c_r||^2 with plain SGD."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList()
        for j in range(LAYERS):
            layer = nn.Module()
            layer.x = nn.Parameter(X0[j * DIM:(j + 1) * DIM].clone())
            self.layers.append(layer)


def simulate(world: int, steps: int, o: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every worker of a streaming DiLoCo run written out (the replicas and the anchor at the end).
    Fragments are strided (layer j in fragment j mod F); outer optimizer: torch's SGD with
    Nesterov momentum, its update written out with the same operations."""
    fragments, period, delay, alpha = o["fragments"], o["period"], o["delay"], o["alpha"]
    lr, mu, wire = o["outer_lr"], o["outer_momentum"], WIRE[o["outer_precision"]]
    spacing = period // fragments
    coords = [torch.tensor([j * DIM + d for j in range(f, LAYERS, fragments) for d in range(DIM)])
              for f in range(fragments)]
    xs = [X0.clone() for _ in range(world)]
    theta, bufs, flight = X0.clone(), {}, None

    def ending(step):  # the fragment whose outer step comes after this step
        return None if (step + 1) % spacing else ((step + 1) // spacing - 1) % fragments

    def pseudo_gradient(f):
        total = None
        for x in xs:  # each rank's delta in the wire dtype, summed in it
            sent = (theta[coords[f]] - x[coords[f]]).to(wire)
            total = sent if total is None else total + sent
        return total.to(torch.float32) / world

    def outer_step(f, delta, mix):
        idx = coords[f]
        buf = bufs[f] = delta.clone() if f not in bufs else bufs[f].mul_(mu).add_(delta)
        theta[idx] = theta[idx].add(delta.add(buf, alpha=mu), alpha=-lr)  # Nesterov: delta + mu * buf
        for x in xs:  # x = (1 - alpha) * theta + alpha * x_local
            x[idx] = theta[idx].lerp(x[idx], mix)

    for s in range(steps):
        for r, x in enumerate(xs):
            x.add_(x - C[r], alpha=-INNER_LR)
        last = s == steps - 1
        f = ending(s + delay)
        if f is not None and s + delay < steps:
            flight = (f, s + delay, pseudo_gradient(f))
        applied = None
        if flight is not None and flight[1] == s:
            applied = flight[0]
            outer_step(flight[0], flight[2], 0.0 if last else alpha)
            flight = None
        if last:  # final_average: every other fragment from its current pseudo-gradient, no mixing
            for f in range(fragments):
                if f != applied:
                    outer_step(f, pseudo_gradient(f), 0.0)
    return xs, theta


TOY = {"period": 6, "fragments": 2, "delay": 1, "alpha": 0.5, "outer_lr": 0.7, "outer_momentum": 0.9}
TOY_STEPS = 17  # ends between outer steps: the final one covers both fragments


def _toy(rank, world, options):
    model = Points()
    trace = {"bytes": [], "in_flight": [], "sent": [], "applied": []}

    def watch(point, driven, info):
        if point == "done":
            trace["bytes"].append(driven.comm.stats.counters["bytes_sent"])
            flight = driven.algo.in_flight
            exchange = None if flight is None else flight.exchange
            trace["in_flight"].append(None if flight is None else
                                      (exchange.fragment.index, flight.apply_step,
                                       all(m.pending is not None for m in exchange.messages)))
            if flight is not None and flight.apply_step == info.step + options["delay"]:  # launched now
                fragment = exchange.fragment
                trace["sent"].append(gathered(flat(fragment.anchors) - flat(fragment.params)))

    def before_outer(optimizer, args, kwargs):
        params = optimizer.param_groups[0]["params"]
        trace["applied"].append(flat(param.grad for param in params if param.grad is not None))

    driven = drive("streaming_diloco", options, model=model, steps=0, total_steps=TOY_STEPS, train=TOY_SGD,
                   grads=lambda step: flat(model.parameters()) - C[rank], watch=watch)
    driven.algo.outer_optimizer.register_step_pre_hook(before_outer)
    driven.run(TOY_STEPS)
    driven.finish()
    return {"x": flat(model.parameters()), "theta": flat(driven.algo.anchors), "metrics": driven.algo.metrics(),
            "params": driven.algo.run_params(), "totals": driven.comm.stats.totals(), **trace}


TOY_CASES = {"fp32": {**TOY, "outer_precision": "fp32"}, "bf16": {**TOY, "outer_precision": "bf16"},
             "tau2": {**TOY, "delay": 2, "fragments": 3, "period": 9, "outer_precision": "fp32"}}


# ---- one fragment, tau = 0, alpha = 0 is DiLoCo ---------------------------------------------
ONE_FRAGMENT = {"period": 4, "fragments": 1, "delay": 0, "alpha": 0.0, "outer_precision": "fp32"}


def _as_diloco(rank, world):
    out = {}
    for method, options in (("streaming_diloco", ONE_FRAGMENT), ("diloco", {"period": 4})):
        driven = drive(method, options, model=net(), steps=14, train=ADAM, batches=lambda step: batch(rank, step))
        algo = driven.algo
        out[method] = (state_of(driven.model), flat(algo.anchors), optimizer_state(algo.outer_optimizer),
                       driven.comm.stats.totals())
    return out


# ---- buffers go with their fragment ----------------------------------------------------------
def _buffers(rank, world):
    """Linear, BatchNorm, Linear in 2 strided fragments: {Linear, Linear} and {BatchNorm}."""
    model, seen = net(), {}

    def watch(point, driven, info):
        if point in ("stepped", "done") and info.step in (1, 3):
            seen[(point, info.step)] = gathered(model[1].running_mean.clone())

    drive("streaming_diloco", {"period": 4, "fragments": 2, "delay": 0, "alpha": 0.0, "final_average": False},
          model=model, steps=5, train=ADAM, batches=lambda step: batch(rank, step), watch=watch)
    return seen


def _train_end_to_end(rank, world, out_dir):
    """The real training loop: 2 epochs of 10 steps, period 4, the MLP's 2 layers as 2 fragments,
    tau 1, bf16 on the wire."""
    from commlab.config import load_config
    from commlab.loop import train

    config = load_config(None, [
        "method=streaming_diloco", "dataset=synthetic", "model=mlp", f"workers={world}", "backend=gloo",
        "tracking.enabled=false", f"output_dir={out_dir}", "train.epochs=2", "train.batch_size=16",
        "train.train_subset=640", "train.test_subset=200", "train.log_every=2", "train.optimizer=adam",
        "train.lr=0.003", "method_params={period: 4, fragments: 2, fragment_sync_delay: 1}"])
    return train(config)


def _everything(rank, world, folder):
    out = {"toy": {name: _toy(rank, world, options) for name, options in TOY_CASES.items()},
           "as_diloco": _as_diloco(rank, world), "buffers": _buffers(rank, world),
           "resume": resumed_run(rank, world, f"{folder}/resume", "streaming_diloco",
                                 {"period": 4, "fragments": 2, "delay": 1, "outer_momentum": 0.8}, 10, 5)}
    if world == 4:  # train() tears the process group down when it ends: last
        out["train"] = _train_end_to_end(rank, world, f"{folder}/train")
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def runs(request, tmp_path_factory):
    world = request.param
    folder = str(tmp_path_factory.mktemp("streaming"))
    return world, run_distributed(_everything, world, args=(folder,), timeout_s=240)


@pytest.mark.parametrize("case", sorted(TOY_CASES))
def test_streaming_matches_every_worker_written_out(runs, case):
    world, results = runs
    options = TOY_CASES[case]
    xs, theta = simulate(world, TOY_STEPS, options)
    for rank, out in enumerate(results):
        got = out["toy"][case]
        if world == 2:
            # two ranks: each sum is one rounding, in any order; the same operations as the run
            assert torch.equal(got["x"], xs[rank]) and torch.equal(got["theta"], theta), case
        else:
            # four: gloo's ring adds in an order of its own; bf16 sums round at each addition
            tolerance = 1e-5 if options["outer_precision"] == "fp32" else 2e-2
            torch.testing.assert_close(got["x"], xs[rank], atol=tolerance, rtol=0)
            torch.testing.assert_close(got["theta"], theta, atol=tolerance, rtol=0)
        # the final outer step leaves one model, bit for bit
        assert torch.equal(got["x"], results[0]["toy"][case]["x"])
    if case == "bf16":  # the bfloat16 wire changes the result: the test sees the precision
        fp32, _ = simulate(world, TOY_STEPS, TOY_CASES["fp32"])
        assert not torch.allclose(fp32[0], xs[0], atol=1e-4)


@pytest.mark.parametrize("case", sorted(TOY_CASES))
def test_each_outer_step_applies_the_wire_dtype_average_of_the_pseudo_gradients_sent(runs, case):
    # Exact on any world: the pseudo-gradients each rank sent at a launch, cast to the wire dtype,
    # summed in it in one of the ring's orders, divided by P in float32: the outer step's gradient.
    world, results = runs
    wire = WIRE[TOY_CASES[case]["outer_precision"]]
    for out in results:
        got = out["toy"][case]
        assert len(got["sent"]) == 5 and len(got["applied"]) > 5  # and the final outer steps
        for sent, applied in zip(got["sent"], got["applied"], strict=False):
            candidates = torch.stack(ring_sums(sent, wire, pre_divide=False))
            assert bool((candidates == applied).any(0).all())
            if wire is torch.bfloat16:  # not what a float32 wire would give
                assert not torch.equal(applied, sent.mean(0))


def test_fragments_launch_tau_steps_early_asynchronously_and_count_their_bytes(runs):
    world, results = runs
    options = TOY_CASES["tau2"]  # period 9, 3 fragments (h = 3), tau 2, 17 steps
    for out in results:
        got = out["toy"]["tau2"]
        # fragment f ends after steps 3f + 2 + 9k and starts 2 steps earlier; the last start
        # (fragment 2 of round 2, ending after step 17) would end past the run: not launched.
        flights = got["in_flight"]
        expected = {0: (0, 2, True), 1: (0, 2, True), 3: (1, 5, True), 4: (1, 5, True), 6: (2, 8, True),
                    7: (2, 8, True), 9: (0, 11, True), 10: (0, 11, True), 12: (1, 14, True), 13: (1, 14, True)}
        assert {s: f for s, f in enumerate(flights) if f is not None} == expected
        # bytes go out at the launch steps (and at the final step), not at the outer steps
        grew = [s for s in range(1, TOY_STEPS) if got["bytes"][s] > got["bytes"][s - 1]]
        assert grew == [3, 6, 9, 12, 16]
        assert got["bytes"][0] > 0  # step 0 launched fragment 0 (after setup's broadcast)
        # 5 launches, then the final outer step of all 3 fragments: 6 reductions, 8 outer steps
        assert got["totals"]["reductions_global"] == 6
        assert got["metrics"]["syncs"] == 8
        assert got["params"]["fragment.0.numel"] == 4 and got["params"]["fragment.1.numel"] == 2
    # each fragment's bytes: launches x (ring allreduce of n_f float32 elements), over the ranks 2 n_f (P - 1)
    launches = {0: 3, 1: 3, 2: 2}  # with the final one
    numel = {0: 4, 1: 2, 2: 2}  # strided: layers {0, 3}, {1}, {2}
    for f in range(3):
        total = sum(out["toy"]["tau2"]["metrics"][f"fragment{f}_bytes_sent"] for out in results)
        assert total == launches[f] * 2 * numel[f] * (world - 1) * 4
    bf16 = sum(out["toy"]["bf16"]["metrics"]["fragment0_bytes_sent"] for out in results)
    assert bf16 == 4 * 2 * 4 * (world - 1) * 2  # 2 bytes per element on a bf16 wire
    assert options["delay"] == 2


def test_one_fragment_without_delay_or_mixing_is_diloco_bit_for_bit(runs):
    world, results = runs
    for out in results:
        ours, theirs = out["as_diloco"]["streaming_diloco"], out["as_diloco"]["diloco"]
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
        assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2], strict=True)) and ours[2]
        for key in ("reductions_global", "collectives_global", "bytes_sent", "elements_sent"):
            assert ours[3][key] == theirs[3][key], key


def test_buffers_are_averaged_with_their_fragment_only(runs):
    world, results = runs
    seen = results[0]["buffers"]
    # step 1 ends fragment 0 (the Linear layers): the BatchNorm statistics stay each rank's own
    assert torch.equal(seen[("done", 1)], seen[("stepped", 1)])
    assert not torch.allclose(seen[("done", 1)][0], seen[("done", 1)][1])
    # step 3 ends fragment 1 (the BatchNorm): its statistics become the ranks' average
    mean = seen[("stepped", 3)].mean(0)
    for r in range(world):
        torch.testing.assert_close(seen[("done", 3)][r], mean, atol=1e-6, rtol=0)


def test_resume_with_a_fragment_in_flight_is_bitwise(runs):
    world, results = runs
    for out in results:
        whole, resumed = out["resume"]  # stopped after step 4: fragment 0 launched there, applied at 5
        for key in ("model", "anchors"):
            assert torch.equal(whole[key], resumed[key]), key
        assert all(torch.equal(a, b) for a, b in zip(whole["outer"], resumed["outer"], strict=True))
        assert whole["bytes"] == resumed["bytes"]


def test_training_loop_end_to_end(runs):
    world, results = runs
    if world != 4:
        pytest.skip("run on 4 ranks")
    for out in results:
        final = out["train"]
        # 20 steps, h = 2: launches after steps 0, 2, ..., 18 (10 reductions); fragment 1's outer
        # step ends the run at step 19, and fragment 0 gets a final one there (1 more)
        assert final["reductions_global"] == 11
        assert final["algo_syncs"] == 11
        assert final["algo_in_flight"] == 0.0
        assert final["test_accuracy"] > 50  # synthetic classes are easy; chance is 10%
    assert len({out["train"]["test_accuracy"] for out in results}) == 1


# ---- layers and fragments (no processes) -------------------------------------------------------
def test_sequential_partition_minimises_the_largest_fragment_and_strided_deals_layers_round_robin():
    rng = random.Random(0)
    for _ in range(60):
        sizes = [rng.choice([1, 2, 5, 40, 300]) for _ in range(rng.randint(1, 9))]
        count = rng.randint(1, len(sizes))
        runs = partition(sizes, count, "sequential")
        assert [j for run in runs for j in run] == list(range(len(sizes))) and all(runs)
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes)), strict=True))
                   for cuts in itertools.combinations(range(1, len(sizes)), count - 1))
        assert max(sum(sizes[j] for j in run) for run in runs) == best, (sizes, count, runs)
        assert partition(sizes, count, "strided") == [list(range(f, len(sizes), count)) for f in range(count)]
    with pytest.raises(ValueError, match="fragments=4 exceeds the model's 3 layers with parameters"):
        partition([1, 2, 3], 4, "strided")


def test_layers_carry_their_buffers_and_shared_parameters_once():
    torch.manual_seed(0)
    first = nn.Linear(4, 4)
    model = nn.Sequential(nn.BatchNorm1d(4, affine=False), first, nn.BatchNorm1d(4), nn.ReLU(),
                          nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False), first)
    layers = model_layers(model)
    assert [len(params) for params, _ in layers] == [2, 2, 2]  # the tied Linear once
    bns = [model[0], model[2], model[5]]
    assert [[id(b) for b in buffers] for _, buffers in layers] == [
        [id(bns[0].running_mean), id(bns[0].running_var)], [id(bns[1].running_mean), id(bns[1].running_var)],
        [id(bns[2].running_mean), id(bns[2].running_var)]]


@pytest.mark.parametrize("params,match", [
    ({"fragments": 0}, "fragments must be >= 1, got 0"),
    ({"period": 10, "fragments": 4}, "period must be a multiple of fragments=4, got 10"),
    ({"period": 8, "fragments": 4, "delay": 2}, r"delay must be in \[0, period / fragments = 2\), got 2"),
    ({"fragment_sync_delay": -1}, r"delay must be in .* \(fragment_sync_delay is an alias of delay\)"),
    ({"alpha": 1.5}, r"alpha must be in \[0, 1\], got 1.5"),
    ({"fragment_update_alpha": 0.2, "alpha": 0.3}, "fragment_update_alpha is an alias of alpha"),
    ({"outer_precision": "fp8"}, "outer_precision must be one of"),
    ({"fragment_pattern": "random"}, "fragment_pattern must be one of"),
    ({"outer_optimizer": "rmsprop"}, "outer_optimizer must be one of"),
])
def test_options_are_validated(params, match):
    with pytest.raises(ValueError, match=match):
        parse_options(ALGORITHMS.get("streaming_diloco").Options, params)
