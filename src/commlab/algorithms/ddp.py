"""PyTorch DistributedDataParallel: the external reference for dense synchronous SGD.

DDP allreduces gradients inside backward with its own buckets and hooks, so the Communicator
does not see its collectives; their cost is the same ring allreduce of every gradient, and this
module records exactly that (one ring allreduce of all parameters per step) so that the bytes
axis of the reports compares like with like. Its compressed forms, ``ddp_bf16`` and
``ddp_fp16``, run their hook's allreduce through the Communicator instead
(:mod:`commlab.algorithms.compressed_ddp`).

Invariants: one step is one global reduction; every rank applies the same averaged gradient, so
the replicas stay bitwise equal; buffers (BatchNorm statistics) stay each rank's own, as in ``ssgd``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from commlab.algorithms.base import Algorithm, QuickRun, ResumeState, StepInfo, SyncBudget
from commlab.core.costs import ring_allreduce_cost, ring_allreduce_messages
from commlab.registry import ALGORITHMS

# No buffer sync at each forward. torch 2.14 names it forward_sync_buffers (broadcast_buffers warns
# as deprecated); its False still syncs buffers at construction, which init_sync=False below skips
# with the parameters' sync: the same behaviour as broadcast_buffers=False on older torch.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})


@ALGORITHMS.register("ddp")
class DDP(Algorithm):
    """Wrap the model in DistributedDataParallel; the loop runs forward/backward on the wrapper."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "dense"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun()  # its defaults take its one branch
    resume = ResumeState("")  # nothing of its own: the model and the loop's optimizer

    @dataclass
    class Options:
        bucket_mb: float = 25.0  # DDP's bucket_cap_mb

        def validate(self) -> None:
            if self.bucket_mb <= 0:
                raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")

    def setup(self) -> None:
        # Start from rank 0's replica through the Communicator (counted) instead of DDP's own
        # uncounted initial broadcast.
        super().setup()
        device = self.ctx.runtime.device
        # The rank's own GPU (several gloo ranks may share one), gradients as views into DDP's
        # buckets (no copy between them: what a GPU user runs), and no buffer broadcast at every
        # forward, as ssgd does not do one either (BatchNorm statistics stay per rank in both).
        self._ddp = DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=self.options.bucket_mb, gradient_as_bucket_view=True, init_sync=False,
            **NO_FORWARD_BUFFER_SYNC,
        )
        self._numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self._esize = next(self.model.parameters()).element_size()

    @property
    def forward_model(self) -> torch.nn.Module:
        return self._ddp

    def after_backward(self, info: StepInfo) -> None:
        # Account for the allreduce DDP already ran inside backward (time is inside compute).
        n, p, i = self._numel, self.comm.size, self.comm.rank
        sent, recv = ring_allreduce_cost(n, p, i, self._esize)
        self.comm.stats.record("ddp_all_reduce", "global", sent, recv, self._esize, 0.0,
                               ring_allreduce_messages(n, p, i, self._esize))
        self.comm.stats.add_reduction("global")
