"""Periodic parameter averaging with a constant (CPSGD) or adaptive (ADPSGD) period.

Implements ADPSGD (Jiang & Agrawal, "Adaptive Periodic Averaging", arXiv
2007.06134). No code was released; the period rule below is our reconstruction of the paper's
principle: the inter-node variance of the parameters governs convergence, so under a fixed
communication budget one synchronises often early (large variance) and rarely later.

Both are members of the periodic-averaging family (:mod:`commlab.algorithms.periodic`): local
optimizer steps and, at a synchronisation, one allreduce of all parameters and floating buffers
(and, with ``optimizer_state: average``, the optimizer's momentum), then the parameter variance::

    V = mean_i || x_i - x_bar ||^2      (sum over all parameters, mean over the P ranks)

with one extra scalar allreduce: after the model allreduce gives ``x_bar``, each rank computes
``||x_i - x_bar||^2`` from its own pre-average copy and the scalar is averaged. The model and the
scalar allreduce are one global reduction. Both methods log ``period`` and ``variance`` (the
last synchronisation's), ``syncs`` and, for ADPSGD, ``target`` through :meth:`metrics`.

Their options use the family's names (:class:`~commlab.algorithms.periodic.FamilyOptions`):
``buffers`` and ``optimizer_state`` (``average`` | ``keep_local``) and ``final_average``; the
paper's ``average_buffers`` and ``average_momentum`` (true | false) are accepted as aliases.
Every run logs ``schedule.kind`` (cpsgd: ``fixed``, adpsgd: ``adaptive``), ``schedule.period``
and ``schedule.local_period`` (cpsgd: ``period``; adpsgd: ``initial_period``) as params.

``cpsgd``: the family's fixed schedule (the same as ``kstep``'s):
averages after every ``period``-th step (steps p-1, 2p-1, ...; torch's
PeriodicModelAverager(period=p, warmup_steps=p-1) does the same arithmetic; with
``sync_at_first_step`` after steps 0, p, 2p, ... like warmup_steps=0). With ``final_average``
the last step also averages, so the evaluated model is the average.

``adpsgd`` (our reading, every constant an option):

1. Calibration: the run starts at ``initial_period`` (CPSGD); the variances of the first
   ``calibration_syncs`` synchronisations whose interval starts at or after step
   ``calibration_warmup`` (momentum SGD's drift grows for about 1 / (1 - momentum) steps, so
   the very first intervals under-state it) set the target: ``target_scale`` times their mean
   (``target: calibrate``), or with ``target: lr2`` the target is ``lr2_coef * lr^2`` (variance
   scales with lr^2 * p), the coefficient given or calibrated as ``target_scale * mean(V / lr^2)``.
2. At each later synchronisation with variance V and ratio ``V / target``: below ``grow_below``
   the period grows to ``max(p + 1, ceil(growth * p))`` (at most ``max_period``); above
   ``shrink_above`` it shrinks to ``min(p - 1, floor(shrink * p))`` (at least ``min_period``);
   in between it holds. As gradients shrink during training V falls, so the period grows.
3. Re-tightening: when a step's lr is below ``lr_drop_ratio`` times the previous step's (a step
   decay), the period resets to ``retighten_period`` and, with ``target: calibrate``, the
   target is calibrated anew from intervals that start after the drop (the one straddling it
   mixes both learning rates); the next synchronisation comes at most that many steps after
   the last one.
4. Budget: with ``budget_period`` (or ``budget_syncs``) the run never exceeds B, the number of
   synchronisations CPSGD at that period makes over the run. The last step's synchronisation is
   reserved (with ``final_average``); the other B' = B - 1 follow a budget line: the k-th may
   happen only once the progress (step + 1) / T reaches (k / B' - b) / (1 - b), where b is
   ``budget_borrow``, the fraction of the budget that may be spent ahead of the uniform pace
   (0: never ahead of CPSGD; 1: no pacing). So the rule can synchronise often early, up to b * B'
   synchronisations ahead, and what a long period saves later is spent after a re-tightening.
   The line wins over the rule and ``max_period``; the rule's own period is logged as
   ``rule_period``, the period in force as ``period``.
5. With ``final_average`` the last step is always a synchronisation.

The period sequence depends only on the measured variances and the lr schedule, which are the
same on every rank (V comes from an allreduce), so every rank takes the same decisions and the
sequence is deterministic for a seed.

Usage (run config fragments)::

    method: cpsgd
    method_params: {period: 16}

    method: adpsgd
    method_params: {budget_period: 16, initial_period: 2, calibration_syncs: 4}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commlab.algorithms.periodic import AveragingPolicy, FamilyOptions, FixedSchedule, PeriodicAveraging, Schedule
from commlab.registry import ALGORITHMS

TARGETS = ("calibrate", "lr2")


def next_period(period: int, variance: float, target: float, o) -> int:
    """The rule of step 2 (a pure function of the options ``o``)."""
    ratio = variance / target if target > 0 else (0.0 if variance <= 0 else math.inf)
    if ratio < o.grow_below:
        return min(o.max_period, max(period + 1, math.ceil(o.growth * period)))
    if ratio > o.shrink_above:
        return max(o.min_period, min(period - 1, math.floor(o.shrink * period)))
    return period


def cpsgd_syncs(period: int, total_steps: int, final_average: bool = True,
                sync_at_first_step: bool = False) -> int:
    """How many synchronisations CPSGD at ``period`` makes in ``total_steps`` steps."""
    schedule = constant_schedule(period, total_steps, final_average, sync_at_first_step)
    return sum(schedule.due(s) == "global" for s in range(total_steps))


def constant_schedule(period: int, total_steps: int, final_average: bool = True,
                      sync_at_first_step: bool = False) -> FixedSchedule:
    """CPSGD's schedule: a global reduction after steps p-1, 2p-1, ... (or 0, p, 2p, ... with
    ``sync_at_first_step``), and after the last step with ``final_average``."""
    return FixedSchedule(period, period, total_steps, 0, "first" if sync_at_first_step else "last", final_average)


class AdaptiveSchedule(Schedule):
    """ADPSGD's period controller (steps 1-5 of the module docstring), free of processes."""

    kind = "adaptive"

    def __init__(self, o, total_steps: int):
        super().__init__(o.initial_period)
        self.o, self.total_steps = o, total_steps
        self.budget = o.budget_syncs
        if o.budget_period is not None:
            self.budget = cpsgd_syncs(o.budget_period, total_steps, o.final_average)
        self.rule_period = o.initial_period
        self.period = o.initial_period  # the period in force (after the budget guard)
        self.syncs, self.last_sync, self.retightens = 0, -1, 0
        self.variance, self.prev_lr = math.nan, None
        self.target_value: float | None = None  # calibrate: V target; lr2: coefficient of lr^2
        if o.target == "lr2" and o.lr2_coef is not None:
            self.target_value = o.lr2_coef
        self.calibration: list[float] | None = [] if self.target_value is None else None
        self.calibrate_from = o.calibration_warmup  # first step of a usable calibration interval
        self.next_sync = self._schedule_from(-1)
        self.history: list[tuple[int, int, float]] = []

    # ---- the pieces -----------------------------------------------------------------------------
    def target(self, lr: float) -> float:
        if self.target_value is None:
            return math.nan
        return self.target_value * lr**2 if self.o.target == "lr2" else self.target_value

    def _schedule_from(self, step: int) -> int | None:
        """Next synchronisation step after one at ``step`` (-1: the start); None: no more."""
        remaining = self.total_steps - 1 - step
        if remaining <= 0:
            return None
        p = self.rule_period
        if self.budget is not None:
            # The last step's synchronisation is reserved; the others follow the budget line.
            line = self.budget - (1 if self.o.final_average else 0)
            if self.syncs + 1 > line:
                if not self.o.final_average:
                    return None
                p = remaining
            elif self.o.budget_borrow < 1:
                share = (self.syncs + 1) / line
                progress = (share - self.o.budget_borrow) / (1 - self.o.budget_borrow)
                earliest = math.ceil(self.total_steps * progress - 1e-9) - 1
                p = max(p, earliest - step)
        if self.o.final_average:
            p = min(p, remaining)
        self.period = p
        return step + p if step + p <= self.total_steps - 1 else None

    # ---- the hooks ------------------------------------------------------------------------------
    def observe_lr(self, step: int, lr: float) -> None:
        """Re-tighten when this step's lr dropped below ``lr_drop_ratio`` times the last one."""
        dropped = self.prev_lr is not None and lr < self.o.lr_drop_ratio * self.prev_lr
        self.prev_lr = lr
        if not (dropped and self.o.retighten):
            return
        self.retightens += 1
        self.rule_period = self.o.retighten_period or self.o.initial_period
        if self.o.target == "calibrate":
            self.calibration, self.target_value = [], None
            self.calibrate_from = step + 1
        nxt = self._schedule_from(self.last_sync)
        self.next_sync = None if nxt is None else max(step, nxt)

    def due(self, step: int) -> str | None:
        return "global" if self.next_sync is not None and step == self.next_sync else None

    def after_sync(self, step: int, variance: float, lr: float) -> None:
        self.syncs += 1
        interval_start, self.last_sync, self.variance = self.last_sync + 1, step, variance
        self.history.append((step, self.period, variance))
        if self.calibration is not None:
            if interval_start >= self.calibrate_from:
                self.calibration.append(variance / lr**2 if self.o.target == "lr2" else variance)
            if len(self.calibration) >= self.o.calibration_syncs:
                self.target_value = self.o.target_scale * sum(self.calibration) / len(self.calibration)
                self.calibration = None
        else:
            self.rule_period = next_period(self.rule_period, variance, self.target(lr), self.o)
        self.next_sync = self._schedule_from(step)

    def metrics(self) -> dict[str, float]:
        lr = self.prev_lr if self.prev_lr is not None else math.nan
        return {"period": float(self.period), "rule_period": float(self.rule_period),
                "variance": self.variance, "target": self.target(lr), "syncs": float(self.syncs),
                "retightens": float(self.retightens)}

    _STATE = ("rule_period", "period", "syncs", "last_sync", "retightens", "variance", "prev_lr",
              "target_value", "calibration", "calibrate_from", "next_sync", "history")



