"""The dense gradient allreduce of synchronous SGD, bucketed and overlapped with backward as
PyTorch's DDP does it (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, section 3.2): what ``ssgd`` and ``fp16`` share (:mod:`commlab.algorithms.ssgd`,
:mod:`commlab.algorithms.fp16`), and the blocking bucketed average the periodic methods' dense
warm-up steps take (:func:`allreduce_gradients`).

* the gradients live in flat buckets of about ``bucket_mb`` megabytes (parameters in reverse
  order, the order backward produces them); each parameter's ``.grad`` is a view into its
  bucket, so no gradient is copied into a message or back;
* as soon as backward has accumulated the last gradient of a bucket
  (``Tensor.register_post_accumulate_grad_hook``), that bucket's allreduce starts asynchronously
  (``comm.all_reduce_async``), while backward computes the next layers' gradients. Buckets start
  in bucket order on every rank (a bucket that is ready early waits for the ones before it), so
  every rank issues the same sequence of collectives;
* ``after_backward`` starts what has not started (gradients written without a backward, a
  parameter this forward did not use) and waits for every bucket, once, before the optimizer
  step; the wire is decoded into the bucket (plain: the average, sum / P, taken in place).

A method on it chooses what travels (:meth:`BucketedAllreduce.encode`, ``wire_op``,
:meth:`BucketedAllreduce.decode`). Nothing synchronises the device per bucket. One step is one
global reduction; each bucket's allreduce is recorded with its exact ring cost, and the arithmetic
(the flat sum of the same buckets, divided by P) is that of a blocking bucketed allreduce, so the
numbers are the same. Seconds (device clock): a launch is ``comm_seconds`` (next to nothing), the
waits are ``blocked_seconds``, the communication backward did not hide; the hidden part is inside
the loop's compute seconds, as with ``ddp``.

The loop zeroes gradients in place (``zero_grad(set_to_none=False)``), which keeps the views; a
gradient replaced by another tensor is copied into its bucket and the view put back.

Invariants: every rank issues the same allreduces in the same order and decodes the same sum the
same way, so the replicas stay bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from commlab.algorithms.base import Algorithm, StepInfo
from commlab.algorithms.tensors import flat_grads, grad_buckets, write_grads
from commlab.core.communicator import Pending


def allreduce_gradients(buckets: list[list[torch.nn.Parameter]], comm) -> None:
    """Average every parameter's gradient over the communicator, one blocking allreduce per bucket
    (the dense warm-up steps of the periodic methods)."""
    for bucket in buckets:
        flat = comm.all_reduce(flat_grads(bucket), op="avg")
        write_grads(bucket, flat)


@dataclass
class GradBucket:
    """Parameters whose gradients are views into one flat tensor, and its allreduce in flight."""

    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    views: list[torch.Tensor]
    ready: int = 0  # gradients accumulated in this step's backward
    pending: Pending | None = None
    wire: torch.Tensor | None = field(default=None, repr=False)  # what the allreduce runs on

    @classmethod
    def of(cls, params: list[torch.nn.Parameter]) -> GradBucket:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"a gradient bucket needs one dtype and device, got {sorted(map(str, kinds))}")
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        bucket = cls(params, flat, views)
        bucket.attach()
        return bucket

    def attach(self) -> None:
        """Make every parameter's gradient its view (a gradient held elsewhere is copied in)."""
        with torch.no_grad():
            for p, view in zip(self.params, self.views, strict=True):
                self.attach_one(p, view)

    @staticmethod
    def attach_one(p: torch.nn.Parameter, view: torch.Tensor) -> None:
        grad = p.grad
        if grad is view or (grad is not None and grad.data_ptr() == view.data_ptr()):
            return
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        p.grad = view


@dataclass
class BucketOptions:
    """The bucketed allreduce's options."""

    bucket_mb: float = 25.0  # bucket size in MB, as DDP's default bucket_cap_mb

    def validate(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")


class BucketedAllreduce(Algorithm):
    """Average gradients every step with bucketed dense allreduces started during backward (the
    module docstring); what travels is :meth:`encode`'s tensor, allreduced with :attr:`wire_op`
    and put back by :meth:`decode` (here: the gradients themselves, averaged in place)."""

    Options = BucketOptions

    def setup(self) -> None:
        super().setup()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.buckets = [GradBucket.of(group) for group in grad_buckets(params, int(self.options.bucket_mb * 2**20))]
        self._next = 0  # the first bucket not started in this step
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                p.register_post_accumulate_grad_hook(partial(self._accumulated, bucket, view))

    # ---- the overlapped allreduce ------------------------------------------------------------------
    def _accumulated(self, bucket: GradBucket, view: torch.Tensor, p: torch.nn.Parameter) -> None:
        """Backward has accumulated ``p``'s gradient (a view into ``bucket``): start every bucket
        that is now complete."""
        if bucket.pending is not None:
            raise RuntimeError(f"{type(self).__name__}: a gradient was accumulated after its bucket's allreduce "
                               "had started (backward called twice in one step?)")
        with torch.no_grad():
            GradBucket.attach_one(p, view)
        bucket.ready += 1
        while self._next < len(self.buckets) and \
                self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: GradBucket) -> None:
        bucket.wire = self.encode(bucket.flat)
        bucket.pending = self.comm.all_reduce_async(bucket.wire, op=self.wire_op)
        self._next += 1

    #: The allreduce's op on the wire: the average of the gradients themselves.
    wire_op = "avg"

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """What the bucket's allreduce runs on (in place on the bucket: no copy)."""
        return flat

    def decode(self, wire: torch.Tensor, flat: torch.Tensor) -> None:
        """Put the allreduced wire back into the bucket (nothing to do when it ran in place)."""

    def after_backward(self, info: StepInfo) -> None:
        with self.comm.reduction():
            while self._next < len(self.buckets):
                bucket = self.buckets[self._next]
                bucket.attach()  # gradients written without backward, or parameters unused in it
                self._launch(bucket)
            with torch.no_grad():
                for bucket in self.buckets:
                    bucket.pending.wait()
                    self.decode(bucket.wire, bucket.flat)
                    bucket.pending = bucket.wire = None
                    bucket.ready = 0
        self._next = 0
