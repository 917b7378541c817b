"""Synchronous SGD: dense allreduce of the gradients through the Communicator, bucketed.

The reference every paper compares against ("full-communication SGD", "dense allreduce").
Gradients are flattened into buckets of about ``bucket_mb`` megabytes (as DDP does) and each
bucket is averaged with one ring allreduce; one step is one global reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.algorithms.base import Algorithm, StepInfo
from commlab.registry import ALGORITHMS


def grad_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group parameters, in reverse order (the order backward produces them), into buckets."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def allreduce_gradients(buckets: list[list[torch.nn.Parameter]], comm) -> None:
    """Average every parameter's gradient over the communicator, one allreduce per bucket."""
    for bucket in buckets:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, op="avg")
        offset = 0
        for p in bucket:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n


@ALGORITHMS.register("ssgd")
class SynchronousSGD(Algorithm):
    """Average gradients every step with a bucketed dense allreduce."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.costmodel.PATTERNS)

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
