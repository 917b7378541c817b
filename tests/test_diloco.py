"""DiLoCo (Douillard et al., arXiv 2311.08105) against written-out references on 2 and 4 gloo ranks:
K-step averaging (outer SGD, lr 1, no momentum), kstep's block momentum (outer heavy ball), the
outer optimizers' update formulas over several outer steps on a toy problem with a closed form
(heavy ball, torch's Nesterov against BMUF's, Adam), the pseudo-gradient observed at the outer
optimizer against anchor - mean_i(x_i), the buffer and optimizer-state policies, and a bitwise
resume through the loop's checkpoint."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commlab.algorithms.base import parse_options
from commlab.loop.checkpoint import load_checkpoint, save_checkpoint
from commlab.registry import ALGORITHMS
from commlab.testing import drive, run_distributed

ADAM = {"optimizer": "adam", "lr": 0.01, "batch_size": 5}
MSGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "batch_size": 5}
TOY_SGD = {"optimizer": "sgd", "lr": 0.3, "momentum": 0.0, "batch_size": 1}


def net(bn: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), *([nn.BatchNorm1d(8)] if bn else []), nn.Tanh(), nn.Linear(8, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g) + rank, torch.randint(0, 3, (5,), generator=g)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def state_of(model: nn.Module) -> torch.Tensor:
    """Parameters and floating buffers, flat."""
    return flat([t for t in model.state_dict().values() if t.dtype.is_floating_point])


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Each parameter's optimizer state, flat (momentum buffers, Adam's moments and step)."""
    return [flat(state.values()) for state in optimizer.state.values()]


