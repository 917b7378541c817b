"""K-step averaging (Cong, Yang & Zhou, "Reducing global reductions in large-scale distributed
training", ICPP 2019 Workshops; lineage K-AVG, Zhou & Cong, IJCAI 2018).

Every worker takes local optimizer steps (the run's ``train.optimizer``: SGD, momentum SGD or
Adam) and every ``period`` (the paper's K) steps the models are averaged over the world (one
global reduction). ``period = 1`` is synchronous model averaging. Optional reduction momentum
(``momentum``, ``block_lr``, ``nesterov``), synchronous warm-up steps, the phase of the period,
the final average, the buffer and optimizer-state policies and the evaluation are the options it
shares with its hierarchical form ``kstep_hier``; our reading of the paper and the choices it
reconstructs are :mod:`commlab.algorithms.kstep_common`'s. ``k`` is an alias of ``period``.

Invariants: the reduction steps depend only on the step count, so every rank reduces at the same
steps; after a global reduction every replica holds the same parameters (and, with block
momentum, the same anchor and velocity).

Launch (4 CPU workers): ``torchrun --standalone --nproc-per-node 4 -m commlab train
--config run.yaml method=kstep method_params.period=16 method_params.momentum=0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.kstep_common import AveragingOptions, KStepFamily
from commlab.options import Alias
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("kstep")
class KStep(KStepFamily):
    """K-step averaging: a global model average every ``period`` local steps."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "periodic"
    host_sync_budget = SyncBudget({"local": 0, "reduction": 0})
    quick_run = QuickRun({"k": 4})  # the paper's name, as the grids give it (a grid's k is replaced)
    resume = ResumeState("the schedule's counts and the block momentum's anchor and velocity")

    @dataclass
    class Options(AveragingOptions):
        """K-step averaging's options; ``k`` is an alias of ``period`` (and :class:`FamilyOptions`'s)."""

        ALIASES: ClassVar[dict[str, Alias]] = {**AveragingOptions.ALIASES, "k": Alias("period")}

        period: int = 16  # local steps between global reductions, the paper's K (1 = synchronous averaging)

        def validate(self) -> None:
            super().validate()
            if self.period < 1:
                raise ValueError(f"period must be >= 1, got {self.period}")

    def periods(self) -> tuple[int, int]:
        return self.options.period, self.options.period
