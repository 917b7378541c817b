"""What K-step averaging and its hierarchical form share (Cong, Yang & Zhou, "Reducing global
reductions in large-scale distributed training", ICPP 2019 Workshops; lineage K-AVG, Zhou & Cong,
IJCAI 2018): our reading of the paper, the options and the family class of ``kstep``
(:mod:`commlab.algorithms.kstep`: global reductions every ``period`` steps) and ``kstep_hier``
(:mod:`commlab.algorithms.kstep_hier`: local reductions inside groups between them). No public
code exists: what follows is a reconstruction, and every choice in it is an option, logged with
the run.

The option names are the family's (torch's model_averaging vocabulary, see
:mod:`commlab.algorithms.periodic`); the paper's names are aliases that configs and grids may
use instead (one of a pair, not both): ``k`` for ``period`` (kstep), ``k_global`` and ``k_local``
for ``period`` and ``local_period`` (kstep_hier), ``final_reduction`` for ``final_average``,
``average_optimizer_state`` for ``optimizer_state``.

Both are members of the periodic-averaging family (:mod:`commlab.algorithms.periodic`) with a
fixed schedule. Both take optional **reduction momentum** (block momentum ``momentum`` = mu on the global update,
plain or Nesterov; formulas in :mod:`commlab.algorithms.averaging`), ``warmup_steps`` synchronous
steps first (gradients allreduced every step, one global reduction each, as post-local SGD does),
and explicit policies for what else a reduction averages: the optimizer state
(``optimizer_state``) and the BN running statistics (``buffers``; averaging only the
weights leaves each worker its own statistics, which costs accuracy with BN nets).

Reconstructed choices and where they may deviate from the paper:

* ``phase``: ``last`` (default) reduces after the K-th local step of a period, K-AVG's count
  (T/K reductions in T steps); ``first`` reduces after the first step of each period, torch's
  averagers' convention (with ``momentum = 0``, ``warmup_steps = 0`` and no final reduction our
  ``kstep`` then equals PeriodicModelAverager and ``kstep_hier`` HierarchicalModelAverager step for
  step; with a
  warm-up, kstep still equals PeriodicModelAverager after DDP-style warm-up, and kstep_hier does
  when ``warmup_steps`` is a multiple of ``period``, since torch's hierarchy counts periods from
  step 0, ours from the end of the warm-up).
* ``final_average``: the last step of the run ends with a global reduction (counted) unless one
  is due anyway, so the trained model is a single model, as K-AVG's output is the average.
* ``evaluate``: ``rank0`` (default) scores rank 0's replica at every evaluation, the model that
  exists at that step; ``average`` scores the world average of the replicas, the model one more
  global reduction would give, whose averaging traffic is evaluation and is not counted (so its
  accuracies between reductions come one uncounted reduction early).
* Reduction momentum acts on global reductions only; local reductions are plain averages.

Invariants: the reduction steps depend only on the step count, so every rank reduces at the same
steps; after a global reduction every replica holds the same parameters (and, with block
momentum, the same anchor and velocity).
"""

from __future__ import annotations

from dataclasses import dataclass

from commlab.algorithms.averaging import PHASES, ReductionMomentum
from commlab.algorithms.periodic import AveragingPolicy, FamilyOptions, FixedSchedule, PeriodicAveraging

EVALUATE = ("average", "rank0")


@dataclass
class AveragingOptions(FamilyOptions):
    """Options shared by ``kstep`` and ``kstep_hier`` (after the family's ``buffers``,
    ``optimizer_state`` and ``final_average``; aliases: :class:`FamilyOptions`)."""

    momentum: float = 0.0  # block momentum mu on the global update; 0 = plain averaging
    nesterov: bool = False  # Nesterov block momentum: workers restart from anchor + mu * v
    block_lr: float = 1.0  # zeta, BMUF's block learning rate on the averaged displacement
    warmup_steps: int = 0  # synchronous steps first (gradient allreduce every step)
    phase: str = "last"  # last: reduce after a period's K-th step (K-AVG); first: after its 1st (torch)
    evaluate: str = "rank0"  # rank0: score rank 0's replica; average: the replicas' world average (uncounted)

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.block_lr <= 0:
            raise ValueError(f"block_lr must be positive, got {self.block_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if self.evaluate not in EVALUATE:
            raise ValueError(f"evaluate must be one of {EVALUATE}, got {self.evaluate!r}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0, got momentum=0")


class KStepFamily(PeriodicAveraging):
    """What ``kstep`` and ``kstep_hier`` share: their policy, warm-up and block momentum options."""

    def periods(self) -> tuple[int, int]:
        """(local period, global period) in optimizer steps."""
        raise NotImplementedError

    def make_schedule(self) -> FixedSchedule:
        o = self.options
        local_period, period = self.periods()
        return FixedSchedule(local_period, period, self.ctx.total_steps, o.warmup_steps, o.phase, o.final_average)

    def policy(self) -> AveragingPolicy:
        o = self.options
        return AveragingPolicy(buffers=o.buffers, optimizer_state=o.optimizer_state, evaluate=o.evaluate)

    def block_momentum(self) -> ReductionMomentum | None:
        o = self.options
        if o.momentum == 0 and o.block_lr == 1.0:
            return None
        return ReductionMomentum([p.data for p in self.model.parameters()], o.momentum, o.block_lr, o.nesterov)
