"""PyTorch DistributedDataParallel: the external reference for dense synchronous SGD.

DDP allreduces gradients inside backward with its own buckets and hooks
(:mod:`commlab.algorithms.ddp_wrapper` builds it), so the Communicator does not see its
collectives; their cost is the same ring allreduce of every gradient, and this module records
exactly that (one ring allreduce of all parameters per step) so that the bytes axis of the reports
compares like with like. Its compressed forms, ``ddp_bf16`` and ``ddp_fp16``, run their hook's
allreduce through the Communicator instead (:mod:`commlab.algorithms.compressed_ddp`).

Invariants: one step is one global reduction; every rank applies the same averaged gradient, so
the replicas stay bitwise equal; buffers (BatchNorm statistics) stay each rank's own, as in ``ssgd``.
"""

from __future__ import annotations

from commlab.algorithms.base import QuickRun, ResumeState, StepInfo, SyncBudget
from commlab.algorithms.ddp_wrapper import WrappedDDP
from commlab.core.costs import ring_allreduce_cost, ring_allreduce_messages
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("ddp")
class DDP(WrappedDDP):
    """Wrap the model in DistributedDataParallel; the loop runs forward/backward on the wrapper."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "dense"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun()  # its defaults take its one branch
    resume = ResumeState("")  # nothing of its own: the model and the loop's optimizer

    def setup(self) -> None:
        super().setup()
        self._numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self._esize = next(self.model.parameters()).element_size()

    def after_backward(self, info: StepInfo) -> None:
        # Account for the allreduce DDP already ran inside backward (time is inside compute).
        n, p, i = self._numel, self.comm.size, self.comm.rank
        sent, recv = ring_allreduce_cost(n, p, i, self._esize)
        self.comm.stats.record("ddp_all_reduce", "global", sent, recv, self._esize, 0.0,
                               ring_allreduce_messages(n, p, i, self._esize))
        self.comm.stats.add_reduction("global")
