"""SSD-SGD: several-steps delay SGD (Xu et al., "SSD-SGD: communication sparsification for distributed
deep learning training", arXiv 2012.05396).

OD-SGD's replicas (:mod:`commlab.algorithms.delayed`) with the local replica refreshed from the
global one only every ``k`` steps (k = 5 in the release), so a worker takes up to k local steps
on weights the global updates have moved on from; GLU (the paper's local rule, in our described
reading by default; the release's, ``glu_reading: released``, is its kernel written over the
local weights) is the default local optimizer (:mod:`commlab.algorithms.local_compensation`:
formulas and sources).

Usage (run config fragment)::

    method: ssdsgd
    method_params: {warmup_steps: 500, k: 5, local_optimizer: glu}
"""

from __future__ import annotations

from dataclasses import dataclass

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.delayed import DelayedGlobalSGD, DelayedOptions
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("ssdsgd")
class SeveralStepsDelaySGD(DelayedGlobalSGD):
    """SSD-SGD: the local replica is refreshed from the global one every k steps."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "delayed"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun({"warmup_steps": 4, "k": 2})
    resume = ResumeState("the global replica with its optimizer and gradients, the local rule's state, the versions")

    @dataclass
    class Options(DelayedOptions):
        warmup_steps: int = 500  # synchronous SSGD steps at the start (released code: 500)
        local_optimizer: str = "glu"  # local rule: sgd | dcasgd | glu (the paper's choice: glu)
        k: int = 5  # steps between refreshes of the local replica by the global one

        def validate(self) -> None:
            super().validate()
            if self.k < 1:
                raise ValueError(f"k must be >= 1, got {self.k}")

    @property
    def period(self) -> int:
        return self.options.k
