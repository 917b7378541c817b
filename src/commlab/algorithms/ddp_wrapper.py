"""PyTorch DistributedDataParallel around the model: what ``ddp``, ``ddp_bf16`` and ``ddp_fp16``
share (:mod:`commlab.algorithms.ddp`, :mod:`commlab.algorithms.compressed_ddp`).

The loop runs forward and backward on the wrapper (``forward_model``), so DDP allreduces the
gradients inside backward with its own buckets and overlap. It is built as a GPU user builds it:
on the rank's own GPU (several gloo ranks may share one), gradients as views into its buckets
(``gradient_as_bucket_view``), no initial sync (every replica starts from rank 0's through the
Communicator, counted, in ``Algorithm.setup``) and no buffer broadcast before every forward, as
``ssgd`` does none either: BatchNorm statistics stay each rank's own.

Invariants: every rank applies the same averaged gradient, so the replicas stay bitwise equal.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from commlab.algorithms.base import Algorithm

# No buffer sync at each forward. torch 2.14 names it forward_sync_buffers (broadcast_buffers warns
# as deprecated); its False still syncs buffers at construction, which init_sync=False below skips
# with the parameters' sync: the same behaviour as broadcast_buffers=False on older torch.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})


@dataclass
class DDPOptions:
    """The wrapper's options."""

    bucket_mb: float = 25.0  # DDP's bucket_cap_mb

    def validate(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")


class WrappedDDP(Algorithm):
    """The model wrapped in DistributedDataParallel (the module docstring); the loop runs
    forward/backward on the wrapper. What is counted of its allreduces is the subclass's."""

    Options = DDPOptions

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

    @property
    def forward_model(self) -> torch.nn.Module:
        return self._ddp
