"""ADPSGD's schedule on scripted variances (no processes), at the settings the grids run it at
(config/papers/adpsgd.yaml, every scale, and the laptop grid re-planned to the whole training set):
the rule decides the synchronisations (V falling: the period lengthens; V rising: it shortens), the
calibration completes well before the first decay and again after it, the period re-tightens at
the decay, the budget holds; at the laptop grid's settings, the synchronisations and periods of a
falling and of a growing V against the budget line alone (the schedule of a rule that never
changes its period); the growth model against a brute-force momentum recursion; the schedule's
state resumes bit for bit."""

from __future__ import annotations

import copy
import functools
import io
import itertools
import math
from pathlib import Path

import pytest
import torch
import yaml

from commlab.algorithms import adpsgd
from commlab.algorithms.adpsgd import ADPSGD, AdaptiveSchedule, drift_growth
from commlab.algorithms.base import parse_options
from commlab.algorithms.periodic import constant_syncs
from commlab.grid import load_grid_file, resolve_grid
from commlab.loop.optim import lr_at

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ROOT / "config" / "papers"
DEFAULTS_OF_RUNS = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["defaults"]  # as `commlab grid`
TRAINING_SET = {"fashion_mnist": 60_000, "cifar10": 50_000}  # images, for the scales with train_subset: null
# Every scale but smoke, a 32-step check of the pipeline's plumbing.
SCALES = ["laptop", *(scale for scale in load_grid_file("adpsgd", PAPERS)["scales"] if scale != "smoke")]


@functools.cache
def _grid(scale: str) -> dict:
    return resolve_grid("adpsgd", DEFAULTS_OF_RUNS, scale=scale, papers_dir=PAPERS)


def _plan(config: dict) -> dict:
    """What the loop derives from a run config: steps, the lr of every step, the momentum."""
    train = config["train"]
    samples = train.get("train_subset") or TRAINING_SET[config["dataset"]]
    steps_per_epoch = samples // (config["workers"] * train["batch_size"])
    total = steps_per_epoch * train["epochs"]
    lrs = [lr_at(step, steps_per_epoch, total, train) for step in range(total)]
    drops = [step for step in range(1, total) if lrs[step] < 0.5 * lrs[step - 1]]
    options = parse_options(ADPSGD.Options, config.get("method_params"))
    return {"options": options, "total": total, "lrs": lrs, "drops": drops, "momentum": train["momentum"]}


def _adpsgd_runs(scale: str) -> list[tuple[str, dict]]:
    """One plan per ADPSGD run of the scale (the seeds share it)."""
    runs = {name: config for (name, _), config in _grid(scale).items() if config["method"] == "adpsgd"}
    return [(f"{scale}/{name}", _plan(config)) for name, config in runs.items()]


def _longer_laptop() -> tuple[str, dict]:
    """The laptop grid's ADPSGD run re-planned to the whole training set (its epochs and decay)."""
    config = copy.deepcopy(_grid("laptop")[("adpsgd_b16", 0)])
    config["train"]["train_subset"] = None
    return "laptop/adpsgd_b16 on 60,000 samples", _plan(config)


RUNS = [run for scale in SCALES for run in _adpsgd_runs(scale)] + [_longer_laptop()]


def _schedule(plan: dict) -> AdaptiveSchedule:
    return AdaptiveSchedule(plan["options"], plan["total"], plan["momentum"],
                            velocity_kept=plan["options"].optimizer_state == "keep_local")


def _drive(schedule: AdaptiveSchedule, plan: dict, spread, until: int | None = None, start: int = 0):
    """Run the schedule from ``start`` to ``until``; at each synchronisation V is what replicas
    drifting apart by ``lr * spread(step)`` a step give over the interval (the drift model of
    step 1 of the adpsgd module's docstring)."""
    for step in range(start, plan["total"] if until is None else until):
        lr = plan["lrs"][step]
        schedule.observe_lr(step, lr)
        if schedule.due(step):
            first = schedule.last_sync + 1
            rate = sum((plan["lrs"][t] * spread(t)) ** 2 for t in range(first, step + 1)) / (step + 1 - first)
            schedule.after_sync(step, rate * schedule.drift(step + 1 - first), lr)
    return schedule


