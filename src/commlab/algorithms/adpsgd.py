"""ADPSGD: periodic parameter averaging with an adaptive period (Jiang & Agrawal, "Adaptive
Periodic Averaging", arXiv 2007.06134).

No code was released. The abstract gives the principle: the variance of the parameters across
nodes governs the convergence of periodic averaging, so under a fixed communication budget one
synchronises often early, while that variance is large, and rarely later. The rule below is our
reconstruction of it; what is ours rather than the paper's is listed at the end.

A member of the periodic-averaging family (:mod:`commlab.algorithms.periodic`), averaging as its
constant-period baseline CPSGD does (:mod:`commlab.algorithms.cpsgd`): local optimizer steps and,
at a synchronisation, one allreduce of all parameters and floating buffers (and, with
``optimizer_state: average``, the optimizer's momentum), then the variance::

    V = mean_i || x_i - x_bar ||^2      (sum over all parameters, mean over the P ranks)

with one extra scalar allreduce, part of the same global reduction: after the model allreduce
gives ``x_bar``, each rank computes ``||x_i - x_bar||^2`` from its own pre-average copy and the
scalar is averaged.

The options use the family's names (:class:`~commlab.algorithms.periodic.FamilyOptions`):
``buffers`` and ``optimizer_state`` (``average`` | ``keep_local``) and ``final_average``; the
paper's ``average_buffers`` and ``average_momentum`` (true | false) are accepted as aliases.
Every run logs ``schedule.kind`` (``adaptive``), ``schedule.period`` and
``schedule.local_period`` (both its initial period) as params.

``adpsgd``, at each synchronisation (every constant an option):

1. Drift: V after L local steps is ``rate * drift(L)`` (:func:`drift_growth`: a random walk
   of the gradient differences filtered by the optimizer's momentum, with the velocity carried
   across the average under ``keep_local``). Each synchronisation measures
   ``rate = V / drift(L)`` over its interval L, whatever set that length, so that intervals the
   budget stretched or a decay cut short are judged alike.
2. Calibration: the run starts at ``initial_period`` (by default half the budget's period). The
   first ``calibration_syncs`` synchronisations whose interval starts at or after step
   ``calibration_warmup`` (by default 1 / (1 - momentum): a momentum buffer that starts at zero
   understates the drift until then) set the target: ``target_scale`` times the variance their
   mean rate gives at the calibration's period. The rate scales with lr^2, so the target is kept
   as a coefficient of lr^2 and moves with the learning rate (an lr warm-up, a cosine decay)
   between calibrations; ``lr2_coef`` gives the coefficient instead (``target: lr2``).
3. The rule: the next period is the longest whose predicted variance ``rate * drift(p)`` stays
   at or under the target, at most ``growth`` times the current period and at least ``shrink``
   times it (always at least one step either way), within ``[min_period, max_period]``. While
   the rate is high the period shortens; as gradients and their spread shrink, it lengthens.
4. Learning-rate decay: when a step's lr is below ``lr_drop_ratio`` times the previous step's,
   the period resets to ``retighten_period`` (default: the initial period) and the next
   synchronisation comes at most that many steps after the last one. With ``target: calibrate``
   the target is calibrated anew from the first intervals that start after the drop (the one
   straddling it mixes both learning rates and is judged by neither the calibration nor the
   rule); with ``target: lr2`` the coefficient is kept and the target follows lr^2.
5. Budget: with ``budget_period`` (or ``budget_syncs``) the run never exceeds B, the number of
   synchronisations CPSGD at that period makes over the run. The last step's synchronisation is
   reserved (with ``final_average``); the other B' = B - 1 follow a budget line: the k-th may
   happen only once the progress (step + 1) / T reaches (k / B' - b) / (1 - b), where b is
   ``budget_borrow``, the fraction of the budget that may be spent ahead of the uniform pace
   (0: never ahead of CPSGD; 1: no pacing). When the line defers a synchronisation the rule
   asked for, the target rises to the variance predicted at the deferred step and the rule
   takes that period: the target becomes the level of variance this budget affords, and from
   there the rule lengthens the period as the rate falls. The line only holds syncs back; what a
   long period saves is spent later, after a re-tightening.
6. With ``final_average`` the last step is always a synchronisation.

The decisions depend only on the measured variances and the lr schedule, which are the same on
every rank (V comes from an allreduce), so every rank takes the same decisions and the sequence
is deterministic for a seed. ADPSGD logs, at each log point, ``period`` (in force), ``rule_period``
(the rule's), ``variance``, ``variance_rate`` and ``target`` of the last synchronisation with its
step ``last_sync``, and ``syncs`` and ``retightens``; :meth:`ADPSGD.sync_events` hands out every
decision with the step it was taken at.

Ours, not the paper's (this reconstruction works from the paper's abstract, which gives neither a
formula nor constants): the drift model of step 1 (so that V measured over intervals of different
lengths can be compared); the calibration and its constants (2 synchronisations, the momentum
warm-up, half the budget's period) and the target's lr^2 scaling; the rule's form of step 3 and
its step limits; the re-tightening after a decay of step 4 (the abstract does not mention decays;
shortening the period when the lr drops follows AdaComm, Wang & Joshi, 2018); the budget line
and the target that rises to what the budget affords (the paper compares methods at equal
communication; how a run keeps to a budget is ours).

Usage (run config fragments)::

    method: adpsgd
    method_params: {budget_period: 16}                 # initial period 8, calibrated target
    method_params: {budget_period: 16, target: lr2}    # the target follows lr^2 across decays
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.periodic import FamilyOptions, Schedule, VarianceAveraging, constant_syncs
from commlab.registry import ALGORITHMS

TARGETS = ("calibrate", "lr2")


def drift_growth(steps: int, momentum: float = 0.0, velocity_kept: bool = True) -> float:
    """How V grows over ``steps`` local steps after an average, in units of (lr * s)^2, where s^2
    is the variance of one step's gradient difference between replicas (step 1 of the module
    docstring).

    Momentum SGD moves a replica by ``lr * v_t`` with ``v_t = m * v_(t-1) + g_t``, so the
    difference of two replicas after L steps is ``lr`` times a sum of L velocities. With
    independent gradient differences of variance s^2 its variance is s^2 times::

        sum_(j=1..L) ((1 - m^j) / (1 - m))^2                       noise of the interval
        + (m (1 - m^L) / (1 - m))^2 / (1 - m^2)                    velocity carried over the average

    the second term only when each replica keeps its own momentum across an average
    (``optimizer_state: keep_local``: the velocity difference is then stationary). Without
    momentum this is L, a random walk; with momentum m = 0.9 it grows like L^2 over the first
    1 / (1 - m) steps and like L after."""
    if steps <= 0:
        return 0.0
    m, n = momentum, steps
    if m == 0:
        return float(n)
    noise = (n - 2 * m * (1 - m**n) / (1 - m) + m * m * (1 - m ** (2 * n)) / (1 - m * m)) / (1 - m) ** 2
    carried = (m * (1 - m**n) / (1 - m)) ** 2 / (1 - m * m) if velocity_kept else 0.0
    return noise + carried


def rule_period(period: int, rate: float, target: float, drift, options) -> int:
    """Step 3 of the module docstring: the longest period whose predicted variance
    ``rate * drift(p)`` stays at or under ``target`` (``drift``: :func:`drift_growth` of the
    run), within one step of the rule (at most ``options.growth`` times longer, at least
    ``options.shrink`` times shorter, always at least one step either way) and within
    ``[min_period, max_period]``."""
    shortest = max(options.min_period, min(period - 1, math.floor(options.shrink * period)))
    longest = min(options.max_period, max(period + 1, math.ceil(options.growth * period)))
    if not rate > 0:  # the replicas did not drift apart: nothing calls for an average
        return longest
    chosen = shortest
    for candidate in range(shortest, longest + 1):
        if rate * drift(candidate) > target:
            break
        chosen = candidate
    return chosen


def momentum_warmup(momentum: float) -> int:
    """Steps a momentum buffer that starts at zero takes to build up: 1 / (1 - m)."""
    return math.ceil(1 / (1 - momentum) - 1e-9) if momentum > 0 else 0


class AdaptiveSchedule(Schedule):
    """ADPSGD's period controller (steps 1-6 of the module docstring), free of processes: the
    family's hooks (``observe_lr``, ``due``, ``after_sync``) drive it in a run, a test drives it
    with scripted variances.

    Args:
        options: :class:`ADPSGD.Options`.
        total_steps: the run's optimizer steps.
        momentum: the optimizer's momentum (Adam: beta1), for :func:`drift_growth` and the
            calibration's default warm-up.
        velocity_kept: whether each replica keeps its momentum across an average
            (``optimizer_state: keep_local``)."""

    kind = "adaptive"

    def __init__(self, options, total_steps: int, momentum: float = 0.0, velocity_kept: bool = True):
        self.options, self.total_steps = options, total_steps
        self.budget = options.budget_syncs
        if options.budget_period is not None:
            self.budget = constant_syncs(options.budget_period, total_steps, options.final_average)
        initial = options.initial_period if options.initial_period is not None else self._default_initial_period()
        super().__init__(initial)
        self.momentum, self.velocity_kept = momentum, velocity_kept
        self.warmup = momentum_warmup(momentum) if options.calibration_warmup is None else options.calibration_warmup
        self.rule_period = self.initial_period  # the rule's period
        self.period = self.initial_period  # the period in force (after the budget line)
        self.syncs, self.last_sync, self.retightens = 0, -1, 0
        self.variance, self.prev_lr = math.nan, None
        self.target_value: float | None = options.lr2_coef  # the target's coefficient of lr^2 (None: calibrating)
        self.calibration: list[float] | None = [] if self.target_value is None else None
        self.calibrate_from = self.warmup  # first step of an interval the calibration may use
        self.clean_from = 0  # first step of an interval the rule may judge (after the last lr drop)
        # Per synchronisation: (step, V, rate, target, the rule's period, the period in force).
        self.decisions: list[tuple[int, float, float, float, int, int]] = []
        self.reported = 0  # decisions already handed out by sync_events()
        self.history: list[tuple[int, int, float]] = []
        self.next_sync = self._schedule_from(-1)

    def _default_initial_period(self) -> int:
        """Half the budget's own period (its uniform pace), within ``[min_period, max_period]``;
        2 without a budget."""
        options = self.options
        if self.budget is None:
            return max(options.min_period, min(options.max_period, 2))
        pace = options.budget_period or self.total_steps // self.budget
        return max(options.min_period, min(options.max_period, pace // 2))

    # ---- the pieces -----------------------------------------------------------------------------
    def drift(self, steps: int) -> float:
        """:func:`drift_growth` over ``steps`` steps with this run's momentum."""
        return drift_growth(steps, self.momentum, self.velocity_kept)

    def target(self, lr: float) -> float:
        """The variance target at learning rate ``lr`` (NaN while calibrating)."""
        return math.nan if self.target_value is None else self.target_value * lr**2

    def _schedule_from(self, step: int) -> int | None:
        """Next synchronisation step after one at ``step`` (-1: the start); None: no more."""
        remaining = self.total_steps - 1 - step
        self.deferred = False  # whether the budget line, not the rule, sets the next interval
        if remaining <= 0:
            return None
        period = self.rule_period
        if self.budget is not None:
            # The last step's synchronisation is reserved; the others follow the budget line.
            line = self.budget - (1 if self.options.final_average else 0)
            if self.syncs + 1 > line:
                if not self.options.final_average:
                    return None
                period = remaining
            elif self.options.budget_borrow < 1:
                share = (self.syncs + 1) / line
                progress = (share - self.options.budget_borrow) / (1 - self.options.budget_borrow)
                earliest = math.ceil(self.total_steps * progress - 1e-9) - 1
                self.deferred = earliest - step > period
                period = max(period, earliest - step)
        if self.options.final_average:
            period = min(period, remaining)
        self.period = period
        return step + period if step + period <= self.total_steps - 1 else None

    # ---- the hooks ------------------------------------------------------------------------------
    def observe_lr(self, step: int, lr: float) -> None:
        """Step 4: a step whose lr is below ``lr_drop_ratio`` times the last one's is a decay."""
        dropped = self.prev_lr is not None and lr < self.options.lr_drop_ratio * self.prev_lr
        self.prev_lr = lr
        if not dropped:
            return
        self.clean_from = step  # the interval straddling the drop mixes both learning rates
        if not self.options.retighten:
            return
        self.retightens += 1
        self.rule_period = self.options.retighten_period or self.initial_period
        if self.options.target == "calibrate" or self.calibration is not None:
            self.calibration = []
            self.calibrate_from = step
            if self.options.target == "calibrate":
                self.target_value = None
        following = self._schedule_from(self.last_sync)
        self.next_sync = None if following is None else max(step, following)

    def due(self, step: int) -> str | None:
        return "global" if self.next_sync is not None and step == self.next_sync else None

    def after_sync(self, step: int, variance: float, lr: float) -> None:
        self.syncs += 1
        start, self.last_sync, self.variance = self.last_sync + 1, step, variance
        self.history.append((step, self.period, variance))
        rate = variance / self.drift(step - start + 1)
        if self.calibration is not None and start >= self.calibrate_from and lr > 0:
            self.calibration.append(rate / lr**2)
            if len(self.calibration) >= self.options.calibration_syncs:
                mean = sum(self.calibration) / len(self.calibration)
                self.target_value = self.options.target_scale * mean * self.drift(self.rule_period)
                self.calibration = None
        if self.calibration is None and start >= self.clean_from:
            self.rule_period = rule_period(self.rule_period, rate, self.target(lr), self.drift, self.options)
        self.next_sync = self._schedule_from(step)
        if self.deferred and self.calibration is None and lr > 0:
            # The budget line deferred the rule's synchronisation: the rule takes the variance it
            # will reach by then as its target (the level this budget affords) and that period.
            self.target_value = rate * self.drift(self.period) / lr**2
            self.rule_period = min(self.options.max_period, self.period)
        self.decisions.append((step, variance, rate, self.target(lr), self.rule_period, self.period))

    def metrics(self) -> dict[str, float]:
        out = {"period": float(self.period), "rule_period": float(self.rule_period), "syncs": float(self.syncs),
               "retightens": float(self.retightens)}
        if self.decisions:
            step, variance, rate, target, _, _ = self.decisions[-1]
            out.update(last_sync=float(step), variance=variance, variance_rate=rate)
            if not math.isnan(target):
                out["target"] = target
        return out

    def sync_events(self) -> list[tuple[int, dict[str, float]]]:
        """The decisions taken since the last call, each with its synchronisation's step: V, the
        target (left out while calibrating), the rule's period and the period in force."""
        events = []
        for step, variance, _, target, chosen, in_force in self.decisions[self.reported:]:
            values = {"variance": variance, "rule_period": float(chosen), "period": float(in_force)}
            if not math.isnan(target):
                values["target"] = target
            events.append((step, values))
        self.reported = len(self.decisions)
        return events

    _STATE = ("rule_period", "period", "syncs", "last_sync", "retightens", "variance", "prev_lr",
              "target_value", "calibration", "calibrate_from", "clean_from", "next_sync", "history",
              "decisions", "reported")

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.decisions = [tuple(d) for d in self.decisions]


