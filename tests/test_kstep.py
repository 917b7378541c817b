"""K-step averaging and hierarchical reductions (Cong et al., ICPP'19 Workshops) against references:
torch's PeriodicModelAverager / HierarchicalModelAverager on the same seed and data, a closed-form
reduction-momentum trajectory on a toy quadratic, exact reduction counts, and the state policies."""

import os
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)

from commlab.algorithms.averaging import is_due
from commlab.algorithms.base import parse_options
from commlab.loop.optim import build_optimizer, optimizer_settings
from commlab.registry import ALGORITHMS
from commlab.testing import drive, run_distributed

WORLD = 4


def _net(bn: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8)] + ([nn.BatchNorm1d(8)] if bn else []) + [nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _ours(method: str, params: dict, train: dict, steps: int, group_size: int = 2):
    """Drive a model through our method's hooks, as the training loop does; return (model, algo)."""
    rank = dist.get_rank()
    driven = drive(method, params, model=_net(), steps=steps, train=train, workers_per_node=group_size,
                   batches=lambda s: _batch(rank, s))
    return driven.model, driven.algo


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _torch_run(averager, train: dict, steps: int, warmup: int = 0) -> torch.Tensor:
    """The same model, optimizer and batches through torch's averager; during ``warmup`` the
    gradients are allreduced every step (what DDP with the post-local-SGD hook does)."""
    model = _net()
    opt = build_optimizer(model.parameters(), optimizer_settings(train))
    rank, world = dist.get_rank(), dist.get_world_size()
    for s in range(steps):
        x, y = _batch(rank, s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if s < warmup:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
        averager.average_parameters(model.parameters())
    return _flat(model)


MSGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "batch_size": 5}
NO_FINAL = {"final_average": False}  # torch's averagers do not reduce after the last step
ADAM = {"optimizer": "adam", "lr": 0.01, "batch_size": 5}


def _everything(rank, world, out_dir):
    """Every multi-rank case in one spawn of 4 gloo ranks (process start-up dominates the cost).
    The end-to-end run goes last: train() tears the process group down when it ends."""
    return {"periodic": _periodic_parity(rank, world), "hier": _hier_parity(rank, world),
            "counts": _counts(rank, world), "toys": _toys(rank, world),
            "policies": _all_policies(rank, world), "schedule_params": _schedule_params(rank, world),
            "train": _train_end_to_end(rank, world, out_dir)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_everything, WORLD, args=(str(tmp_path_factory.mktemp("kstep")),))


def _periodic_parity(rank, world):
    out = {}
    # phase "first" is torch's convention; warm-up = DDP-style synchronous steps in both.
    for name, train, k, warmup in (("msgd", MSGD, 4, 3), ("adam", ADAM, 3, 0)):
        ours, _ = _ours("kstep", {"period": k, "phase": "first", "warmup_steps": warmup, **NO_FINAL}, train, 14)
        ref = _torch_run(PeriodicModelAverager(period=k, warmup_steps=warmup), train, 14, warmup)
        out[name] = (_flat(ours), ref)
    # phase "last" (K local steps, then a reduction) = torch's averager whose warm-up is K-1 local steps.
    ours, _ = _ours("kstep", {"period": 4, "phase": "last", **NO_FINAL}, MSGD, 14)
    out["last"] = (_flat(ours), _torch_run(PeriodicModelAverager(period=4, warmup_steps=3), MSGD, 14))
    return out


def test_kstep_matches_torch_periodic_model_averager(runs):
    results = [r["periodic"] for r in runs]
    for case in ("msgd", "adam", "last"):
        for out in results:
            ours, ref = out[case]
            assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5), case
        # 14 steps do not end on a reduction: the replicas really are local (a non-trivial test).
        assert not torch.allclose(results[0][case][0], results[1][case][0]), case


def _hier_parity(rank, world):
    out = {}
    periods = OrderedDict([(2, 2), (6, world)])  # local groups of 2 every 2 steps, world every 6
    for phase, start in (("first", 0), ("last", 1)):
        ours, algo = _ours("kstep_hier", {"group_size": 2, "local_period": 2, "period": 6, "phase": phase,
                                          **NO_FINAL}, MSGD, 15)
        averager = HierarchicalModelAverager(periods)
        averager.step = start  # phase "last": torch's counter one step ahead
        out[phase] = (_flat(ours), _torch_run(averager, MSGD, 15), algo.comm.stats.totals())
    return out


