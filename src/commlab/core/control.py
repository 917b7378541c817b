"""The control channel: collectives that are instrumentation, outside the Communicator's accounting.

Some traffic serves the run, not the method: the loop's log-point allreduce (mean loss, stop
requests), a method's max-over-ranks metrics, a selection-accuracy probe, the world average of
the replicas that an evaluation scores. Counting it would change the bytes and reductions a
method is judged by, so it goes through this channel, which records nothing. Its tensors live on
:func:`collective_device`, the device the group's backend reduces on.

Example (every rank of a gloo group runs it)::

    >>> control = ControlChannel()                        # over the world
    >>> worst = control.all_reduce(torch.tensor([float(rank)], device=control.device), op="max")
    >>> worst.item() == control.size - 1
    True
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where small tensors of ``group``'s collectives must live: this rank's CUDA device under
    NCCL, the CPU under gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ControlChannel:
    """Uncounted allreduce and broadcast over a process group (the world by default).

    Args:
        group: the process group (None: the world). The channel of a method covers the same
            ranks as its Communicator.

    Example::

        >>> control = ControlChannel()
        >>> both = control.all_reduce(torch.tensor([1.0, 2.0], device=control.device), op="max")
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = collective_device(group)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over the group; ``op`` is sum, avg (the sum divided by the size), max or min."""
        if op not in (*OPS, "avg"):
            raise ValueError(f"op must be one of {[*OPS, 'avg']}, got {op!r}")
        if self.size > 1:
            dist.all_reduce(tensor, op=OPS.get(op, dist.ReduceOp.SUM), group=self.group)
            if op == "avg":
                tensor.div_(self.size)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place from group rank ``src``."""
        if self.size > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src,
                           group=self.group)
        return tensor
