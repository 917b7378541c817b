"""Synchronous SGD: dense allreduce of the gradients through the Communicator, bucketed.

The reference every paper compares against ("full-communication SGD", "dense allreduce").
Gradients are flattened into buckets of about ``bucket_mb`` megabytes (as DDP does) and each
bucket is averaged with one ring allreduce; one step is one global reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.algorithms.base import Algorithm, StepInfo
from commlab.algorithms.tensors import flat_grads, grad_buckets, write_grads
from commlab.registry import ALGORITHMS


def allreduce_gradients(buckets: list[list[torch.nn.Parameter]], comm) -> None:
    """Average every parameter's gradient over the communicator, one allreduce per bucket."""
    for bucket in buckets:
        flat = comm.all_reduce(flat_grads(bucket), op="avg")
        write_grads(bucket, flat)


@ALGORITHMS.register("ssgd")
class SynchronousSGD(Algorithm):
    """Average gradients every step with a bucketed dense allreduce."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)

    @dataclass
    class Options:
        bucket_mb: float = 25.0  # bucket size in MB, as DDP's default bucket_cap_mb

        def validate(self) -> None:
            if self.bucket_mb <= 0:
                raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")

    def setup(self) -> None:
        super().setup()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.buckets = grad_buckets(params, int(self.options.bucket_mb * 2**20))

    def after_backward(self, info: StepInfo) -> None:
        with self.comm.reduction():
            allreduce_gradients(self.buckets, self.comm)
