"""CPSGD: parameter averaging with a constant period, the baseline of ADPSGD (Jiang & Agrawal,
"Adaptive Periodic Averaging", arXiv 2007.06134; :mod:`commlab.algorithms.adpsgd`).

A member of the periodic-averaging family (:mod:`commlab.algorithms.periodic`) with the family's
fixed schedule (the same as ``kstep``'s): local optimizer steps, and after every ``period``-th
step (steps p-1, 2p-1, ...; torch's PeriodicModelAverager(period=p, warmup_steps=p-1) does the
same arithmetic; with ``sync_at_first_step`` after steps 0, p, 2p, ... like warmup_steps=0) one
allreduce of all parameters and floating buffers (and, with ``optimizer_state: average``, the
optimizer's momentum). With ``final_average`` the last step also averages, so the evaluated model
is the average.

Each synchronisation also measures the variance the ADPSGD paper reasons about::

    V = mean_i || x_i - x_bar ||^2      (sum over all parameters, mean over the P ranks)

with one extra scalar allreduce, part of the same global reduction: after the model allreduce
gives ``x_bar``, each rank computes ``||x_i - x_bar||^2`` from its own pre-average copy and the
scalar is averaged (``probe_variance: false`` leaves it out).

The options use the family's names (:class:`~commlab.algorithms.periodic.FamilyOptions`):
``buffers`` and ``optimizer_state`` (``average`` | ``keep_local``) and ``final_average``; the
paper's ``average_buffers`` and ``average_momentum`` (true | false) are accepted as aliases.
Every run logs ``schedule.kind`` (``fixed``), ``schedule.period`` and ``schedule.local_period``
(both ``period``) as params, and the metrics ``period``, ``syncs`` and ``variance`` (the last
synchronisation's).

Invariants: the synchronisation steps depend only on the step count, so every rank averages at
the same steps; after each one every replica holds the same parameters.

Usage (run config fragment)::

    method: cpsgd
    method_params: {period: 16}
"""

from __future__ import annotations

from dataclasses import dataclass

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.periodic import FamilyOptions, FixedSchedule, VarianceAveraging, constant_schedule
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("cpsgd")
class CPSGD(VarianceAveraging):
    """Constant-period parameter averaging (plain K-step model averaging) that measures V."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "periodic"
    host_sync_budget = SyncBudget({"local": 0, "reduction": 1})  # a reduction reads V
    quick_run = QuickRun({"period": 4})
    resume = ResumeState("the schedule's count of synchronisations and their variances")

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
