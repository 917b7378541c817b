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
   between calibrations; ``lr2_coef`` gives the coefficient instead (``target: lr2``). The lr^2
   that a rate is measured at, and that the target is taken at, is the mean of lr^2 over the
   steps of the interval V grew over, not the synchronisation step's.
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
   asked for, the target rises to the variance predicted at the deferred step and the rule's
   next decision starts from that period: the target becomes the level of variance this budget
   affords, and from there the rule lengthens the period as the rate falls. The line only holds
   syncs back; what a long period saves is spent later, after a re-tightening.
6. With ``final_average`` the last step is always a synchronisation.

The decisions depend only on the measured variances and the lr schedule, which are the same on
every rank (V comes from an allreduce), so every rank takes the same decisions and the sequence
is deterministic for a seed.

ADPSGD logs, at each log point, ``period`` (in force), ``rule_period`` (the rule's own),
``variance``, ``variance_rate`` and ``target`` (the rule's) of the last synchronisation with its
step ``last_sync``, and ``syncs`` and ``retightens``. :meth:`ADPSGD.sync_events` hands out every
decision with the step it was taken at (the loop logs them as ``algo_sync_<name>``):
``variance`` (V), ``target`` (the target the rule held V to; absent while calibrating),
``rule_period`` (the rule's own decision), ``period`` (in force, after the budget),
``deferred`` (1 where the budget set the period in force above the rule's, else 0) and
``budget_target`` (where the budget line's deferral raised the target, the raised one: the
variance predicted at the deferred step). The budget's decisions are thus logged apart from the
rule's: ``rule_period`` and ``target`` never carry a deferral's values.

Ours, not the paper's (this reconstruction works from the paper's abstract, which gives neither a
formula nor constants, so every constant below is ours): the drift model of step 1 (so that V
measured over intervals of different lengths can be compared); the calibration and its constants
(2 synchronisations, the momentum warm-up 1 / (1 - m), half the budget's period, a target scale
of 1) and the target's lr^2 scaling, taken at the interval's mean lr^2; the rule's form of step 3
and its limits (at most 2 times longer and 0.5 times shorter per decision, periods in [1, 64]);
the re-tightening after a decay of step 4 (a drop below 0.5 of the previous step's lr, back to
the initial period; the abstract does not mention decays; shortening the period when the lr
drops follows AdaComm, Wang & Joshi, 2018); the budget line (0.25 of the budget may be spent
ahead of the uniform pace) and the target that rises to what the budget affords (the paper
compares methods at equal communication; how a run keeps to a budget is ours).

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
        self.rule_period = self.initial_period  # the rule's own period (its last decision, or a reset)
        # The period the rule's next decision starts from: its own, or the one a deferral took.
        self.base_period = self.initial_period
        self.period = self.initial_period  # the period in force (after the budget line)
        self.syncs, self.last_sync, self.retightens = 0, -1, 0
        self.variance, self.prev_lr = math.nan, None
        self.lr2_sum, self.lr2_steps = 0.0, 0  # lr^2 summed over the steps since the last synchronisation
        self.target_value: float | None = options.lr2_coef  # the target's coefficient of lr^2 (None: calibrating)
        self.calibration: list[float] | None = [] if self.target_value is None else None
        self.calibrate_from = self.warmup  # first step of an interval the calibration may use
        self.clean_from = 0  # first step of an interval the rule may judge (after the last lr drop)
        # Per synchronisation: (step, V, rate, the rule's target, the rule's period, the period in
        # force, whether the budget set it above the rule's, the target a deferral raised or NaN).
        self.decisions: list[tuple[int, float, float, float, int, int, bool, float]] = []
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
        return self._target_at(lr**2)

    def _target_at(self, lr2: float) -> float:
        """The variance target over an interval whose mean lr^2 is ``lr2`` (NaN while calibrating)."""
        return math.nan if self.target_value is None else self.target_value * lr2

    def _interval_lr2(self, lr: float) -> float:
        """The mean lr^2 over the steps since the last synchronisation (the sync step's lr^2 when
        no step's lr was observed), and a fresh sum for the next interval.

        Without momentum V over the interval is the sum of its steps' ``(lr_t * s)^2``, so the
        rate measured over it is s^2 times the interval's mean lr^2 (with momentum, a weighted
        mean of the same lr^2, which the plain mean approximates). The sync step's lr^2 alone
        misjudges it wherever the lr moves within the interval: under a warm-up it is the
        interval's largest and would make the calibrated coefficient too small."""
        lr2 = self.lr2_sum / self.lr2_steps if self.lr2_steps else lr * lr
        self.lr2_sum, self.lr2_steps = 0.0, 0
        return lr2

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
        self.lr2_sum += lr * lr
        self.lr2_steps += 1
        dropped = self.prev_lr is not None and lr < self.options.lr_drop_ratio * self.prev_lr
        self.prev_lr = lr
        if not dropped:
            return
        self.clean_from = step  # the interval straddling the drop mixes both learning rates
        if not self.options.retighten:
            return
        self.retightens += 1
        self.rule_period = self.base_period = self.options.retighten_period or self.initial_period
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
        lr2 = self._interval_lr2(lr)  # the lr^2 the rate was measured at
        if self.calibration is not None and start >= self.calibrate_from and lr2 > 0:
            self.calibration.append(rate / lr2)
            if len(self.calibration) >= self.options.calibration_syncs:
                mean = sum(self.calibration) / len(self.calibration)
                self.target_value = self.options.target_scale * mean * self.drift(self.rule_period)
                self.calibration = None
        target = self._target_at(lr2)
        if self.calibration is None and start >= self.clean_from:
            self.rule_period = self.base_period = rule_period(self.base_period, rate, target, self.drift,
                                                              self.options)
        self.next_sync = self._schedule_from(step)
        budget_target = math.nan
        if self.deferred and self.calibration is None and lr2 > 0:
            # The budget line deferred the rule's synchronisation: the rule takes the variance it
            # will reach by then as its target (the level this budget affords), and its next
            # decision starts from that period. Logged as the budget's, apart from the rule's.
            budget_target = rate * self.drift(self.period)
            self.target_value = budget_target / lr2
            self.base_period = min(self.options.max_period, self.period)
        deferred = self.next_sync is not None and self.period > self.rule_period
        self.decisions.append((step, variance, rate, target, self.rule_period, self.period, deferred, budget_target))

    def metrics(self) -> dict[str, float]:
        out = {"period": float(self.period), "rule_period": float(self.rule_period), "syncs": float(self.syncs),
               "retightens": float(self.retightens)}
        if self.decisions:
            step, variance, rate, target = self.decisions[-1][:4]
            out.update(last_sync=float(step), variance=variance, variance_rate=rate)
            if not math.isnan(target):
                out["target"] = target
        return out

    def sync_events(self) -> list[tuple[int, dict[str, float]]]:
        """The decisions taken since the last call, each with its synchronisation's step: V, the
        rule's target (left out while calibrating), the rule's period, the period in force,
        whether the budget set it above the rule's (1 or 0) and the target a budget deferral
        raised (only where one did), as the module docstring names them."""
        events = []
        for step, variance, _, target, chosen, in_force, deferred, budget_target in self.decisions[self.reported:]:
            values = {"variance": variance, "rule_period": float(chosen), "period": float(in_force),
                      "deferred": float(deferred)}
            if not math.isnan(target):
                values["target"] = target
            if not math.isnan(budget_target):
                values["budget_target"] = budget_target
            events.append((step, values))
        self.reported = len(self.decisions)
        return events

    _STATE = ("rule_period", "base_period", "period", "syncs", "last_sync", "retightens", "variance", "prev_lr",
              "lr2_sum", "lr2_steps", "target_value", "calibration", "calibrate_from", "clean_from", "next_sync",
              "history", "decisions", "reported")

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "base_period" not in state:  # saved before the rule's period was kept apart from a deferral's
            self.base_period = self.rule_period
        # Decisions saved before the budget's were logged apart: no deferral known.
        self.decisions = [tuple(d) if len(d) == 8 else (*d, False, math.nan) for d in self.decisions]


# ---- the method ---------------------------------------------------------------------------------
@ALGORITHMS.register("adpsgd")
class ADPSGD(VarianceAveraging):
    """Adaptive-period parameter averaging driven by the measured parameter variance."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "periodic"
    host_sync_budget = SyncBudget({"local": 0, "reduction": 1})  # a reduction reads V, which the rule decides on
    quick_run = QuickRun({"initial_period": 2, "calibration_syncs": 2, "calibration_warmup": 2})
    resume = ResumeState("the rule's period, target and calibration, the interval's lr^2, and every decision taken")

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
