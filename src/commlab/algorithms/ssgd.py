"""Synchronous SGD: every step, the gradients averaged over the world by a dense allreduce.

The reference every paper compares against ("full-communication SGD", "dense allreduce"), run the
way a GPU user runs it, as PyTorch's DDP does: bucketed, each bucket's allreduce started during
backward as soon as its gradients are accumulated, waited for once before the optimizer step
(:mod:`commlab.algorithms.dense_allreduce` has the machinery, which ``fp16`` shares). Here the
buckets travel as they are, float32, and are averaged in place (sum / P).

Invariants: one step is one global reduction; every rank applies the same averaged gradient, so
the replicas stay bitwise equal.
"""

from __future__ import annotations

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.dense_allreduce import BucketedAllreduce
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("ssgd")
class SynchronousSGD(BucketedAllreduce):
    """Average gradients every step with bucketed dense allreduces started during backward."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "dense"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun()  # its defaults take its one branch
    resume = ResumeState("")  # nothing of its own: the model and the loop's optimizer