# ---- the methods --------------------------------------------------------------------------------
class _VarianceAveraging(PeriodicAveraging):
    """CPSGD and ADPSGD: average parameters, floating buffers and (optionally) the momentum, and
    probe V at every synchronisation."""

    def policy(self) -> AveragingPolicy:
        o = self.options
        return AveragingPolicy(buffers=o.buffers, optimizer_state=o.optimizer_state,
                               probe_variance=getattr(o, "probe_variance", True))


@ALGORITHMS.register("cpsgd")
class CPSGD(_VarianceAveraging):
    """Constant-period parameter averaging (plain K-step model averaging)."""

    @dataclass
    class Options(FamilyOptions):
        """CPSGD's options (after the family's; aliases: :class:`FamilyOptions`)."""

        period: int = 8  # steps between averages
        sync_at_first_step: bool = False  # average after steps 0, p, 2p (torch warmup_steps=0)
        probe_variance: bool = True  # measure V at each average (one extra scalar allreduce)

        def validate(self) -> None:
            super().validate()
            if self.period < 1:
                raise ValueError(f"period must be at least 1, got {self.period}")

    def make_schedule(self) -> FixedSchedule:
        o = self.options
        return constant_schedule(o.period, self.ctx.total_steps, o.final_average, o.sync_at_first_step)