# ---- the method ---------------------------------------------------------------------------------
@ALGORITHMS.register("adpsgd")
class ADPSGD(VarianceAveraging):
    """Adaptive-period parameter averaging driven by the measured parameter variance."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "periodic"
    host_sync_budget = SyncBudget({"local": 0, "reduction": 1})  # a reduction reads V, which the rule decides on
    quick_run = QuickRun({"initial_period": 2, "calibration_syncs": 2, "calibration_warmup": 2})
    resume = ResumeState("the rule's period, target and calibration, and every decision taken")

    @dataclass
    class Options(FamilyOptions):
        """ADPSGD's options (after the family's; aliases: :class:`FamilyOptions`)."""

        initial_period: int | None = None  # the calibration's period and the rule's start (None: half the budget's)
        min_period: int = 1  # the rule never goes below this
        max_period: int = 64  # the rule never goes above this (the budget line may)
        growth: float = 2.0  # the rule lengthens the period at most this many times per decision
        shrink: float = 0.5  # and shortens it to no less than this fraction
        target: str = "calibrate"  # calibrate: re-calibrated after each lr decay; lr2: calibrated once (or lr2_coef)
        calibration_syncs: int = 2  # synchronisations the calibration averages
        calibration_warmup: int | None = None  # steps the first calibration skips (None: 1 / (1 - momentum))
        target_scale: float = 1.0  # multiplies the calibrated target (or coefficient)
        lr2_coef: float | None = None  # target: lr2: the target's coefficient of lr^2 (None: calibrate it)
        retighten: bool = True  # reset the period (and re-calibrate) when the lr drops
        retighten_period: int | None = None  # period after an lr drop (None: initial_period)
        lr_drop_ratio: float = 0.5  # lr below this fraction of the previous step's is a drop
        budget_period: int | None = None  # at most as many syncs as cpsgd at this period
        budget_syncs: int | None = None  # or at most this many syncs (not with budget_period)
        budget_borrow: float = 0.25  # budget fraction that may be spent ahead of the uniform pace

        def validate(self) -> None:
            super().validate()
            for name in ("initial_period", "min_period", "max_period", "calibration_syncs", "retighten_period",
                         "budget_period", "budget_syncs"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    raise ValueError(f"{name} must be at least 1, got {value}")
            if self.min_period > self.max_period:
                raise ValueError(f"need min_period <= max_period, got {self.min_period}, {self.max_period}")
            for name in ("initial_period", "retighten_period"):
                value = getattr(self, name)
                if value is not None and not self.min_period <= value <= self.max_period:
                    raise ValueError(f"{name} must lie in [min_period, max_period] = [{self.min_period}, "
                                     f"{self.max_period}], got {value}")
            if self.growth <= 1:
                raise ValueError(f"growth must be above 1, got {self.growth}")
            if not 0 < self.shrink < 1:
                raise ValueError(f"shrink must be in (0, 1), got {self.shrink}")
            if self.target not in TARGETS:
                raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
            if self.calibration_warmup is not None and self.calibration_warmup < 0:
                raise ValueError(f"calibration_warmup must be non-negative, got {self.calibration_warmup}")
            if self.target_scale <= 0:
                raise ValueError(f"target_scale must be positive, got {self.target_scale}")
            if self.lr2_coef is not None and (self.lr2_coef <= 0 or self.target != "lr2"):
                raise ValueError(f"lr2_coef must be positive and needs target: lr2, got {self.lr2_coef}")
            if not 0 < self.lr_drop_ratio < 1:
                raise ValueError(f"lr_drop_ratio must be in (0, 1), got {self.lr_drop_ratio}")
            if self.budget_period is not None and self.budget_syncs is not None:
                raise ValueError("give budget_period or budget_syncs, not both")
            if not 0 <= self.budget_borrow <= 1:
                raise ValueError(f"budget_borrow must be in [0, 1], got {self.budget_borrow}")

    def make_schedule(self) -> AdaptiveSchedule:
        run = self.ctx.run_optimizer
        momentum = run.betas[0] if run.name == "adam" else run.momentum
        return AdaptiveSchedule(self.options, self.ctx.total_steps, momentum,
                                velocity_kept=self.options.optimizer_state == "keep_local")

    def sync_events(self) -> list[tuple[int, dict[str, float]]]:
        """The rule's decisions since the last call, each with the step of its synchronisation
        (:meth:`AdaptiveSchedule.sync_events`), for a logger that records them at those steps."""
        return self.schedule.sync_events()
