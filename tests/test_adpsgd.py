"""CPSGD and ADPSGD: the variance probe against a dense computation, CPSGD against torch's
PeriodicModelAverager, the ADPSGD period rule on scripted variances, its budget, determinism."""

import copy
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from commlab.algorithms.adpsgd import ADPSGD, AdaptiveSchedule, drift_growth, rule_period
from commlab.algorithms.averaging import average_and_probe
from commlab.algorithms.base import parse_options
from commlab.algorithms.cpsgd import CPSGD
from commlab.algorithms.periodic import constant_syncs
from commlab.core import Communicator
from commlab.core.communicator import ring_allreduce_cost
from commlab.core.runtime import rank_generator
from commlab.loop.optim import lr_at
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
    assert constant_syncs(4, 16) == 4 and constant_syncs(4, 18) == 5 and constant_syncs(4, 18, False) == 4
    assert constant_syncs(4, 16, sync_at_first_step=True) == 5  # 0, 4, 8, 12 and the final step


# ---- the ADPSGD rule, without processes ----------------------------------------------------------
# Without momentum the growth model is a random walk, growth(L) = L, so V = rate * L and the rule's
# period is target / rate (within a factor 2 of the last one). Learning rates 0.5 and 0.125 keep
# every number below a power of two: the expected steps follow from the arithmetic in the comments.
def _options(**kw):
    base = {"initial_period": 4, "calibration_syncs": 2, "calibration_warmup": 0, "growth": 2.0, "shrink": 0.5,
            "max_period": 64, "final_average": False}
    base.update(kw)
    return parse_options(ADPSGD.Options, base)


def _drive(schedule, total, variances, lrs=None):
    """Feed the scripted variances at each synchronisation; return (step, period-in-force) pairs."""
    it = iter(variances)
    for step in range(total):
        lr = lrs(step) if lrs else 0.5
        schedule.observe_lr(step, lr)
        if schedule.due(step):
            schedule.after_sync(step, next(it), lr)
    return [(s, p) for s, p, _ in schedule.history]


def _rule_periods(schedule):
    return [d[4] for d in schedule.decisions]


def test_rule_period_is_the_longest_period_under_the_target():
    o, walk = _options(min_period=1, max_period=16), float
    assert rule_period(4, 0.5, 4.0, walk, o) == 8  # 0.5 * p <= 4 up to 8
    assert rule_period(4, 1.0, 4.0, walk, o) == 4  # on target: hold
    assert rule_period(8, 0.625, 4.0, walk, o) == 6  # 4 / 0.625 = 6.4
    assert rule_period(8, 2.0, 4.0, walk, o) == 4  # wants 2: at most halved
    assert rule_period(16, 0.0, 4.0, walk, o) == 16  # no drift: the longest, capped at max_period
    assert rule_period(1, 9.0, 4.0, walk, o) == 1  # floored at min_period
    assert rule_period(3, 0.01, 4.0, walk, _options(growth=1.1)) == 4  # always at least one step
    # With momentum: the longest p whose predicted V, rate * drift_growth(p), stays under the target.
    growth = lambda steps: drift_growth(steps, 0.9)  # noqa: E731
    assert rule_period(8, 1e-3, 1e-3 * growth(11), growth, o) == 11
    assert rule_period(8, 1e-3, 1e-3 * growth(11) * (1 - 1e-12), growth, o) == 10


