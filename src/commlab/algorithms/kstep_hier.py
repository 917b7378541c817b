"""Hierarchical K-step averaging: local reductions inside groups of workers between global ones
(Cong, Yang & Zhou, "Reducing global reductions in large-scale distributed training", ICPP 2019
Workshops; :mod:`commlab.algorithms.kstep_common` holds the reading of the paper it shares with
``kstep``).

Workers form consecutive groups of ``group_size`` (one group per node by default); every
``local_period`` steps (the paper's K_l) the model is averaged inside the group (a local
reduction), every ``period = H * local_period`` steps (K_g) over the world (a global reduction,
which replaces the local one due at the same step, as torch's HierarchicalModelAverager does).
Everything else is shared with ``kstep`` (:mod:`commlab.algorithms.kstep_common`): the options
(block momentum, warm-up, phase, policies, evaluation), the fixed schedule and the family
(:mod:`commlab.algorithms.periodic`);
``k_local`` and ``k_global`` are aliases of ``local_period`` and ``period``.

* Reduction momentum acts on global reductions only; local reductions are plain averages.
* A group of the whole world makes every local reduction a global one (counted as global); a
  group of one worker makes them no-ops.

Invariants: every rank reduces at the same steps; after a local reduction the replicas of a group
are equal, after a global one every replica.

Launch (6 CPU workers): ``torchrun --standalone --nproc-per-node 6 -m commlab train
--config run.yaml method=kstep_hier method_params.group_size=2 method_params.local_period=4
method_params.period=32 method_params.momentum=0.5``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.kstep_common import AveragingOptions, KStepFamily
from commlab.core.communicator import Communicator
from commlab.core.runtime import node_groups
from commlab.options import Alias
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("kstep_hier")
class KStepHier(KStepFamily):
    """Local reductions inside groups every ``local_period`` steps, global ones every ``period``."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "periodic"
    host_sync_budget = SyncBudget({"local": 0, "reduction": 0})
    # groups of 2 where the world divides into them (local and global reductions apart from 4 workers)
    quick_run = QuickRun({"k_local": 2, "k_global": 4},  # the paper's names, as the grids give them
                         by_workers=lambda workers: {"group_size": 2 if workers % 2 == 0 else 1})
    resume = ResumeState("the schedule's counts and the block momentum's anchor and velocity")

    @dataclass
    class Options(AveragingOptions):
        """Hierarchical K-step's options; ``k_local`` and ``k_global`` are aliases of
        ``local_period`` and ``period`` (and :class:`FamilyOptions`'s)."""

        ALIASES: ClassVar[dict[str, Alias]] = {**AveragingOptions.ALIASES, "k_local": Alias("local_period"),
                                               "k_global": Alias("period")}

        group_size: int = 0  # workers per local group; 0 = workers per node
        local_period: int = 4  # steps between local (group) reductions, the paper's K_l
        period: int = 16  # steps between global reductions, a multiple of local_period (the paper's K_g)

        def validate(self) -> None:
            super().validate()
            if self.group_size < 0:
                raise ValueError(f"group_size must be >= 0 (0: workers per node), got {self.group_size}")
            if self.local_period < 1:
                raise ValueError(f"local_period must be >= 1, got {self.local_period}")
            if self.period < 1 or self.period % self.local_period:
                raise ValueError(
                    f"period must be a positive multiple of local_period={self.local_period}, got {self.period}")

    def periods(self) -> tuple[int, int]:
        return self.options.local_period, self.options.period

    def local_comm(self) -> Communicator | None:
        world = self.comm.size
        size = self.options.group_size or self.ctx.workers_per_node
        if size < 1 or world % size:
            raise ValueError(f"group_size {size} must divide the world size {world}")
        if size == 1:
            return None  # a group of one: local reductions are no-ops
        if size == world:
            return self.comm  # the group is the world: its reductions are global ones
        group, _ = node_groups(size, world)
        return self.comm.subgroup(group)
