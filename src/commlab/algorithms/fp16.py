"""fp16: dense synchronous SGD with float16 on the wire, a baseline of the ADPSGD comparison
(Jiang & Agrawal, arXiv 2007.06134).

The dense allreduce of SSGD (:mod:`commlab.algorithms.dense_allreduce`, which ``ssgd`` runs:
bucketed and started during backward, the same buckets and options) with the gradient
pre-divided by P (as torch's fp16_compress_hook does, so the fp16 sum stays in range) and cast to
float16 on the wire: half the bytes of the float32 allreduce. DDP with torch's own hook is ``ddp_fp16``
(:mod:`commlab.algorithms.ddp_fp16`).

Invariants: one step is one global reduction; every rank receives the same float16 sum and
decodes it the same way, so the replicas stay bitwise equal.
"""

from __future__ import annotations

import torch

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.dense_allreduce import BucketedAllreduce
from commlab.compress.quantize import from_fp16, to_fp16
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("fp16")
class FP16(BucketedAllreduce):
    """SSGD's bucketed allreduce, overlapped with backward the same way (same buckets and options),
    of the gradient pre-divided by P and cast to float16."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "quantised"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun()  # its defaults take its one branch
    resume = ResumeState("")  # nothing of its own: the model and the loop's optimizer

    wire_op = "sum"

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return to_fp16(flat / self.comm.size)

    def decode(self, wire: torch.Tensor, flat: torch.Tensor) -> None:
        flat.copy_(from_fp16(wire, flat.dtype))