def test_adpsgd_follows_v_on_scripted_variances():
    s = AdaptiveSchedule(_options(), total_steps=200)
    # Calibration at period 4: rates 1, 1 (V = 4, 4) give the target 4 at step 7 and the rule holds
    # 4; then rate 0.5 -> 8; 0.25 -> 16; 1 -> 4 wanted, halved to 8; 1 -> 4; 0.375 -> 10.7, doubled
    # to 8; 0.375 -> 10; 0.1 -> 40, doubled to 20; 0.1 -> 40; then V holds the target at 40.
    variances = [4.0, 4.0, 2.0, 2.0, 16.0, 8.0, 1.5, 3.0, 1.0, 2.0, 4.0, 4.0]
    history = _drive(s, 200, variances)
    assert [step for step, _ in history] == [3, 7, 11, 19, 35, 43, 47, 55, 65, 85, 125, 165]
    assert _rule_periods(s) == [4, 4, 8, 16, 8, 4, 8, 10, 20, 40, 40, 40]
    assert math.isnan(s.decisions[0][3]) and [d[3] for d in s.decisions[1:]] == [4.0] * 11
    assert s.next_sync is None  # 165 + 40 is past the end
    m = s.metrics()
    assert m["period"] == 40 and m["variance"] == 4.0 and m["target"] == 4.0 and m["syncs"] == 12
    assert m["last_sync"] == 165 and m["variance_rate"] == 0.1


def test_adpsgd_retightens_after_lr_drop_and_recalibrates():
    s = AdaptiveSchedule(_options(), total_steps=120)
    lrs = lambda step: 0.5 if step < 60 else 0.125  # noqa: E731
    script = [4.0, 4.0, 1.0, 2.0, 4.0, 2.0,  # rates 1, 1 (target 4), 0.25, 0.25, 0.25, 0.125
              0.5,  # at the drop, over steps 52-60: straddles it, judged by nobody
              1 / 16, 1 / 16,  # rate 1/64 twice at lr 0.125: target 4 * 1/64 = 1/16
              1 / 64, 1 / 32, 1 / 16, 1 / 16]  # rate 1/256: 8, 16, 16, 16
    history = _drive(s, 120, script, lrs)
    # 51 -> 32 (next at 83), but the drop at step 60 re-tightens to period 4: the sync comes at once.
    assert [step for step, _ in history] == [3, 7, 11, 19, 35, 51, 60, 64, 68, 72, 80, 96, 112]
    assert _rule_periods(s) == [4, 4, 8, 16, 16, 32, 4, 4, 4, 8, 16, 16, 16]
    targets = [d[3] for d in s.decisions]
    assert all(math.isnan(t) for t in targets[6:8]) and targets[8:] == [1 / 16] * 5
    assert s.retightens == 1


def test_adpsgd_calibration_skips_the_warmup_steps():
    s = AdaptiveSchedule(_options(initial_period=2, calibration_warmup=5), total_steps=30)
    history = _drive(s, 30, itertools.chain([9.0, 9.0, 9.0, 2.0, 2.0, 1.0], itertools.repeat(2.0)))
    # Syncs at 1, 3, 5 cover intervals starting at 0, 2, 4 < 5: ignored; 7 and 9 (rate 1) calibrate
    # the target 2 at period 2; 11 (rate 0.5) doubles the period, and V = 2 over 4 steps holds it.
    assert [step for step, _ in history][:7] == [1, 3, 5, 7, 9, 11, 15]
    assert s.target(0.5) == 2.0 and _rule_periods(s)[:7] == [2, 2, 2, 2, 2, 4, 4]


def test_adpsgd_momentum_warmup_is_the_default():
    s = AdaptiveSchedule(_options(calibration_warmup=None), total_steps=100, momentum=0.9)
    assert s.warmup == 10 and s.calibrate_from == 10
    assert AdaptiveSchedule(_options(calibration_warmup=None), total_steps=100).warmup == 0