def _falling(plan):
    half = plan["drops"][0] / 4  # the spread halves four times before the first decay
    return lambda step: 2.0 ** (-step / half)


def _rising(plan):
    half = plan["drops"][0] / 4
    return lambda step: 2.0 ** (step / half)


def _before(schedule, step):
    return [d for d in schedule.decisions if d[0] < step]


def _starts(schedule, until: int) -> list[int]:
    """The period each decision before step ``until`` (no decay before it) started from (step 5
    of the adpsgd module's docstring): the initial period, then the rule's last decision, or,
    after a deferral that raised the target, the period the budget line set (at most
    max_period)."""
    start, starts = schedule.initial_period, []
    for d in _before(schedule, until):
        starts.append(start)
        start = min(schedule.options.max_period, d[5]) if not math.isnan(d[7]) else d[4]
    return starts


def _moves(schedule, until: int) -> list[int]:
    """How far each of the rule's decisions after its calibration, before step ``until``, moved
    the period from where it started (+: longer)."""
    return [d[4] - start for d, start in zip(_before(schedule, until), _starts(schedule, until), strict=True)
            if not math.isnan(d[3])]


@pytest.mark.parametrize("name,plan", RUNS, ids=[r[0] for r in RUNS])
def test_the_rule_decides_at_every_grid_setting(name, plan):
    decay = plan["drops"][0]
    falling, rising = _drive(_schedule(plan), plan, _falling(plan)), _drive(_schedule(plan), plan, _rising(plan))
    for schedule in (falling, rising):
        calibrated = [d[0] for d in schedule.decisions if not math.isnan(d[3])]
        assert calibrated and calibrated[0] < decay / 3, "the calibration completes well before the decay"
        assert len(schedule.history) <= constant_syncs(plan["options"].budget_period, plan["total"])
        assert schedule.history[-1][0] == plan["total"] - 1
    steps = {label: [d[0] for d in _before(s, decay)] for label, s in (("falling", falling), ("rising", rising))}
    assert steps["falling"] != steps["rising"], "the synchronisations follow V, not only the budget"
    assert len(steps["falling"]) < len(steps["rising"])  # V falling: fewer synchronisations
    # The rule's own decisions after the calibration, each from the period it started from: V
    # falling lengthens the period (or holds it), V rising shortens it (or holds it), each at
    # least once. A rule that keeps its period, or a constant one, fails one or the other.
    lengthened, shortened = _moves(falling, decay), [-move for move in _moves(rising, decay)]
    assert min(lengthened) >= 0 and max(lengthened) > 0
    assert min(shortened) >= 0 and max(shortened) > 0


@pytest.mark.parametrize("name,plan", RUNS, ids=[r[0] for r in RUNS])
def test_the_period_retightens_and_recalibrates_after_each_decay(name, plan):
    schedule = _drive(_schedule(plan), plan, _falling(plan))
    assert schedule.retightens == len(plan["drops"])
    bounds = [*plan["drops"], plan["total"]]
    for drop, end in itertools.pairwise(bounds):
        before = [d for d in schedule.decisions if d[0] < drop]
        after = [d for d in schedule.decisions if drop <= d[0] < end]
        # Re-tightened: the first period after the decay is shorter than the last one before it.
        assert after[0][4] < before[-1][4]
        if plan["options"].target == "calibrate":
            assert math.isnan(after[0][3])  # the straddling interval calibrates nothing
        judged = [d for d in after if not math.isnan(d[3]) and d[0] < end - 1]
        assert judged, "the target is known again before the next decay or the end"
        assert judged[0][0] - drop < (end - drop) / 2


LAPTOP = _plan(_grid("laptop")[("adpsgd_b16", 0)])  # 192 steps, budget period 16, the decay at step 128


