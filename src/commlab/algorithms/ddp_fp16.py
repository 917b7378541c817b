"""ddp_fp16: PyTorch DDP with float16 gradient buckets on the wire, torch's ``fp16_compress_hook``
arithmetic run through the Communicator (:mod:`commlab.algorithms.compressed_ddp` has the
arithmetic and the invariants). float16 has 11 bits of mantissa and a narrower range: the
gradient is divided by P before the sum, as torch does, so that the sum stays in range.
"""

from __future__ import annotations

import torch

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.compressed_ddp import CompressedDDP
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("ddp_fp16")
class DDPFP16(CompressedDDP):
    """DDP with float16 gradient buckets on the wire (torch's ``fp16_compress_hook``)."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "quantised"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun()  # its defaults take its one branch
    resume = ResumeState("")  # nothing of its own: the model and the loop's optimizer

    wire_dtype = torch.float16
