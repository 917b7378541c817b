"""OD-SGD: one-step delay SGD (Xu et al., "OD-SGD: One-step Delay Stochastic Gradient Descent for
Distributed Training", arXiv 2005.06728).

Every rank keeps a global replica, updated by synchronous SGD on the allreduce-averaged gradient
whose allreduce overlaps the next step, and a local replica that forward/backward run on and that
a local rule moves with the worker's own gradient; the local replica is refreshed from the global
one every step (k = 1). The replicas, the schedule and the options are
:mod:`commlab.algorithms.delayed`'s; the local rules (plain, DC-ASGD, GLU) and their sources are
:mod:`commlab.algorithms.local_compensation`'s.

Usage (run config fragment)::

    method: odsgd
    method_params: {warmup_steps: 200, local_optimizer: glu, local_lr_scale: 4.0}
"""

from __future__ import annotations

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.delayed import DelayedGlobalSGD, DelayedOptions
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("odsgd")
class OneStepDelaySGD(DelayedGlobalSGD):
    """OD-SGD: the local replica is refreshed from the global one every step (k = 1)."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "delayed"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun({"warmup_steps": 4})
    resume = ResumeState("the global replica with its optimizer and gradients, the local rule's state, the versions")

    Options = DelayedOptions