def test_kstep_hier_matches_torch_hierarchical_model_averager(runs):
    results = [r["hier"] for r in runs]
    for phase in ("first", "last"):
        for out in results:
            ours, ref, _ = out[phase]
            assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-5), phase
        # step 14 ends a local period (phase first: 14 % 2 == 0): groups agree, the world does not
        if phase == "first":
            assert torch.allclose(results[0][phase][0], results[1][phase][0])
            assert not torch.allclose(results[0][phase][0], results[2][phase][0])
    # 15 steps, K_l = 2, K_g = 6. first: global at 0, 6, 12; local at 2, 4, 8, 10, 14.
    # last: global at 5, 11; local at 1, 3, 7, 9, 13.
    first, last = results[0]["first"][2], results[0]["last"][2]
    assert (first["reductions_global"], first["reductions_local"]) == (3, 5)
    assert (last["reductions_global"], last["reductions_local"]) == (2, 5)
    # one allreduce per reduction, plus the initial broadcast of rank 0's model
    assert first["collectives_global"] == 1 + 3 and first["collectives_local"] == 5


def _counts(rank, world):
    out = {}
    # kstep_hier: 20 steps, 3 warm-up steps (3 global reductions), then 17 local steps (t = 0..16),
    # K_l=2, K_g=6, phase last: global after t = 5, 11 -> 2, and the final one after the last
    # step (t = 16, not due) -> 1; local after t = 1, 3, 7, 9, 13, 15 -> 6.
    _, algo = _ours("kstep_hier", {"group_size": 2, "local_period": 2, "period": 6, "warmup_steps": 3},
                    MSGD, 20)
    out["hier"] = algo.comm.stats.totals()
    out["hier_metric"] = algo.metrics()
    # kstep: 20 steps, K=8, phase last: global after steps 7, 15 and the final one after 19 -> 3.
    model, algo = _ours("kstep", {"period": 8}, MSGD, 20)
    out["kstep"], out["kstep_model"] = algo.comm.stats.totals(), _flat(model)
    # the same without the final reduction -> 2
    _, algo = _ours("kstep", {"period": 8, **NO_FINAL}, MSGD, 20)
    out["kstep_no_final"] = algo.comm.stats.totals()
    # group_size 4 = the world: local reductions are global (counted as such).
    _, algo = _ours("kstep_hier", {"group_size": 4, "local_period": 2, "period": 6}, MSGD, 12)
    out["world_group"] = algo.comm.stats.totals()
    return out


def test_reduction_counts_are_exact(runs):
    results = [r["counts"] for r in runs]
    for out in results:
        hier = out["hier"]
        assert (hier["reductions_global"], hier["reductions_local"]) == (6, 6)
        # one allreduce per reduction (this net has no buffers): initial broadcast, 3 gradient and
        # 3 model allreduces
        assert (hier["collectives_global"], hier["collectives_local"]) == (1 + 6, 6)
        assert out["hier_metric"]["samples_per_global_reduction"] == pytest.approx(20 * WORLD * 5 / 6)
        assert (out["kstep"]["reductions_global"], out["kstep"]["reductions_local"]) == (3, 0)
        assert out["kstep_no_final"]["reductions_global"] == 2
        # 12 steps with K_l=2 (world group): reductions after 1, 3, 5, 7, 9, 11 -> all 6 global.
        assert (out["world_group"]["reductions_global"], out["world_group"]["reductions_local"]) == (6, 0)
    # the final reduction leaves one model
    assert all(torch.equal(out["kstep_model"], results[0]["kstep_model"]) for out in results)
    # brute-force schedule check of is_due against the definition
    for k, start, phase in ((1, 0, "last"), (4, 2, "last"), (4, 2, "first"), (3, 0, "first")):
        due = [s for s in range(20) if is_due(s, k, start, phase)]
        first = start if phase == "first" else start + k - 1
        assert due == list(range(first, 20, k))


C = torch.tensor([[0.0, 1.0, -2.0], [1.0, 3.0, 0.0], [2.0, -1.0, 1.0], [5.0, 0.0, 2.0]])  # per-rank targets
X0 = torch.tensor([10.0, -4.0, 3.0])  # the common starting point


class _Point(nn.Module):
    """A model that is one point x in R^3 (the toy problem's variable)."""

    def __init__(self, x0: torch.Tensor):
        super().__init__()
        self.x = nn.Parameter(x0.clone())


