"""CPSGD and ADPSGD: the variance probe against a dense computation, CPSGD against torch's
PeriodicModelAverager, the ADPSGD period rule on scripted variances, its budget, determinism."""

import copy
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from commlab.algorithms.adpsgd import (
    ADPSGD,
    CPSGD,
    AdaptiveSchedule,
    cpsgd_syncs,
    next_period,
)
from commlab.algorithms.averaging import average_and_probe
from commlab.algorithms.base import parse_options
from commlab.core import Communicator
from commlab.core.communicator import ring_allreduce_cost
from commlab.core.runtime import rank_generator
from commlab.models.small import TinyMLP
from commlab.testing import drive, run_distributed

TRAIN = {"lr": 0.1, "optimizer": "sgd", "momentum": 0.9}


def _make(cls, params, rank, world, seed, total_steps, lr=None):
    """The method on a TinyMLP seeded by ``seed``, set up as the loop does (no step taken yet), its
    counters reset so that they count the training traffic only."""
    torch.manual_seed(seed)
    driven = drive(cls, params, model=TinyMLP(hidden=8), train=TRAIN, seed=seed, steps_per_epoch=10,
                   total_steps=total_steps, lr=lr, batches=lambda step: _batch(rank, step, seed))
    stats = driven.comm.stats
    stats.counters = dict.fromkeys(stats.counters, 0)
    stats.drain()
    return driven


def _batch(rank, step, seed):
    g = rank_generator(seed, rank, 1000 + step)
    return torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)


def _train_step(model, optimizer, rank, step, seed):
    x, y = _batch(rank, step, seed)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


# ---- the variance probe --------------------------------------------------------------------------
def _probe(rank, world):
    comm = Communicator()
    g = rank_generator(3, rank)
    tensors = [torch.randn(5, 3, generator=g) * (rank + 1), torch.randn(7, generator=g) + rank,
               torch.randn(4, generator=g)]  # the last one is averaged but not probed
    before = torch.cat([t.reshape(-1) for t in tensors]).clone()
    with comm.reduction():
        v = average_and_probe(tensors, comm, probe_numel=22)
    after = torch.cat([t.reshape(-1) for t in tensors])
    return before, after, v, comm.stats.drain(), comm.stats.totals()


WORLD, PERIOD, STEPS = 4, 3, 11


def _all_checks(rank, world):
    """Every multi-rank check in one set of processes (spawning gloo ranks is the slow part)."""
    return {"probe": _probe(rank, world), "cpsgd": _cpsgd_vs_torch(rank, world, PERIOD, STEPS, 7),
            "adpsgd": _adpsgd_runs(rank, world, 30)}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_all_checks, WORLD)


def test_variance_probe_equals_dense_computation(ranks):
    world = WORLD
    results = [r["probe"] for r in ranks]
    x = torch.stack([r[0] for r in results]).double()  # every replica, gathered
    xbar = x.mean(0)
    dense = ((x[:, :22] - xbar[:22]) ** 2).sum(1).mean().item()
    assert dense > 0
    for rank, (_, after, v, calls, totals) in enumerate(results):
        assert v == pytest.approx(dense, rel=1e-6)
        assert v == results[0][2]  # every rank takes the same decision
        torch.testing.assert_close(after.double(), xbar, rtol=0, atol=1e-6)
        model_call, scalar_call = calls  # one model allreduce plus one scalar allreduce
        assert model_call.elements_sent == ring_allreduce_cost(26, world, rank)[0]
        assert model_call.bytes_sent == 4 * model_call.elements_sent
        assert scalar_call.elements_sent == ring_allreduce_cost(1, world, rank)[0]
        assert scalar_call.bytes_sent == 8 * scalar_call.elements_sent
        assert totals["reductions_global"] == 1 and totals["collectives_global"] == 2


# ---- CPSGD against torch's PeriodicModelAverager -------------------------------------------------
def _cpsgd_vs_torch(rank, world, period, steps, seed):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    out = {}
    for first, warmup in ((False, period - 1), (True, 0)):
        algo = _make(CPSGD, {"period": period, "sync_at_first_step": first, "final_average": False},
                     rank, world, seed, total_steps=10_000).run(steps).algo
        torch.manual_seed(seed)
        ref = TinyMLP(hidden=8)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=TRAIN["lr"], momentum=TRAIN["momentum"])
        averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
        for step in range(steps):  # the reference: torch's averager after each plain SGD step
            _train_step(ref, ref_opt, rank, step, seed)
            averager.average_parameters(ref.parameters())
        out[first] = ([p.detach().clone() for p in algo.model.parameters()],
                      [p.detach().clone() for p in ref.parameters()],
                      algo.comm.stats.totals(), [h[0] for h in algo.schedule.history],
                      sum(p.numel() for p in ref.parameters()))
    return out