def gathered(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x``, stacked in rank order (the test's own collective)."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.stack(out)


def sgd_outer(lr: float, momentum: float, nesterov: bool = False) -> dict:
    return {"outer_optimizer": "nesterov" if nesterov else "sgd", "outer_lr": lr, "outer_momentum": momentum}


# ---- toy problem: worker r minimises 0.5 * ||x - c_r||^2 with plain SGD -------------------------
C = torch.tensor([[0.0, 1.0, -2.0], [1.0, 3.0, 0.0], [2.0, -1.0, 1.0], [5.0, 0.0, 2.0]])
X0 = torch.tensor([10.0, -4.0, 3.0])
K, BLOCKS = 3, 4


class Point(nn.Module):
    """A model that is one point x (the toy problem's variable)."""

    def __init__(self, x0: torch.Tensor = X0):
        super().__init__()
        self.x = nn.Parameter(x0.clone())


def toy_starts(rank: int, method: str, params: dict) -> list[torch.Tensor]:
    """Where the workers start each block (the model right after every global reduction)."""
    model, starts = Point(), []

    def watch(point, driven, info):
        if point == "done" and (info.step + 1) % K == 0:
            starts.append(model.x.detach().clone())

    drive(method, {"period": K, **params}, model=model, steps=K * BLOCKS, train=TOY_SGD,
          grads=lambda step: [model.x.detach() - C[rank]], watch=watch)
    return starts


def block_mean(x: torch.Tensor, world: int) -> torch.Tensor:
    """The world average after K SGD steps from x: c_r + a (x - c_r) on worker r, a = (1 - lr)^K."""
    a, cbar = (1 - TOY_SGD["lr"]) ** K, C[:world].mean(0)
    return cbar + a * (x - cbar)


def torch_outer_reference(world: int, kind: str, lr: float, momentum: float = 0.0,
                          betas=(0.9, 0.999), eps: float = 1e-8) -> list[torch.Tensor]:
    """The outer step written out (torch's conventions), theta after each block."""
    theta, buf, m, v, out = X0.double(), None, 0.0, 0.0, []
    for t in range(1, BLOCKS + 1):
        delta = theta - block_mean(theta, world).double()
        if kind == "adam":
            m = betas[0] * m + (1 - betas[0]) * delta
            v = betas[1] * v + (1 - betas[1]) * delta**2
            theta = theta - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
        else:
            buf = delta.clone() if buf is None else momentum * buf + delta
            theta = theta - lr * (delta + momentum * buf if kind == "nesterov" else buf)
        out.append(theta.float())
    return out


def bmuf_reference(world: int, zeta: float, mu: float, nesterov: bool) -> list[torch.Tensor]:
    """BMUF block momentum written out (kstep's): where the workers start each block."""
    anchor, v, x, out = X0.double(), torch.zeros(3, dtype=torch.float64), X0.double(), []
    for _ in range(BLOCKS):
        v = mu * v + zeta * (block_mean(x, world).double() - anchor)
        anchor = anchor + v
        x = anchor + mu * v if nesterov else anchor
        out.append(x.float())
    return out


HB = {"lr": 0.6, "momentum": 0.5}


def _toys(rank, world):
    return {
        "heavy_ball": toy_starts(rank, "diloco", sgd_outer(HB["lr"], HB["momentum"])),
        "kstep_block_momentum": toy_starts(rank, "kstep", {"momentum": HB["momentum"], "block_lr": HB["lr"]}),
        "nesterov": toy_starts(rank, "diloco", sgd_outer(HB["lr"], HB["momentum"], nesterov=True)),
        "kstep_nesterov": toy_starts(rank, "kstep", {"momentum": HB["momentum"], "block_lr": HB["lr"],
                                                     "nesterov": True}),
        "adam": toy_starts(rank, "diloco", {"outer_optimizer": "adam", "outer_lr": 0.5, "outer_betas": [0.8, 0.95]}),
    }


# ---- K-step averaging: outer SGD with lr 1 and no momentum ---------------------------------------
def _kstep_equivalence(rank, world):
    # Adam without BatchNorm: the bias of a layer followed by BatchNorm has a zero gradient up to
    # rounding, which Adam's normalisation turns into full-size steps, so the one-ulp differences
    # of the two computations would grow to the learning rate there.
    out = {}
    for name, train, bn in (("adam", ADAM, False), ("msgd", MSGD, True)):
        runs = {}
        for method, params in (("diloco", {"period": 4, **sgd_outer(1.0, 0.0)}), ("kstep", {"period": 4})):
            driven = drive(method, params, model=net(bn), steps=14, train=train, batches=lambda step: batch(rank, step))
            runs[method] = (state_of(driven.model), driven.comm.stats.totals())
        out[name] = runs
    return out


# ---- the pseudo-gradient and the outer step, observed ----------------------------------------
def _observed(rank, world):
    """Nesterov outer steps (DiLoCo's lr 0.7, momentum 0.9) on a BN net with Adam inner steps:
    the outer optimizer's gradient and anchor at every outer step, every rank's replica just
    before, and the anchor after."""
    model, seen = net(), {"local": [], "grad": [], "before": [], "after": [], "global_eval": None}

    def watch(point, driven, info):
        ends = (info.step + 1) % 3 == 0
        if point == "stepped" and ends:
            seen["local"].append(gathered(flat(model.parameters())))
        if point == "done" and ends:
            seen["after"].append(flat(driven.algo.anchors))
            seen["replica"] = flat(model.parameters())
        if point == "done" and info.step == 7:  # one local step after the outer step of step 5
            algo = driven.algo
            seen["global_eval"] = (flat(algo.eval_model.parameters()), flat(algo.anchors), flat(model.parameters()))

    def before_outer(optimizer, args, kwargs):
        params = optimizer.param_groups[0]["params"]
        seen["grad"].append(flat(param.grad for param in params))
        seen["before"].append(flat(params))

    driven = drive("diloco", {"period": 3, "evaluate": "global", "final_average": False}, model=model, steps=0,
                   total_steps=11, train=ADAM, batches=lambda step: batch(rank, step), watch=watch)
    driven.algo.outer_optimizer.register_step_pre_hook(before_outer)
    driven.run(11)
    seen["totals"] = driven.comm.stats.totals()
    return seen


# ---- policies ------------------------------------------------------------------------------
POLICY_CASES = [("average", "average"), ("keep_local", "keep_local")]


def _policies(rank, world):
    out = {}
    for buffers, inner_state in POLICY_CASES:
        model, seen = net(), {}

        def watch(point, driven, info, model=model, seen=seen):
            if info.step == 1 and point in ("stepped", "done"):
                seen[point] = (model[1].running_mean.clone(),
                               driven.optimizer.state[model[0].weight]["momentum_buffer"].clone(),
                               flat(model.parameters()), flat(driven.algo.anchors))

        drive("diloco", {"period": 2, "buffers": buffers, "optimizer_state": inner_state}, model=model, steps=3,
              total_steps=4, train=MSGD, batches=lambda step: batch(rank, step), watch=watch)
        out[(buffers, inner_state)] = seen
    return out


# ---- resume through the loop's checkpoint ----------------------------------------------------
RESUME = {"period": 3, "outer_momentum": 0.8, "optimizer_state": "keep_local"}


def _final(driven) -> dict:
    algo = driven.algo
    return {"model": state_of(driven.model), "anchors": flat(algo.anchors),
            "outer": optimizer_state(algo.outer_optimizer), "inner": optimizer_state(driven.optimizer),
            "bytes": driven.comm.stats.totals()["bytes_sent"]}


def resumed_run(rank, world, folder, method, options, steps, split):
    """The uninterrupted run, and the same run stopped after ``split`` steps, checkpointed by the
    loop's checkpoint functions, rebuilt from scratch and resumed (as the loop resumes)."""
    def start(model, done):
        return drive(method, options, model=model, steps=done, total_steps=steps, train=ADAM,
                     batches=lambda step: batch(rank, step))

    whole = start(net(), steps)
    first = start(net(), split)
    save_checkpoint(folder, split, rank, world, {"model": first.model.state_dict(),
                                                 "optimizer": first.optimizer.state_dict(),
                                                 "algorithm": first.algo.state_dict(),
                                                 "stats": first.comm.stats.state_dict()})
    state = load_checkpoint(folder, rank, world)
    second = start(net(), 0)
    second.model.load_state_dict(state["model"])
    second.optimizer.load_state_dict(state["optimizer"])
    second.algo.load_state_dict(state["algorithm"])
    second.comm.stats.load_state_dict(state["stats"])
    second.next_step = split
    second.run(steps - split)
    return _final(whole), _final(second)


def _everything(rank, world, folder):
    return {"kstep": _kstep_equivalence(rank, world), "toys": _toys(rank, world),
            "observed": _observed(rank, world), "policies": _policies(rank, world),
            "resume": resumed_run(rank, world, f"{folder}/resume", "diloco", RESUME, 10, 4)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_distributed(_everything, world, args=(str(tmp_path_factory.mktemp("diloco")),), timeout_s=180)


def test_outer_sgd_with_lr_1_and_no_momentum_is_kstep(runs):
    # theta - (theta - mean x) rounds twice where the plain average rounds once: float tolerance.
    world, results = runs
    for name in ("adam", "msgd"):
        for out in results:
            ours, theirs = out["kstep"][name]["diloco"], out["kstep"][name]["kstep"]
            torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-5)
            # 14 steps, period 4: after steps 3, 7, 11 and the final one after 13; the same messages
            for key in ("reductions_global", "collectives_global", "bytes_sent"):
                assert ours[1][key] == theirs[1][key], (name, key)
            assert ours[1]["reductions_global"] == 4
        # the final outer step leaves one model, bit for bit (parameters and averaged BN statistics)
        assert all(torch.equal(out["kstep"][name]["diloco"][0], results[0]["kstep"][name]["diloco"][0])
                   for out in results)


def test_outer_heavy_ball_is_kstep_block_momentum_and_its_formula(runs):
    world, results = runs
    formula = torch_outer_reference(world, "sgd", HB["lr"], HB["momentum"])
    # BMUF classical block momentum with zeta = outer lr, mu = outer momentum: the same trajectory
    bmuf = bmuf_reference(world, HB["lr"], HB["momentum"], nesterov=False)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(formula, bmuf, strict=True))
    for out in results:
        for key in ("heavy_ball", "kstep_block_momentum"):
            got = out["toys"][key]
            assert len(got) == BLOCKS
            for block, (x, want) in enumerate(zip(got, formula, strict=True)):
                torch.testing.assert_close(x, want, atol=1e-5, rtol=0, msg=f"{key} block {block}")


def test_outer_nesterov_is_torch_nesterov_and_differs_from_bmuf_nesterov_after_the_first_block(runs):
    world, results = runs
    ours_formula = torch_outer_reference(world, "nesterov", HB["lr"], HB["momentum"])
    bmuf_formula = bmuf_reference(world, HB["lr"], HB["momentum"], nesterov=True)
    for out in results:
        for x, want in zip(out["toys"]["nesterov"], ours_formula, strict=True):
            torch.testing.assert_close(x, want, atol=1e-5, rtol=0)
        for x, want in zip(out["toys"]["kstep_nesterov"], bmuf_formula, strict=True):
            torch.testing.assert_close(x, want, atol=1e-5, rtol=0)
    # How far apart they are, block by block: the same first block, then apart (by the formulas'
    # difference, which the runs reproduce).
    gaps = [float((a - b).norm()) for a, b in zip(ours_formula, bmuf_formula, strict=True)]
    assert gaps[0] < 1e-6 and min(gaps[1:]) > 0.05, gaps
    measured = [float((a - b).norm()) for a, b in zip(results[0]["toys"]["nesterov"],
                                                      results[0]["toys"]["kstep_nesterov"], strict=True)]
    assert measured == pytest.approx(gaps, abs=1e-4)
    print("torch Nesterov - BMUF Nesterov, |x| per block:", [round(g, 4) for g in gaps])


def test_outer_adam_matches_its_formula_over_several_outer_steps(runs):
    world, results = runs
    formula = torch_outer_reference(world, "adam", 0.5, betas=(0.8, 0.95))
    for out in results:
        for x, want in zip(out["toys"]["adam"], formula, strict=True):
            torch.testing.assert_close(x, want, atol=1e-5, rtol=0)


def test_pseudo_gradient_is_anchor_minus_the_mean_replica_and_the_step_is_nesterov(runs):
    world, results = runs
    lr, mu = 0.7, 0.9  # DiLoCo's outer optimizer, the defaults
    for out in results:
        seen = out["observed"]
        # 11 steps, period 3, no final average: outer steps after steps 2, 5 and 8
        assert len(seen["grad"]) == len(seen["local"]) == 3
        assert seen["totals"]["reductions_global"] == 3
        buf, theta = None, seen["before"][0]
        for t, (grad, before, locals_, after) in enumerate(zip(seen["grad"], seen["before"], seen["local"],
                                                               seen["after"], strict=True)):
            torch.testing.assert_close(before, theta, atol=1e-6, rtol=0)  # the anchor is the last outer result
            torch.testing.assert_close(grad, before - locals_.mean(0), atol=1e-6, rtol=1e-5, msg=f"delta {t}")
            buf = grad.clone() if buf is None else mu * buf + grad
            theta = before - lr * (grad + mu * buf)
            torch.testing.assert_close(after, theta, atol=1e-6, rtol=1e-5, msg=f"outer step {t}")
        # the replicas differed before the outer step (a real average), and the anchor moved
        assert not torch.allclose(seen["local"][0][0], seen["local"][0][1])
        assert not torch.allclose(seen["after"][0], seen["before"][0])
        # evaluate=global scores the anchor, which one local step has left behind the replica
        evaluated, anchors, replica = seen["global_eval"]
        assert torch.equal(evaluated, anchors) and not torch.allclose(anchors, replica)
    assert all(torch.equal(out["observed"]["after"][-1], results[0]["observed"]["after"][-1]) for out in results)


@pytest.mark.parametrize("buffers,inner_state", POLICY_CASES)
def test_buffer_and_inner_optimizer_state_policies(runs, buffers, inner_state):
    world, results = runs
    seen = [r["policies"][(buffers, inner_state)] for r in results]
    stats_mean = torch.stack([s["stepped"][0] for s in seen]).mean(0)
    momentum_mean = torch.stack([s["stepped"][1] for s in seen]).mean(0)
    for s in seen:
        before, after = s["stepped"], s["done"]
        expect_bn = stats_mean if buffers == "average" else before[0]
        expect_momentum = momentum_mean if inner_state == "average" else before[1]
        torch.testing.assert_close(after[0], expect_bn, atol=1e-6, rtol=0)
        torch.testing.assert_close(after[1], expect_momentum, atol=1e-6, rtol=0)
        assert torch.equal(after[2], after[3])  # every replica restarts from the anchor, bit for bit
        assert torch.equal(after[2], seen[0]["done"][2])
    assert not torch.allclose(seen[0]["stepped"][0], seen[1]["stepped"][0])  # statistics that differed


def test_resume_through_the_loops_checkpoint_is_bitwise(runs):
    world, results = runs
    for out in results:
        whole, resumed = out["resume"]
        assert torch.equal(whole["model"], resumed["model"])
        assert torch.equal(whole["anchors"], resumed["anchors"])
        assert len(whole["outer"]) == len(resumed["outer"]) > 0  # the momentum buffers exist ...
        assert all(torch.equal(a, b) for a, b in zip(whole["outer"], resumed["outer"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(whole["inner"], resumed["inner"], strict=True))
        assert whole["bytes"] == resumed["bytes"]


@pytest.mark.parametrize("params,match", [
    ({"period": 0}, "period must be >= 1, got 0$"),
    ({"sync_every": 0}, r"period must be >= 1, got 0 \(sync_every is an alias of period\)"),
    ({"outer_optimizer": "lamb"}, "outer_optimizer must be one of"),
    ({"outer_lr": 0.0}, "outer_lr must be a finite number > 0, got 0.0"),
    ({"outer_lr": float("inf")}, "outer_lr must be a finite number > 0"),
    ({"outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\), got 1.0"),
    ({"outer_momentum": 0.0}, "outer_optimizer nesterov needs outer_momentum > 0"),
    ({"outer_optimizer": "adam", "outer_betas": [0.9]}, "outer_betas must be two numbers in"),
    ({"outer_betas": [0.9, 1.0]}, "outer_betas must be two numbers in"),
    ({"outer_betas": "0.9,0.99"}, "outer_betas must be two numbers in"),
    ({"evaluate": "best"}, "evaluate must be one of"),
    ({"buffers": "drop"}, "buffers must be one of"),
    ({"optimizer_state": "reset"}, "optimizer_state must be one of"),
    ({"outer_lr": "fast"}, "outer_lr: expected float, got 'fast'"),
])
def test_options_are_validated(params, match):
    with pytest.raises(ValueError, match=match):
        parse_options(ALGORITHMS.get("diloco").Options, params)


def test_defaults_are_the_papers_outer_optimizer_and_plain_sgd_is_allowed():
    options = parse_options(ALGORITHMS.get("diloco").Options, {})
    assert (options.period, options.outer_optimizer, options.outer_lr, options.outer_momentum) == \
        (500, "nesterov", 0.7, 0.9)
    assert (options.buffers, options.optimizer_state, options.final_average) == ("average", "keep_local", True)
    plain = parse_options(ALGORITHMS.get("diloco").Options, {"outer_optimizer": "sgd", "outer_momentum": 0.0})
    assert plain.outer_settings().momentum == 0.0 and not plain.outer_settings().nesterov
    assert ALGORITHMS.get("diloco").comm_pattern == "ring_allreduce"