def _toy_momentum(rank, world, params, steps, lr, split=None):
    """Worker r minimises 0.5 * ||x - c_r||^2 (gradient x - c_r, given) through the hooks.
    With ``split`` the run stops after that many steps and goes on in a fresh model and algorithm
    restored from the saved state, as the loop resumes from a checkpoint."""
    params = dict(params)
    method = params.pop("method")
    train = {"optimizer": "sgd", "lr": lr, "momentum": 0.0, "batch_size": 1}

    def start(model):
        return drive(method, params, model=model, total_steps=steps, train=train, workers_per_node=2,
                     grads=lambda s: [model.x.detach() - C[rank]])

    model = _Point(X0)
    driven = start(model).run(steps if split is None else split)
    if split is not None:
        x, state = model.x.detach().clone(), driven.algo.state_dict()
        model = _Point(X0)
        driven = start(model)
        with torch.no_grad():
            model.x.copy_(x)  # this rank's replica (setup broadcast rank 0's)
        driven.algo.load_state_dict(state)
        driven.next_step = split
        driven.run(steps - split)
    return model.x.detach().clone()


MU, LR, K, BLOCKS = 0.5, 0.3, 3, 4
HIER_MU, HIER_LR = 0.6, 0.2


def _toys(rank, world):
    return {
        "plain": _toy_momentum(rank, world, {"method": "kstep", "period": K, "momentum": MU}, K * BLOCKS, LR),
        "nesterov": _toy_momentum(rank, world, {"method": "kstep", "period": K, "momentum": MU, "nesterov": True},
                                  K * BLOCKS, LR),
        "hier": _toy_momentum(rank, world, {"method": "kstep_hier", "group_size": 2, "local_period": 1,
                                            "period": 2, "momentum": HIER_MU}, 6, HIER_LR),
        # stopped after step 4 (mid-period, velocity non-zero) and resumed from the saved state
        "resumed": _toy_momentum(rank, world, {"method": "kstep", "period": K, "momentum": MU, "nesterov": True},
                                 K * BLOCKS, LR, split=4),
    }


@pytest.mark.parametrize("nesterov", [False, True])
def test_reduction_momentum_matches_hand_computed_reference(runs, nesterov):
    # Closed form: K SGD steps from x on 0.5||x - c_r||^2 give c_r + a (x - c_r), a = (1 - lr)^K,
    # so the world average after a block started at x is cbar + a (x - cbar).
    a, cbar = (1 - LR) ** K, C.mean(0)
    anchor, v, x = X0.clone(), torch.zeros(3), X0.clone()
    for _ in range(BLOCKS):
        xbar = cbar + a * (x - cbar)
        v = MU * v + (xbar - anchor)
        anchor = anchor + v
        x = anchor + MU * v if nesterov else anchor
    for out in runs:
        got = out["toys"]["nesterov" if nesterov else "plain"]
        assert torch.allclose(got, x, atol=1e-5), (got, x)
        if nesterov:  # checkpoint/resume keeps the anchor and velocity: the same trajectory
            assert torch.allclose(out["toys"]["resumed"], got, atol=1e-6)
    # the momentum really moved us: plain averaging gives a different point
    plain = X0.clone()
    for _ in range(BLOCKS):
        plain = cbar + a * (plain - cbar)
    assert not torch.allclose(x, plain, atol=1e-3)


def test_hier_momentum_acts_on_global_reductions_only(runs):
    # Reference simulation of the four workers: groups {0,1}, {2,3}; local average after steps
    # 0, 2, 4 (phase last, k_local 1, except where a global one is due), global with momentum
    # after steps 1, 3, 5.
    xs = [X0.clone() for _ in range(4)]
    anchor, v = X0.clone(), torch.zeros(3)
    for s in range(6):
        xs = [x - HIER_LR * (x - C[r]) for r, x in enumerate(xs)]
        if (s + 1) % 2 == 0:
            v = HIER_MU * v + (torch.stack(xs).mean(0) - anchor)
            anchor = anchor + v
            xs = [anchor.clone() for _ in range(4)]
        else:
            g0, g1 = (xs[0] + xs[1]) / 2, (xs[2] + xs[3]) / 2
            xs = [g0, g0, g1, g1]
    for out, ref in zip(runs, xs, strict=True):
        assert torch.allclose(out["toys"]["hier"], ref, atol=1e-5), (out["toys"]["hier"], ref)