@ALGORITHMS.register("adpsgd")
class ADPSGD(_VarianceAveraging):
    """Adaptive-period parameter averaging driven by the measured parameter variance."""

    @dataclass
    class Options(FamilyOptions):
        """ADPSGD's options (after the family's; aliases: :class:`FamilyOptions`)."""

        initial_period: int = 2  # period of the calibration phase and the rule's start
        min_period: int = 1  # the rule never goes below this
        max_period: int = 64  # the rule never goes above this (the budget guard may)
        growth: float = 2.0  # period multiplier when V is below target * grow_below
        shrink: float = 0.5  # period multiplier when V is above target * shrink_above
        grow_below: float = 1.0  # V / target under which the period grows
        shrink_above: float = 2.0  # V / target over which the period shrinks
        target: str = "calibrate"  # calibrate: mean V of a CPSGD phase; lr2: coef * lr^2
        calibration_syncs: int = 4  # synchronisations in the calibration phase
        calibration_warmup: int = 20  # steps whose drift calibration ignores (momentum warm-up)
        target_scale: float = 1.0  # multiplies the calibrated target (or coefficient)
        lr2_coef: float | None = None  # target: lr2 with this coefficient (None: calibrate it)
        retighten: bool = True  # reset the period when the lr drops
        retighten_period: int | None = None  # period after an lr drop (None: initial_period)
        lr_drop_ratio: float = 0.5  # lr below this fraction of the previous step's is a drop
        budget_period: int | None = None  # at most as many syncs as cpsgd at this period
        budget_syncs: int | None = None  # or at most this many syncs (not with budget_period)
        budget_borrow: float = 0.25  # budget fraction that may be spent ahead of the uniform pace

        def validate(self) -> None:
            super().validate()
            for name in ("initial_period", "min_period", "max_period", "calibration_syncs"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
            if not self.min_period <= self.initial_period <= self.max_period:
                raise ValueError(f"need min_period <= initial_period <= max_period, got "
                                 f"{self.min_period}, {self.initial_period}, {self.max_period}")
            if self.growth <= 1:
                raise ValueError(f"growth must be above 1, got {self.growth}")
            if not 0 < self.shrink < 1:
                raise ValueError(f"shrink must be in (0, 1), got {self.shrink}")
            if not 0 <= self.grow_below <= self.shrink_above:
                raise ValueError(f"need 0 <= grow_below <= shrink_above, got {self.grow_below}, "
                                 f"{self.shrink_above}")
            if self.target not in TARGETS:
                raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
            if self.calibration_warmup < 0:
                raise ValueError(f"calibration_warmup must be non-negative, got {self.calibration_warmup}")
            if self.target_scale <= 0:
                raise ValueError(f"target_scale must be positive, got {self.target_scale}")
            if self.lr2_coef is not None and (self.lr2_coef <= 0 or self.target != "lr2"):
                raise ValueError(f"lr2_coef must be positive and needs target: lr2, got {self.lr2_coef}")
            if self.retighten_period is not None and not (
                    self.min_period <= self.retighten_period <= self.max_period):
                raise ValueError(f"retighten_period must lie in [min_period, max_period], got "
                                 f"{self.retighten_period}")
            if not 0 < self.lr_drop_ratio < 1:
                raise ValueError(f"lr_drop_ratio must be in (0, 1), got {self.lr_drop_ratio}")
            if self.budget_period is not None and self.budget_syncs is not None:
                raise ValueError("give budget_period or budget_syncs, not both")
            if not 0 <= self.budget_borrow <= 1:
                raise ValueError(f"budget_borrow must be in [0, 1], got {self.budget_borrow}")
            for name in ("budget_period", "budget_syncs"):
                value = getattr(self, name)
                if value is not None and value < 1:
                    raise ValueError(f"{name} must be at least 1, got {value}")

    def make_schedule(self) -> AdaptiveSchedule:
        return AdaptiveSchedule(self.options, self.ctx.total_steps)
