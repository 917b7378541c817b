"""DistributedDataParallel whose gradient buckets travel in a narrower float dtype: the machinery
of ``ddp_bf16`` and ``ddp_fp16`` (:mod:`commlab.algorithms.ddp_bf16`, :mod:`commlab.algorithms.ddp_fp16`),
the strongest dense baselines (DDP's buckets and overlap with backward, half the bytes; the
wrapper is :mod:`commlab.algorithms.ddp_wrapper`'s, as ``ddp``'s).

A communication hook does what torch's ``bf16_compress_hook`` / ``fp16_compress_hook`` do
(``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``), bucket by bucket::

    wire = bucket.to(bfloat16 | float16).div_(P)     # cast, then pre-divide in the wire dtype
    allreduce(wire, sum)                             # summed in the wire dtype
    bucket.copy_(wire)                               # back to float32: the averaged gradient

The hook runs its allreduce through the Communicator (``comm.all_reduce_async``, whose work's
future DDP waits on), so the bytes are counted as sent, 2 per element; methods never import
torch.distributed, which torch's own hook function lives in. It is torch's hook arithmetic, step for
step: tests/test_ddp_compressed.py checks it against torch's ``bf16_compress_hook`` bit for bit.

Invariants: one step is one global reduction; every rank receives the same sum in the wire dtype
and widens it the same way, so the replicas stay bitwise equal.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from commlab.algorithms.base import StepInfo
from commlab.algorithms.ddp_wrapper import WrappedDDP


class CompressedDDP(WrappedDDP):
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
