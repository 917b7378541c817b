"""PyTorch DistributedDataParallel: the external reference for dense synchronous SGD, plain and
with its gradient compression hooks.

``ddp``: DDP allreduces gradients inside backward with its own buckets and hooks, so the
Communicator does not see its collectives; their cost is the same ring allreduce of every
gradient, and this module records exactly that (one ring allreduce of all parameters per step) so
that the bytes axis of the reports compares like with like.

``ddp_bf16`` and ``ddp_fp16``: DDP with a communication hook that does what torch's
``bf16_compress_hook`` / ``fp16_compress_hook`` do (``torch.distributed.algorithms.ddp_comm_hooks.
default_hooks``), bucket by bucket::

    wire = bucket.to(bfloat16 | float16).div_(P)     # cast, then pre-divide in the wire dtype
    allreduce(wire, sum)                             # summed in the wire dtype
    bucket.copy_(wire)                               # back to float32: the averaged gradient

The strongest dense baselines: DDP's buckets and overlap with backward, half the bytes. The hook
runs its allreduce through the Communicator (``comm.all_reduce_async``, whose work's future DDP
waits on), so the bytes are counted as sent, 2 per element; methods never import
torch.distributed, which torch's own hook function lives in. It is torch's hook arithmetic, step for
step: tests/test_ddp_compressed.py checks it against torch's ``bf16_compress_hook`` bit for bit.
One step is one global reduction.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.nn.parallel import DistributedDataParallel

from commlab.algorithms.base import Algorithm, StepInfo
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


class CompressedDDP(DDP):
    """DDP whose buckets are allreduced in ``wire_dtype`` through the Communicator (the module
    docstring has the arithmetic).

    Example (on every rank of a gloo world)::

        driven = drive("ddp_bf16", None, model=model, steps=1, batches=batches)
        driven.comm.stats.totals()["bytes_sent"]    # the initial broadcast, then 2 bytes per element
    """

    wire_dtype: ClassVar[torch.dtype]

    def setup(self) -> None:
        super().setup()
        self._ddp.register_comm_hook(None, self._compressed_allreduce)

    def _compressed_allreduce(self, state, bucket):
        """DDP's communication hook (named arguments as DDP checks them; no annotations)."""
        buffer = bucket.buffer()
        wire = buffer.to(self.wire_dtype).div_(self.comm.size)
        pending = self.comm.all_reduce_async(wire, op="sum")

        def decompress(future):
            buffer.copy_(future.value()[0])
            return buffer

        return pending.work.get_future().then(decompress)

    def after_backward(self, info: StepInfo) -> None:
        # The hook's allreduces were counted as they ran inside backward; the step is one reduction.
        self.comm.stats.add_reduction("global")


@ALGORITHMS.register("ddp_bf16")
class DDPBF16(CompressedDDP):
    """DDP with bfloat16 gradient buckets on the wire (torch's ``bf16_compress_hook``)."""

    wire_dtype = torch.bfloat16


@ALGORITHMS.register("ddp_fp16")
class DDPFP16(CompressedDDP):
    """DDP with float16 gradient buckets on the wire (torch's ``fp16_compress_hook``)."""

    wire_dtype = torch.float16