def _policies(rank, world, buffers, opt_state):
    model = _net(bn=True)
    seen = {}

    def watch(point, driven, info):
        # step 1 ends the period: the replicas just before the reduction ("stepped") and after it
        if info.step == 1 and point in ("stepped", "done"):
            seen[point] = (_flat(model), model[1].running_mean.clone(),
                           driven.optimizer.state[model[0].weight]["momentum_buffer"].clone())

    driven = drive("kstep", {"period": 2, "buffers": buffers, "optimizer_state": opt_state, "evaluate": "average"},
                   model=model, steps=3, total_steps=4, train=MSGD, batches=lambda s: _batch(rank, s), watch=watch)
    # after step 2 (a local step) the replicas differ; evaluate=average scores their mean
    return seen["stepped"], seen["done"], _flat(model), _flat(driven.algo.eval_model)


POLICY_CASES = [("average", "average"), ("keep_local", "keep_local")]


def _all_policies(rank, world):
    return {case: _policies(rank, world, *case) for case in POLICY_CASES}


@pytest.mark.parametrize("buffers,opt_state", POLICY_CASES)
def test_buffer_and_optimizer_state_policies(runs, buffers, opt_state):
    results = [r["policies"][(buffers, opt_state)] for r in runs]
    mean = [torch.stack([r[0][i] for r in results]).mean(0) for i in range(3)]
    local_mean = torch.stack([r[2] for r in results]).mean(0)
    for before, after, _, evaluated in results:
        assert torch.allclose(after[0], mean[0], atol=1e-6)  # parameters: always averaged
        expect_bn = mean[1] if buffers == "average" else before[1]
        expect_mom = mean[2] if opt_state == "average" else before[2]
        assert torch.allclose(after[1], expect_bn, atol=1e-6)
        assert torch.allclose(after[2], expect_mom, atol=1e-6)
        assert torch.allclose(evaluated, local_mean, atol=1e-6)  # evaluate=average: the world mean
    assert not torch.allclose(results[0][2], results[1][2])  # ... of replicas that differ


def _train_end_to_end(rank, world, out_dir):
    """The real training loop: kstep_hier with reduction momentum on synthetic data, 4 workers,
    2 epochs of 10 steps (groups of 2; K_l = 2, K_g = 6)."""
    from commlab.config import load_config
    from commlab.loop import train

    config = load_config(None, [
        "method=kstep_hier", "dataset=synthetic", "model=mlp", f"workers={world}", "backend=gloo",
        "tracking.enabled=false", f"output_dir={out_dir}", "train.epochs=2", "train.batch_size=16",
        "train.train_subset=640", "train.test_subset=200", "train.log_every=2",
        "method_params={group_size: 2, k_local: 2, k_global: 6, momentum: 0.5}"])  # the paper's names: aliases
    return train(config)


def test_training_loop_end_to_end(runs):
    for out in runs:
        final = out["train"]
        # 20 steps, phase last: global after steps 5, 11, 17 and the final one after 19;
        # local after 1, 3, 7, 9, 13, 15
        assert (final["reductions_global"], final["reductions_local"]) == (4, 6)
        assert final["algo_samples_per_global_reduction"] == pytest.approx(20 * WORLD * 16 / 4)
        assert final["test_accuracy"] > 50  # synthetic classes are easy; chance is 10%
    assert len({out["train"]["test_accuracy"] for out in runs}) == 1  # one evaluated model


@pytest.mark.parametrize("method,params,match", [
    ("kstep", {"period": 0}, "period must be >= 1, got 0$"),
    ("kstep", {"k": 0}, r"period must be >= 1, got 0 \(k is an alias of period\)"),
    ("kstep", {"momentum": 1.0}, "momentum must be"),
    ("kstep", {"phase": "middle"}, "phase must be"),
    ("kstep", {"buffers": "drop"}, "buffers must be"),
    ("kstep", {"optimizer_state": "x"}, "optimizer_state must be"),
    ("kstep", {"average_optimizer_state": "x"},
     r"optimizer_state must be .* \(average_optimizer_state is an alias of optimizer_state\)"),
    ("kstep", {"nesterov": True}, "nesterov"),
    ("kstep", {"k": 4, "period": 8}, "k is an alias of period: give one of them, not both"),
    ("kstep", {"final_reduction": False, "final_average": True}, "final_reduction is an alias of final_average"),
    ("kstep_hier", {"local_period": 4, "period": 6}, "multiple of local_period"),
    ("kstep_hier", {"k_local": 4, "k_global": 6}, r"multiple of local_period=4, got 6 \(k_local is an alias"),
    ("kstep_hier", {"group_size": -1}, "group_size"),
    ("cpsgd", {"average_buffers": "yes"}, r"average_buffers: expected one of \[True, False\], got 'yes'"),
    ("adpsgd", {"average_momentum": True, "optimizer_state": "keep_local"}, "alias of optimizer_state"),
])
def test_options_are_validated(method, params, match):
    with pytest.raises(ValueError, match=match):
        parse_options(ALGORITHMS.get(method).Options, params)