def _budget_line_alone(plan: dict) -> list[int]:
    """The synchronisations of a rule that never changes its period, from step 5 of the adpsgd
    module's docstring: the k-th of the B' = B - 1 on the line at the initial period after the
    last one, but no sooner than the step at which the progress (step + 1) / T reaches
    (k / B' - b) / (1 - b)."""
    options, total = plan["options"], plan["total"]
    line = constant_syncs(options.budget_period, total) - 1
    initial = options.budget_period // 2
    steps = []
    for k in range(1, line + 1):
        earliest = math.ceil(total * (k / line - options.budget_borrow) / (1 - options.budget_borrow) - 1e-9) - 1
        steps.append(max((steps[-1] if steps else -1) + initial, earliest))
    return steps


def _sync_steps(plan: dict, spread) -> list[int]:
    return [d[0] for d in _drive(_schedule(plan), plan, spread).decisions]


def test_the_laptop_grid_schedule_leaves_the_budget_line_when_v_falls(monkeypatch):
    """At the laptop grid's settings (budget period 16: 12 synchronisations, the last step's
    reserved; borrowing 0.25; initial period 8) the budget line alone gives 7, 15, 23, 31 (the
    calibration's period), then 52, 75, 98, 122, 145, 168, 191 (the line's). A falling V leaves
    it: the rule lengthens the period to 32 at step 52 and 64 at step 84, and the decay at step
    128 re-tightens it to 8. A flat V, and a growing one (whose shorter periods the line holds
    back: the next test), keep to it."""
    plan = LAPTOP
    assert (plan["total"], plan["options"].budget_period, plan["drops"], plan["momentum"]) == (192, 16, [128], 0.9)
    line = _budget_line_alone(LAPTOP)
    assert line == [7, 15, 23, 31, 52, 75, 98, 122, 145, 168, 191]
    assert _sync_steps(LAPTOP, _falling(LAPTOP)) == [7, 15, 23, 31, 52, 84, 128, 136, 145, 168, 191]
    assert _sync_steps(LAPTOP, lambda step: 1.0) == line
    assert _sync_steps(LAPTOP, _rising(LAPTOP)) == line
    # The line alone is what a rule that never changes its period gives, whatever V does.
    monkeypatch.setattr(adpsgd, "rule_period", lambda period, rate, target, drift, options: period)
    for spread in (_falling(LAPTOP), _rising(LAPTOP), lambda step: 1.0):
        assert _sync_steps(LAPTOP, spread) == line


def test_a_growing_v_shortens_the_rule_period_at_the_laptop_grid():
    """At the laptop grid's settings, V growing (its spread doubling every 32 steps): after the
    calibration (complete at step 31) every decision of the rule before the decay shortens the
    period it started from, 8 -> 7, 21 -> 13, 23 -> 12, 23 -> 12, 24 -> 12, while the budget line,
    which the run is ahead of, defers each to its own pace (21, 23, 23, 24, 23 in force). At the
    decay the period resets to 8; the interval straddling it (to step 145) is judged by nobody,
    the next (to step 168) calibrates, and at the last step the rule shortens to 6. V falling to
    step 52, then doubling every 8 steps, spends what the falling part saved: the rule's 32 at
    step 52 halves to 16 at step 84, which the line allows (the next sync at step 100), then to
    8, which the line defers to step 122."""
    growing = _drive(_schedule(LAPTOP), LAPTOP, _rising(LAPTOP))
    assert [d[0] for d in growing.decisions] == [7, 15, 23, 31, 52, 75, 98, 122, 145, 168, 191]
    assert [d[4] for d in growing.decisions] == [8, 8, 8, 7, 13, 12, 12, 12, 8, 8, 6]  # the rule's
    assert [d[5] for d in growing.decisions] == [8, 8, 8, 21, 23, 23, 24, 23, 23, 23, 23]  # in force
    assert [d[6] for d in growing.decisions] == [False] * 3 + [True] * 7 + [False]  # deferred
    assert _starts(growing, 128)[3:] == [8, 21, 23, 23, 24] and _moves(growing, 128) == [-1, -8, -11, -11, -12]

    def turning(step):
        return 2.0 ** (-step / 32) if step < 52 else 2.0 ** (-52 / 32 + (step - 52) / 8)

    turned = _drive(_schedule(LAPTOP), LAPTOP, turning)
    assert [d[0] for d in turned.decisions] == [7, 15, 23, 31, 52, 84, 100, 122, 145, 168, 191]
    assert [d[4] for d in turned.decisions] == [8, 8, 8, 8, 32, 16, 8, 11, 8, 8, 5]
    assert [d[5] for d in turned.decisions] == [8, 8, 8, 21, 32, 16, 22, 23, 23, 23, 23]