def test_cpsgd_matches_torch_periodic_averager_and_syncs_every_p_steps(ranks):
    world, period, steps = WORLD, PERIOD, STEPS
    results = [r["cpsgd"] for r in ranks]
    expected_steps = {False: [s for s in range(steps) if (s + 1) % period == 0],  # 2, 5, 8
                      True: [s for s in range(steps) if s % period == 0]}  # 0, 3, 6, 9
    for rank, out in enumerate(results):
        for first, (ours, theirs, totals, sync_steps, n) in out.items():
            for a, b in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
            assert sync_steps == expected_steps[first]
            syncs = len(expected_steps[first])
            assert totals["reductions_global"] == syncs
            assert totals["collectives_global"] == 2 * syncs  # model + variance scalar
            model_sent = ring_allreduce_cost(n, world, rank)[0] * 4
            scalar_sent = ring_allreduce_cost(1, world, rank)[0] * 8
            assert totals["bytes_sent"] == syncs * (model_sent + scalar_sent)
    # Replicas really diverge between averages and agree right after one.
    assert not torch.equal(results[0][False][0][0], results[1][False][0][0])  # step 10: local step


def test_cpsgd_sync_count_helper():
    assert cpsgd_syncs(4, 16) == 4 and cpsgd_syncs(4, 18) == 5 and cpsgd_syncs(4, 18, False) == 4
    assert cpsgd_syncs(4, 16, sync_at_first_step=True) == 5  # 0, 4, 8, 12 and the final step


# ---- the ADPSGD rule, without processes ----------------------------------------------------------
def _options(**kw):
    base = {"initial_period": 2, "calibration_syncs": 2, "calibration_warmup": 0, "growth": 2.0, "shrink": 0.5,
            "grow_below": 1.0, "shrink_above": 2.0, "max_period": 64, "final_average": False}
    base.update(kw)
    return parse_options(ADPSGD.Options, base)


def _drive(schedule, total, variances, lrs=None):
    """Feed the scripted variances at each synchronisation; return (step, period-in-force) pairs."""
    it = iter(variances)
    for step in range(total):
        lr = lrs(step) if lrs else 0.1
        schedule.observe_lr(step, lr)
        if schedule.due(step):
            schedule.after_sync(step, next(it), lr)
    return [(s, p) for s, p, _ in schedule.history]


def test_next_period_rule():
    o = _options(min_period=2, max_period=16)
    assert next_period(4, 0.5, 1.0, o) == 8  # below target: grow
    assert next_period(4, 1.5, 1.0, o) == 4  # inside the band: hold
    assert next_period(8, 2.5, 1.0, o) == 4  # above: shrink
    assert next_period(16, 0.0, 1.0, o) == 16  # capped at max_period
    assert next_period(2, 9.0, 1.0, o) == 2  # floored at min_period
    assert next_period(3, 0.1, 1.0, _options(growth=1.1)) == 4  # always at least one step
    assert next_period(4, 0.0, 0.0, o) == 8 and next_period(4, 1.0, 0.0, o) == 2  # zero target


def test_adpsgd_follows_the_rule_on_scripted_variances():
    s = AdaptiveSchedule(_options(), total_steps=200)
    # Calibration at period 2 (V = 1, 3 -> target 2), then: 1 grow, 3 hold, 5 shrink, 0 grow...
    history = _drive(s, 200, [1.0, 3.0, 1.0, 3.0, 5.0, 0, 0, 0, 0, 0, 0])
    assert history == [(1, 2), (3, 2), (5, 2), (9, 4), (13, 4), (15, 2), (19, 4), (27, 8), (43, 16),
                       (75, 32), (139, 64)]
    assert s.target(0.1) == 2.0 and s.next_sync is None  # 139 + 64 is past the end
    m = s.metrics()
    assert m["period"] == 64 and m["variance"] == 0.0 and m["syncs"] == 11


def test_adpsgd_retightens_after_lr_drop_and_recalibrates():
    s = AdaptiveSchedule(_options(), total_steps=100)
    lrs = lambda step: 0.1 if step < 40 else 0.01
    script = [1.0, 1.0] + [0.0] * 4 + [5.0, 0.01, 0.01, 0.001, 0.001, 0.001]
    history = _drive(s, 100, itertools.chain(script, itertools.repeat(0.5)), lrs)
    # 1, 3 calibrate (target 1); 5 -> 4; 9 -> 8; 17 -> 16; 33 -> 32 (next at 65), but the drop at
    # step 40 re-tightens to period 2 from the last sync (35 < 40, so at once) and re-calibrates
    # from 42 and 44 (target 0.01; the 5.0 at 40 straddles the drop and is left out); then
    # 46 -> 4, 50 -> 8, 58 -> 16, and V = 0.5 shrinks the period.
    assert history[:6] == [(1, 2), (3, 2), (5, 2), (9, 4), (17, 8), (33, 16)]
    assert history[6:9] == [(40, 2), (42, 2), (44, 2)]
    assert s.retightens == 1 and s.target(0.01) == pytest.approx(0.01)
    assert history[9:14] == [(46, 2), (50, 4), (58, 8), (74, 16), (82, 8)]


