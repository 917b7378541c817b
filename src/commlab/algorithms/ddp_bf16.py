"""ddp_bf16: PyTorch DDP with bfloat16 gradient buckets on the wire, torch's ``bf16_compress_hook``
arithmetic run through the Communicator (:mod:`commlab.algorithms.compressed_ddp` has the
arithmetic and the invariants). bfloat16 keeps float32's exponent range with 8 bits of mantissa.
"""

from __future__ import annotations

import torch

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.compressed_ddp import CompressedDDP
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("ddp_bf16")
class DDPBF16(CompressedDDP):
    """DDP with bfloat16 gradient buckets on the wire (torch's ``bf16_compress_hook``)."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "quantised"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun()  # its defaults take its one branch
    resume = ResumeState("")  # nothing of its own: the model and the loop's optimizer

    wire_dtype = torch.bfloat16