# ---- the growth model against the momentum recursion --------------------------------------------
def _growth_by_recursion(steps: int, momentum: float, velocity_kept: bool) -> float:
    """Var(x_L) of x_t = x_(t-1) + v_t, v_t = m v_(t-1) + g_t with unit-variance g, x_0 = 0 and
    v_0 stationary (kept) or 0: the covariance of (x, v) carried step by step."""
    a = torch.tensor([[1.0, momentum], [0.0, momentum]], dtype=torch.float64)
    q = torch.ones(2, 2, dtype=torch.float64)
    v0 = 1 / (1 - momentum**2) if velocity_kept else 0.0
    cov = torch.tensor([[0.0, 0.0], [0.0, v0]], dtype=torch.float64)
    for _ in range(steps):
        cov = a @ cov @ a.T + q
    return cov[0, 0].item()


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("velocity_kept", [True, False])
def test_drift_growth_equals_the_momentum_recursion(momentum, velocity_kept):
    for steps in (1, 2, 3, 7, 16, 23, 64, 200):
        expected = _growth_by_recursion(steps, momentum, velocity_kept)
        assert drift_growth(steps, momentum, velocity_kept) == pytest.approx(expected, rel=1e-9)
    assert drift_growth(0, momentum, velocity_kept) == 0.0


# ---- resume ------------------------------------------------------------------------------------
def _saved(schedule: AdaptiveSchedule) -> dict:
    """The schedule's state as a checkpoint holds it (through torch.save and torch.load)."""
    buffer = io.BytesIO()
    torch.save(schedule.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _bits(records: list[tuple]) -> list[tuple]:
    """Records with every float as its exact bits (NaN equals NaN)."""
    return [tuple(x.hex() if isinstance(x, float) else x for x in record) for record in records]


# The laptop run, the paper's first (its calibration falls in the lr warm-up) and the longer laptop one.
RESUMED = [RUNS[0], next(run for run in RUNS if run[0].startswith("paper/")), RUNS[-1]]


@pytest.mark.parametrize("name,plan", RESUMED, ids=[run[0] for run in RESUMED])
def test_the_schedule_resumes_bit_for_bit(name, plan):
    spread = _falling(plan)
    whole = _drive(_schedule(plan), plan, spread)
    sync_steps = [d[0] for d in whole.decisions]
    calibrating = next(d[0] for d in whole.decisions if not math.isnan(d[3]))
    drop = plan["drops"][0]
    cuts = sorted({1, sync_steps[1], calibrating - 1, calibrating + 1, drop, drop + 1, plan["total"] - 2})
    for cut in cuts:
        first = _drive(_schedule(plan), plan, spread, until=cut)
        first.sync_events()  # what a log point handed out before the checkpoint
        resumed = _schedule(plan)
        resumed.load_state_dict(_saved(first))
        _drive(resumed, plan, spread, start=cut)
        assert _bits(resumed.decisions) == _bits(whole.decisions)
        assert _bits(resumed.history) == _bits(whole.history) and resumed.metrics() == whole.metrics()
        # The decisions taken after the checkpoint are handed out once, after the resume.
        assert [step for step, _ in resumed.sync_events()] == [d[0] for d in whole.decisions if d[0] >= cut]