def test_adpsgd_lr2_target_follows_the_learning_rate():
    s = AdaptiveSchedule(_options(target="lr2", lr2_coef=16.0), total_steps=60)
    lrs = lambda step: 0.5 if step < 30 else 0.125  # noqa: E731
    # target 16 * lr^2: 4, then 1/4. Rates 1, 0.25, 0.25 (no calibration); the drop at step 30
    # resets the period to 4 (sync at once, not judged); then rates 1/64, 1/16, 1/64, 1/64.
    history = _drive(s, 60, [4.0, 1.0, 2.0, 9.0, 1 / 16, 0.5, 1 / 16, 1 / 8], lrs)
    assert [step for step, _ in history] == [3, 7, 15, 30, 34, 42, 46, 54]
    assert _rule_periods(s) == [4, 8, 16, 4, 8, 4, 8, 16]
    assert s.next_sync is None and s.target(0.125) == 0.25 and s.retightens == 1


def _budget_affords():
    # Budget 5 with the final sync, no borrowing: the k-th of the other 4 no sooner than step 16k - 1.
    return AdaptiveSchedule(_options(initial_period=2, calibration_syncs=1, budget_syncs=5, budget_borrow=0.0,
                                     final_average=True), total_steps=64)


def test_adpsgd_takes_the_target_the_budget_affords():
    s = _budget_affords()
    history = _drive(s, 64, [16.0, 8.0, 4.0])
    # 15 (rate 1 over 16 steps at lr 0.5): calibrates the coefficient 1 / 0.25 * 2 = 8, the target
    # 8 * 0.25 = 2, the rule wants 2, the line defers to 31: the target rises to V at 16 steps, 16,
    # and the rule's next decision starts from 16. At 31 the rate halves: 32 (the line's 47 is no
    # later). At 63, the last step, rate 1/8: the rule would double to 64, but nothing follows.
    assert [step for step, _ in history] == [15, 31, 63]
    # (the rule's target, the rule's period, the period in force, deferred, the budget's target)
    assert s.decisions[0][3:] == (2.0, 2, 16, True, 16.0)
    assert s.decisions[1][3:7] == (16.0, 32, 32, False) and math.isnan(s.decisions[1][7])
    assert s.decisions[2][3:7] == (16.0, 64, 32, False) and math.isnan(s.decisions[2][7])


def test_adpsgd_logs_the_budget_deferral_apart_from_the_rule():
    """The rule's target and period keep the rule's decision; the budget's deferral is logged as
    its own values (``deferred``, ``budget_target``), at log points and per synchronisation."""
    s = _budget_affords()
    _drive(s, 16, [16.0])  # a log point right after the deferred decision at step 15
    m = s.metrics()
    assert (m["rule_period"], m["period"], m["target"]) == (2.0, 16.0, 2.0)
    _drive(s := _budget_affords(), 64, [16.0, 8.0, 4.0])
    assert s.sync_events() == [
        (15, {"variance": 16.0, "target": 2.0, "rule_period": 2.0, "period": 16.0, "deferred": 1.0,
              "budget_target": 16.0}),
        (31, {"variance": 8.0, "target": 16.0, "rule_period": 32.0, "period": 32.0, "deferred": 0.0}),
        (63, {"variance": 4.0, "target": 16.0, "rule_period": 64.0, "period": 32.0, "deferred": 0.0})]
    assert s.sync_events() == []  # each decision is handed out once


