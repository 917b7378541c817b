"""One family for the methods that average models on a schedule (Cong et al., ICPP'19; Jiang & Agrawal, 2020):
K-step averaging and its hierarchical form (``kstep``, ``kstep_hier``), constant-period averaging
(``cpsgd``), adaptive periodic averaging (``adpsgd``) and DiLoCo (``diloco``, ``streaming_diloco``),
each in a module of its own name.

They share everything but the schedule, and one vocabulary, torch's model_averaging's:
``period`` (steps between global reductions), ``local_period`` (between local ones),
``warmup_steps`` (synchronous steps first: K-step), ``final_average`` (a global reduction after
the last step), and the policies ``buffers`` and ``optimizer_state`` (``average`` |
``keep_local``); :class:`FamilyOptions` holds the ones every member has. Every run logs the
schedule's normalised periods as the MLflow params ``schedule.kind`` (``fixed`` | ``adaptive``),
``schedule.period`` (the global period; adaptive: the initial one) and ``schedule.local_period``
(the global period when there are no local reductions), whatever the method's option names.

Each worker takes local optimizer steps; after a step the method's :class:`Schedule` says whether
a reduction is due and over which scope (``"global"``: the world; ``"local"``: the worker's
group); a reduction then averages, in one allreduce per dtype, the parameters and, by the
method's :class:`AveragingPolicy`, the floating buffers (BN statistics) and the optimizer's
per-parameter state, optionally probing the parameter variance V = mean_i ||x_i - x_bar||^2 (one
scalar allreduce, part of the same reduction) that ADPSGD's rule reads. Options that only K-step
averaging has (block momentum on the global update, synchronous warm-up steps, evaluating the
world average) are hooks here that the other methods leave off.

A new schedule is one :class:`Schedule` subclass (``due``; ``after_sync`` if it learns from the
variance), and a new method of the family one subclass of :class:`PeriodicAveraging` naming its
schedule and policy; one whose global reduction is not a plain average (DiLoCo's outer step)
overrides :meth:`PeriodicAveraging.global_reduction`.

Invariants: every rank takes the same decisions (the schedule reads only the step, the lr and V,
which comes from an allreduce), so the reductions line up across ranks; after a global reduction
every replica holds the same parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from commlab.algorithms.averaging import (
    POLICIES,
    ReductionMomentum,
    average_and_probe,
    average_replicas,
    averaged_copy,
    is_due,
    sync_tensors,
)
from commlab.algorithms.base import Algorithm, StepInfo
from commlab.algorithms.dense_allreduce import allreduce_gradients
from commlab.algorithms.tensors import grad_buckets
from commlab.core.communicator import Communicator
from commlab.options import Alias


@dataclass
class FamilyOptions:
    """Options every member of the family has (the ones each method adds come after them).

    Aliases accepted in configs and grids (one of a pair, not both): ``final_reduction`` for
    ``final_average``, ``average_optimizer_state`` for ``optimizer_state`` (K-step's names),
    ``average_buffers`` and ``average_momentum`` (true | false) for ``buffers`` and
    ``optimizer_state`` (ADPSGD's names)."""

    ALIASES: ClassVar[dict[str, Alias]] = {
        "final_reduction": Alias("final_average"),
        "average_optimizer_state": Alias("optimizer_state"),
        "average_buffers": Alias("buffers", {True: "average", False: "keep_local"}),
        "average_momentum": Alias("optimizer_state", {True: "average", False: "keep_local"}),
    }

    buffers: str = "average"  # average | keep_local: floating buffers (BN running statistics) at a reduction
    optimizer_state: str = "keep_local"  # average | keep_local: the optimizer's momentum buffers, Adam moments
    final_average: bool = True  # a global reduction after the last step (counted): the result is one model

    def validate(self) -> None:
        for name in ("buffers", "optimizer_state"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {POLICIES}, got {getattr(self, name)!r}")


@dataclass
class AveragingPolicy:
    """What a reduction averages and how the method is evaluated (each method maps its options here)."""

    buffers: str = "average"  # average | keep_local: floating buffers (BN running statistics)
    optimizer_state: str = "keep_local"  # average | keep_local: momentum buffers, Adam moments
    probe_variance: bool = False  # measure V at every global reduction (one scalar allreduce)
    evaluate: str = "rank0"  # rank0: rank 0's replica; average: the world average (uncounted)


class Schedule:
    """When reductions happen. :meth:`due` is asked after every optimizer step past the warm-up;
    :meth:`after_sync` hears of every global reduction with the variance it measured (NaN when not
    probed); :meth:`observe_lr` sees every step's learning rate first. ``kind``,
    ``initial_period`` and ``local_period`` are the normalised periods the run logs as params."""

    _STATE = ("syncs", "variance", "history")
    kind = "fixed"

    def __init__(self, period: int, local_period: int | None = None):
        self.period = period  # the global period in force (metrics, history)
        self.initial_period = period
        self.local_period = period if local_period is None else local_period
        self.syncs, self.variance = 0, math.nan
        self.history: list[tuple[int, int, float]] = []  # (step, period in force, variance) per global sync

    def observe_lr(self, step: int, lr: float) -> None:
        pass

    def due(self, step: int) -> str | None:
        """``"global"``, ``"local"`` or None after optimizer step ``step``."""
        raise NotImplementedError

    def after_sync(self, step: int, variance: float | None, lr: float) -> None:
        self.syncs += 1
        self.variance = math.nan if variance is None else variance
        self.history.append((step, self.period, self.variance))

    def metrics(self) -> dict[str, float]:
        out = {"period": float(self.period), "syncs": float(self.syncs)}
        if not math.isnan(self.variance):
            out["variance"] = self.variance
        return out

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for k in self._STATE:
            if k in state:
                setattr(self, k, state[k])
        self.history = [tuple(h) for h in self.history]


class FixedSchedule(Schedule):
    """Global reductions every ``period`` steps, local ones every ``local_period`` in between (a
    local reduction due with a global one is replaced by it), counted from ``start`` (the end of a
    warm-up); ``phase`` as :func:`~commlab.algorithms.averaging.is_due`; with ``final`` the last step
    of the run is a global reduction too."""

    def __init__(self, local_period: int, period: int, total_steps: int, start: int = 0, phase: str = "last",
                 final: bool = True):
        super().__init__(period, local_period)
        self.total_steps, self.start, self.phase, self.final = total_steps, start, phase, final

    def due(self, step: int) -> str | None:
        if step < self.start:
            return None
        if (self.final and step == self.total_steps - 1) or is_due(step, self.initial_period, self.start, self.phase):
            return "global"
        if self.local_period < self.initial_period and is_due(step, self.local_period, self.start, self.phase):
            return "local"
        return None


def constant_schedule(period: int, total_steps: int, final_average: bool = True,
                      sync_at_first_step: bool = False) -> FixedSchedule:
    """One constant period (CPSGD's schedule): a global reduction after steps p-1, 2p-1, ... (or
    0, p, 2p, ... with ``sync_at_first_step``), and after the last step with ``final_average``."""
    return FixedSchedule(period, period, total_steps, 0, "first" if sync_at_first_step else "last", final_average)


def constant_syncs(period: int, total_steps: int, final_average: bool = True,
                   sync_at_first_step: bool = False) -> int:
    """How many global reductions :func:`constant_schedule` makes in ``total_steps`` steps: CPSGD's
    count at ``period``, ADPSGD's budget."""
    schedule = constant_schedule(period, total_steps, final_average, sync_at_first_step)
    return sum(schedule.due(s) == "global" for s in range(total_steps))


class PeriodicAveraging(Algorithm):
    """Local steps, then model reductions when the schedule says (see the module docstring).

    Subclasses define :meth:`make_schedule` and :meth:`policy`; hierarchical methods also
    :meth:`local_comm`, methods with block momentum :meth:`block_momentum`, and methods whose
    global reduction is more than an average :meth:`global_reduction`. A method whose options have
    ``warmup_steps`` runs that many synchronous steps first (gradients allreduced, one global
    reduction each)."""

    def make_schedule(self) -> Schedule:
        raise NotImplementedError

    def policy(self) -> AveragingPolicy:
        raise NotImplementedError

    def local_comm(self) -> Communicator | None:
        """The group communicator for local reductions (None: there are none)."""
        return None

    def block_momentum(self) -> ReductionMomentum | None:
        """Momentum on the global update (None: plain averaging)."""
        return None

    @property
    def warmup_steps(self) -> int:
        return int(getattr(self.options, "warmup_steps", 0))

    # ---- construction -----------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()  # every replica starts from rank 0's parameters and buffers
        self.schedule = self.make_schedule()
        self.group_comm = self.local_comm()
        self.block = self.block_momentum()
        self._steps = 0
        params = list(self.model.parameters())
        self.probe_numel = sum(p.numel() for p in params) if self.policy().probe_variance else 0
        trainable = [p for p in params if p.requires_grad]
        self._buckets = grad_buckets(trainable, 25 * 2**20) if self.warmup_steps else []

    # ---- the hooks ----------------------------------------------------------------------------
    def after_backward(self, info: StepInfo) -> None:
        if info.step < self.warmup_steps:
            with self.comm.reduction():  # a synchronous step is one global reduction
                allreduce_gradients(self._buckets, self.comm)

    def after_step(self, info: StepInfo) -> None:
        s = info.step
        self._steps = s + 1
        self.schedule.observe_lr(s, info.lr)
        if s < self.warmup_steps:
            if self.policy().buffers == "average":
                # Part of this step's reduction (replicas' BN statistics would drift apart).
                average_replicas([b for b in self.model.buffers() if b.dtype.is_floating_point], self.comm)
            if s == self.warmup_steps - 1 and self.block is not None:
                self.block.reset_anchor()  # local steps start from here
            return
        scope = self.schedule.due(s)
        if scope == "global":
            variance = self.global_reduction()
            if self.block is not None:
                self.block.apply()
            self.schedule.after_sync(s, variance, info.lr)
        elif scope == "local" and self.group_comm is not None:
            self._average(self.group_comm, 0)

    def global_reduction(self) -> float | None:
        """What a global reduction does, after the step the schedule names: here the policy's
        tensors averaged over the world (one allreduce per dtype, one counted reduction), and
        the parameter variance V measured before the average when the policy probes it.
        Returns V, or None when it is not measured. Collective: every rank calls it at the same step."""
        return self._average(self.comm, self.probe_numel)

    def run_params(self) -> dict[str, Any]:
        s = self.schedule
        return {"schedule.kind": s.kind, "schedule.period": s.initial_period, "schedule.local_period": s.local_period}

    def _average(self, comm: Communicator, probe_numel: int) -> float | None:
        """One reduction over ``comm``: the policy's tensors averaged; V of the first
        ``probe_numel`` elements (0: not measured, None)."""
        policy = self.policy()
        tensors = sync_tensors(self.model, self.optimizer, policy.buffers, policy.optimizer_state)
        with comm.reduction():
            return average_and_probe(tensors, comm, probe_numel)

    # ---- evaluation, metrics, checkpoints -----------------------------------------------------
    @property
    def eval_model(self) -> torch.nn.Module:
        if self.policy().evaluate == "average":
            return averaged_copy(self.model, self.ctx.control)
        return self.model

    def metrics(self) -> dict[str, float]:
        out = self.schedule.metrics()
        reductions = self.comm.stats.counters["reductions_global"]
        if reductions:
            out["samples_per_global_reduction"] = self._steps * self.comm.size * self.ctx.batch_size / reductions
        return out

    def state_dict(self) -> dict:
        return {"steps": self._steps, "block": self.block.state_dict() if self.block else None,
                "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._steps = state.get("steps", 0)
        if self.block is not None and state.get("block"):
            self.block.load_state_dict(state["block"])
        if "schedule" in state:
            self.schedule.load_state_dict(state["schedule"])


class VarianceAveraging(PeriodicAveraging):
    """The policy of CPSGD and ADPSGD: a reduction averages the parameters, the floating buffers
    and (``optimizer_state: average``) the momentum, as their options say, and every global
    reduction measures V (unless the options turn ``probe_variance`` off)."""

    def policy(self) -> AveragingPolicy:
        options = self.options
        return AveragingPolicy(buffers=options.buffers, optimizer_state=options.optimizer_state,
                               probe_variance=getattr(options, "probe_variance", True))