@pytest.mark.parametrize("method,paper,family", [
    ("kstep", {"k": 8, "final_reduction": False, "average_optimizer_state": "average"},
     {"period": 8, "final_average": False, "optimizer_state": "average"}),
    ("kstep_hier", {"k_local": 2, "k_global": 8}, {"local_period": 2, "period": 8}),
    ("cpsgd", {"average_buffers": False, "average_momentum": True},
     {"buffers": "keep_local", "optimizer_state": "average"}),
    ("adpsgd", {"average_buffers": False, "average_momentum": True, "initial_period": 4},
     {"buffers": "keep_local", "optimizer_state": "average", "initial_period": 4}),
])
def test_paper_names_are_aliases_of_the_family_names(method, paper, family):
    options = ALGORITHMS.get(method).Options
    assert parse_options(options, paper) == parse_options(options, family)
    assert parse_options(options, paper) != parse_options(options, {})  # the aliases changed something


def _schedule_params(rank, world):
    """The params every periodic-family run logs (no step taken: they come from the options)."""
    out = {}
    for method, params in (("kstep", {"k": 8}), ("kstep_hier", {"k_local": 2, "k_global": 8, "group_size": 2}),
                           ("cpsgd", {"period": 4}), ("adpsgd", {"initial_period": 3})):
        out[method] = drive(method, params, model=_net(), steps=0, total_steps=16, train=MSGD,
                            batches=lambda s: _batch(rank, s)).algo.run_params()
    out["ssgd"] = drive("ssgd", None, model=_net(), steps=0, train=MSGD,
                        batches=lambda s: _batch(rank, s)).algo.run_params()
    return out


def test_periodic_family_logs_its_normalised_schedule(runs):
    for out in runs:
        params = out["schedule_params"]
        assert params["kstep"] == {"schedule.kind": "fixed", "schedule.period": 8, "schedule.local_period": 8}
        assert params["kstep_hier"] == {"schedule.kind": "fixed", "schedule.period": 8, "schedule.local_period": 2}
        assert params["cpsgd"] == {"schedule.kind": "fixed", "schedule.period": 4, "schedule.local_period": 4}
        assert params["adpsgd"] == {"schedule.kind": "adaptive", "schedule.period": 3, "schedule.local_period": 3}
        assert params["ssgd"] == {}


@pytest.mark.slow
def test_a_periodic_run_logs_its_schedule_as_mlflow_params(tmp_path, monkeypatch):
    """A real run of the loop (one worker, generated data) given the paper's names logs the family's
    names: the options under method_params.*, the normalised schedule under schedule.*."""
    import subprocess
    import sys
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from commlab.testing.jobs import write_config
    from commlab.tracking import ensure_experiments

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ensure_experiments(["schedcheck"], uri)
    cfg = write_config(tmp_path / "run.yaml", paper="schedcheck", method="kstep_hier", seed=1, workers=1,
                       model="mlp", dataset="synthetic", output_dir=str(tmp_path / "out"),
                       tracking={"uri": uri, "experiment": "schedcheck"},
                       method_params={"k_local": 2, "k_global": 4, "final_reduction": False},
                       train={"epochs": 1, "max_steps": 4, "log_every": 2, "batch_size": 16, "train_subset": 256})
    done = subprocess.run([sys.executable, "-m", "commlab", "train", "--config", str(cfg)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("schedcheck").experiment_id])
    params = run.data.params
    assert (params["schedule.kind"], params["schedule.period"], params["schedule.local_period"]) == ("fixed", "4", "2")
    assert (params["method_params.period"], params["method_params.local_period"]) == ("4", "2")
    assert params["method_params.final_average"] == "False"
    assert not {"method_params.k_global", "method_params.k_local", "method_params.final_reduction"} & set(params)