def test_adpsgd_calibrates_at_the_interval_mean_lr2_during_a_warmup():
    """Under an lr warm-up the rate a synchronisation measures is taken at the mean lr^2 of its
    interval: V = c_k * sum_(t in I_k) lr_t^2 (no momentum: drift(L) = L) has rate / mean lr^2 =
    c_k, so the calibration over I_1 = 0-3, I_2 = 4-7 at period 4 gives the coefficient
    4 * (c_1 + c_2) / 2 = 16 and the rule's period at each later synchronisation is the longest
    p with c_k * p <= 16 (at most doubled, at least halved); the target it logs is 16 times its
    interval's mean lr^2. The sync step's lr^2 (the interval's largest) would halve the period at
    step 7 to 2 instead of 3."""
    def lr(t):  # Goyal et al.'s warm-up, lr x (t + 1) / 16 over 16 steps, as the loop's lr_at
        return 0.4 * min(1.0, (t + 1) / 16)

    assert all(lr(t) == pytest.approx(lr_at(t, 8, 40, {"lr": 0.4, "warmup_epochs": 2})) for t in range(40))
    spreads = iter([3.0, 5.0, 3.5, 1.9, 0.9, 0.45])  # c_k per interval
    s = AdaptiveSchedule(_options(), total_steps=40)
    intervals = []
    for step in range(40):
        s.observe_lr(step, lr(step))
        if s.due(step):
            interval = range(s.last_sync + 1, step + 1)
            intervals.append(interval)
            s.after_sync(step, next(spreads) * sum(lr(t) ** 2 for t in interval), lr(step))
    # 16 / 5 = 3.2 -> 3; 16 / 3.5 = 4.6 -> 4; 16 / 1.9 = 8.4 -> 8; 16 / 0.9 = 17.8 -> 16 (doubled);
    # 16 / 0.45 = 35.6 -> 32 (doubled)
    assert [d[0] for d in s.decisions] == [3, 7, 10, 14, 22, 38]
    assert _rule_periods(s) == [4, 3, 4, 8, 16, 32]
    assert s.target_value == pytest.approx(4 * (3.0 + 5.0) / 2, rel=1e-12)
    mean_lr2 = [sum(lr(t) ** 2 for t in interval) / len(interval) for interval in intervals]
    assert math.isnan(s.decisions[0][3])
    assert [d[3] for d in s.decisions[1:]] == pytest.approx([16 * m for m in mean_lr2[1:]], rel=1e-12)


@pytest.mark.parametrize("borrow", [0.0, 0.25, 1.0])
def test_adpsgd_budget_never_exceeded_and_ends_averaged(borrow):
    rnd = random.Random(0)
    for budget_period in (2, 4, 8, 16):
        for total in (37, 100, 240):
            o = _options(budget_period=budget_period, budget_borrow=borrow, final_average=True)
            s = AdaptiveSchedule(o, total)
            budget = constant_syncs(budget_period, total)
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
    assert reductions == len(history) <= constant_syncs(3, steps)
    assert history[-1][0] == steps - 1
    assert all(v > 0 and math.isfinite(v) for _, _, v in history)
    assert last_metrics["syncs"] == len(history) and last_metrics["variance"] == history[-1][2]
    assert state["schedule"]["retightens"] == 1
    # A schedule restored from the state takes the same next decision.
    o = parse_options(ADPSGD.Options, {"initial_period": 1, "calibration_syncs": 2, "budget_period": 3})
    restored = AdaptiveSchedule(o, steps, TRAIN["momentum"])
    restored.load_state_dict(copy.deepcopy(state["schedule"]))
    assert restored.history == history and restored.next_sync is None
    assert restored.decisions == [tuple(d) for d in state["schedule"]["decisions"]]


def test_options_are_validated():
    with pytest.raises(ValueError, match="growth"):
        parse_options(ADPSGD.Options, {"growth": 1.0})
    with pytest.raises(ValueError, match="budget_period or budget_syncs"):
        parse_options(ADPSGD.Options, {"budget_period": 4, "budget_syncs": 10})
    with pytest.raises(ValueError, match="target"):
        parse_options(ADPSGD.Options, {"target": "other"})
    with pytest.raises(ValueError, match="period"):
        parse_options(CPSGD.Options, {"period": 0})
    with pytest.raises(ValueError, match=r"initial_period must lie in \[min_period, max_period\] = \[2, 64\], got 1"):
        parse_options(ADPSGD.Options, {"initial_period": 1, "min_period": 2})
    with pytest.raises(ValueError, match="retighten_period must be at least 1"):
        parse_options(ADPSGD.Options, {"retighten_period": 0})
    with pytest.raises(ValueError, match="unknown option.*grow_below"):
        parse_options(ADPSGD.Options, {"grow_below": 1.0})