def test_adpsgd_calibration_skips_the_warmup_steps():
    s = AdaptiveSchedule(_options(calibration_warmup=5), total_steps=30)
    history = _drive(s, 30, itertools.chain([9.0, 9.0, 9.0, 1.0, 3.0, 1.0], itertools.repeat(3.0)))
    # Syncs at 1, 3, 5 cover intervals starting at 0, 2, 4 < 5: ignored; 7 and 9 calibrate;
    # 11 (V = 1) grows the period to 4, then V = 3 holds it.
    assert history[:6] == [(1, 2), (3, 2), (5, 2), (7, 2), (9, 2), (11, 2)]
    assert s.target(0.1) == 2.0 and s.rule_period == 4


def test_adpsgd_lr2_target_follows_the_learning_rate():
    s = AdaptiveSchedule(_options(target="lr2", lr2_coef=100.0), total_steps=31)
    lrs = lambda step: 0.1 if step < 20 else 0.01
    history = _drive(s, 31, [0.5, 0.5, 0.5, 0.005, 0.015, 0.05, 0.5], lrs)
    # target 1 then 0.01, no calibration: grow, grow, grow (next at 29); the drop at step 20
    # resets the period to 2 (sync at once); then grow, hold, shrink; 30 is the last step.
    assert history == [(1, 2), (5, 4), (13, 8), (20, 2), (24, 4), (28, 4), (30, 2)]
    assert s.rule_period == 1 and s.next_sync is None
    assert s.target(0.01) == pytest.approx(0.01)


@pytest.mark.parametrize("borrow", [0.0, 0.25, 1.0])
def test_adpsgd_budget_never_exceeded_and_ends_averaged(borrow):
    rnd = random.Random(0)
    for budget_period in (2, 4, 8, 16):
        for total in (37, 100, 240):
            o = _options(budget_period=budget_period, budget_borrow=borrow, final_average=True)
            s = AdaptiveSchedule(o, total)
            budget = cpsgd_syncs(budget_period, total)
            lrs = lambda step, t=total: 0.1 if step < t // 2 else 0.01
            history = _drive(s, total, (rnd.choice([0.0, 0.5, 1.5, 9.0]) for _ in range(total)), lrs)
            assert len(history) <= budget
            assert history[-1][0] == total - 1  # the evaluated model is an average
            if borrow == 0.0:  # never ahead of the uniform pace
                line = budget - 1
                for k, (step, _) in enumerate(history[:-1], start=1):
                    assert k <= line * (step + 1) / total + 1e-9


# ---- determinism of the whole method on gloo ranks -----------------------------------------------
def _adpsgd_runs(rank, world, steps):
    out = []
    for seed in (5, 5, 6):
        algo = _make(ADPSGD, {"initial_period": 1, "calibration_syncs": 2, "budget_period": 3},
                     rank, world, seed, total_steps=steps, lr=lambda step: 0.1 if step < steps // 2 else 0.01
                     ).run(steps).algo
        out.append((list(algo.schedule.history), algo.comm.stats.totals()["reductions_global"],
                    algo.metrics(), algo.state_dict()))
    return out


def test_adpsgd_period_sequence_is_deterministic_and_identical_on_ranks(ranks):
    steps = 30
    results = [r["adpsgd"] for r in ranks]
    first, again, other = results[0]
    assert first[0] == again[0]  # same seed, same periods and variances
    assert [h[2] for h in first[0]] != [h[2] for h in other[0]]  # another seed measures others
    for r in results[1:]:
        assert r[0][0] == first[0]  # every rank takes the same decisions
    history, reductions, last_metrics, state = first
    assert reductions == len(history) <= cpsgd_syncs(3, steps)
    assert history[-1][0] == steps - 1
    assert all(v > 0 and math.isfinite(v) for _, _, v in history)
    assert last_metrics["syncs"] == len(history) and last_metrics["variance"] == history[-1][2]
    assert state["schedule"]["retightens"] == 1
    # A schedule restored from the state takes the same next decision.
    o = _options(initial_period=1, calibration_syncs=2, calibration_warmup=20, budget_period=3,
                 final_average=True)
    restored = AdaptiveSchedule(o, steps)
    restored.load_state_dict(copy.deepcopy(state["schedule"]))
    assert restored.history == history and restored.next_sync is None


def test_options_are_validated():
    with pytest.raises(ValueError, match="growth"):
        parse_options(ADPSGD.Options, {"growth": 1.0})
    with pytest.raises(ValueError, match="budget_period or budget_syncs"):
        parse_options(ADPSGD.Options, {"budget_period": 4, "budget_syncs": 10})
    with pytest.raises(ValueError, match="target"):
        parse_options(ADPSGD.Options, {"target": "other"})
    with pytest.raises(ValueError, match="period"):
        parse_options(CPSGD.Options, {"period": 0})
