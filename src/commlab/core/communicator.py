"""The Communicator: the one door through which every collective of every method passes.

It wraps torch.distributed for the world or for a subgroup and records, per call, the operation,
the scope (``global`` for the whole world, ``local`` for a subgroup), the elements and bytes this
rank sent and received, and the wall time. The numbers are the *standard cost* of the algorithm
each backend runs (gloo and NCCL both use rings for these sizes), computed exactly from the tensor
shapes rather than estimated:

=====================  =====================================================================
operation              elements sent / received by rank i of P (n elements, chunks c_j)
=====================  =====================================================================
all_reduce (ring)      sent = 2n - c_{i+1} - c_{i+2},  recv = 2n - c_i - c_{i+1}
                       (reduce-scatter then allgather; = 2n(P-1)/P each when P divides n)
all_gather (ring)      sent = recv = (P-1) m          (m elements per rank)
reduce_scatter (ring)  sent = recv = (P-1) n / P
broadcast (pipeline)   recv = n unless root;  sent = n unless i is the ring predecessor of root
all_to_all             sent = sum of splits to others, recv = sum of splits from others
all_gatherv            sizes exchanged by all_gather, then all_to_all: sent = (P-1) n_i,
                       recv = sum_{j != i} n_j
send / recv            n
=====================  =====================================================================

Chunks follow the ring convention c_j = n // P + (1 if j < n % P else 0), indices mod P.

A *reduction* is a semantic event (one gradient or model synchronisation), which may take several
collectives (buckets, a scalar side-channel): methods mark it with ``with comm.reduction():`` so
that "global reductions" counts what the papers count.

Usage::

    comm = Communicator(stats=CommStats())
    with comm.reduction():
        comm.all_reduce(flat_grads, op="avg")
    comm.stats.totals()["bytes_sent"]
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commlab.core.control import collective_device
from commlab.core.stats import CommStats

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def ring_chunks(n: int, p: int) -> list[int]:
    """Chunk sizes of an ``n``-element tensor split over a ring of ``p`` ranks."""
    return [n // p + (1 if j < n % p else 0) for j in range(p)]


def ring_allreduce_cost(n: int, p: int, i: int) -> tuple[int, int]:
    """Elements (sent, received) by rank ``i`` in a ring allreduce of ``n`` elements."""
    if p == 1:
        return 0, 0
    c = ring_chunks(n, p)
    return 2 * n - c[(i + 1) % p] - c[(i + 2) % p], 2 * n - c[i] - c[(i + 1) % p]


# torch 2.14 renamed the flat collectives; use the new names where they exist.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Pending:
    """An asynchronous collective in flight. ``wait()`` blocks and records the blocked time."""

    work: dist.Work | None
    comm: Communicator
    op: str
    started: float
    result: torch.Tensor | None = None
    done: bool = False

    def wait(self) -> torch.Tensor | None:
        if not self.done:
            t0 = time.perf_counter()
            if self.work is not None:
                self.work.wait()
            blocked = time.perf_counter() - t0
            self.comm.stats.add_blocked(blocked)
            self.done = True
            if self.op == "avg" and self.result is not None:
                self.result.div_(self.comm.size)
        return self.result

    def is_completed(self) -> bool:
        return self.done or self.work is None or self.work.is_completed()


class Communicator:
    """Collectives over the world (``scope='global'``) or a subgroup (``scope='local'``)."""

    def __init__(self, group: dist.ProcessGroup | None = None, scope: str = "global",
                 stats: CommStats | None = None):
        if scope not in ("global", "local"):
            raise ValueError(f"scope must be 'global' or 'local', got {scope!r}")
        if not dist.is_initialized():
            raise RuntimeError("the process group is not initialised: call init_runtime() first")
        self.group = group
        self.scope = scope
        self.stats = stats if stats is not None else CommStats()
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._global_ranks = (
            list(range(self.size)) if group is None else dist.get_process_group_ranks(group)
        )
        # gloo moves CUDA tensors in its collectives but not point to point: send/recv stage them.
        self._stage_p2p = dist.get_backend(group) == "gloo"

    # ------------------------------------------------------------------ structure
    def subgroup(self, group: dist.ProcessGroup) -> Communicator:
        """A Communicator over ``group`` that records into the same stats as ``local``."""
        return Communicator(group, scope="local", stats=self.stats)

    @contextmanager
    def reduction(self):
        """Mark one semantic synchronisation (counted once however many collectives it takes)."""
        self.stats.add_reduction(self.scope)
        yield

    def _record(self, op: str, sent: int, recv: int, esize: int, seconds: float) -> None:
        self.stats.record(op, self.scope, sent, recv, esize, seconds)

    def _sync_device(self, t: torch.Tensor) -> None:
        # CUDA collectives are asynchronous: time them to completion so seconds mean something.
        if t.is_cuda:
            torch.cuda.synchronize(t.device)

    # ------------------------------------------------------------------ dense collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce; ``op`` is sum, avg, max or min (avg = sum / size, gloo has no AVG)."""
        if op not in (*_OPS, "avg"):
            raise ValueError(f"op must be one of {[*_OPS, 'avg']}, got {op!r}")
        t0 = time.perf_counter()
        dist.all_reduce(tensor, op=_OPS.get(op, dist.ReduceOp.SUM), group=self.group)
        if op == "avg":
            tensor.div_(self.size)
        self._sync_device(tensor)
        sent, recv = ring_allreduce_cost(tensor.numel(), self.size, self.rank)
        self._record("all_reduce", sent, recv, tensor.element_size(), time.perf_counter() - t0)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Pending:
        """Start an in-place allreduce and return at once; the caller overlaps work and waits.

        The call's own time is recorded as communication time; the time spent in ``wait()`` is
        recorded as *blocked* time, which is what delayed-update methods reduce."""
        if op not in ("sum", "avg"):
            raise ValueError(f"async op must be 'sum' or 'avg', got {op!r}")
        t0 = time.perf_counter()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        sent, recv = ring_allreduce_cost(tensor.numel(), self.size, self.rank)
        self._record("all_reduce", sent, recv, tensor.element_size(), time.perf_counter() - t0)
        return Pending(work, self, op, t0, result=tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``src``."""
        t0 = time.perf_counter()
        dist.broadcast(tensor, src=self._global_ranks[src], group=self.group)
        self._sync_device(tensor)
        n, p = tensor.numel(), self.size
        recv = 0 if self.rank == src or p == 1 else n
        sent = 0 if p == 1 or self.rank == (src - 1) % p else n
        self._record("broadcast", sent, recv, tensor.element_size(), time.perf_counter() - t0)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gather equal-size tensors from every rank: returns shape ``(size, *tensor.shape)``."""
        # Flat buffers: gloo checks that the output is exactly size x input elements.
        out = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        t0 = time.perf_counter()
        _all_gather_flat(out, tensor.contiguous().view(-1), group=self.group)
        out = out.view(self.size, *tensor.shape)
        self._sync_device(out)
        m = tensor.numel() * (self.size - 1)
        self._record("all_gather", m, m, tensor.element_size(), time.perf_counter() - t0)
        return out

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or average) ``tensor`` over ranks and return this rank's 1/size slice of dim 0."""
        if tensor.shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by the group size {self.size}"
            )
        out = torch.empty(
            (tensor.shape[0] // self.size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        t0 = time.perf_counter()
        _reduce_scatter_flat(out.view(-1), tensor.contiguous().view(-1), group=self.group)
        if op == "avg":
            out.div_(self.size)
        self._sync_device(out)
        m = out.numel() * (self.size - 1)
        self._record("reduce_scatter", m, m, tensor.element_size(), time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------------ variable-size collectives
    def all_to_all_single(self, tensor: torch.Tensor, send_counts: list[int],
                          recv_counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Send ``send_counts[j]`` rows of ``tensor`` (in order) to rank j; receive from all.

        When ``recv_counts`` is not given the counts are exchanged first (one small all_to_all,
        recorded too). Returns the received rows, concatenated in rank order, and the counts."""
        if len(send_counts) != self.size or sum(send_counts) != tensor.shape[0]:
            raise ValueError(
                f"send_counts {send_counts} must have {self.size} entries summing to {tensor.shape[0]}"
            )
        if recv_counts is None:
            recv_counts = self.exchange_counts(send_counts)
        row = math.prod(tensor.shape[1:])  # elements per row (a tensor may have no rows)
        out = torch.empty((sum(recv_counts), *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        t0 = time.perf_counter()
        if self.size == 1:
            out.copy_(tensor)
        else:
            dist.all_to_all_single(out, tensor.contiguous(), recv_counts, send_counts, group=self.group)
        self._sync_device(out)
        sent = (sum(send_counts) - send_counts[self.rank]) * row
        recv = (sum(recv_counts) - recv_counts[self.rank]) * row
        self._record("all_to_all", sent, recv, tensor.element_size(), time.perf_counter() - t0)
        return out, list(recv_counts)

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        """Tell every rank how many rows it will receive from each other rank."""
        device = self.device
        counts = torch.tensor(send_counts, dtype=torch.int64, device=device)
        out = torch.empty_like(counts)
        t0 = time.perf_counter()
        if self.size == 1:
            out.copy_(counts)
        else:
            dist.all_to_all_single(out, counts, group=self.group)
        self._sync_device(out)
        m = self.size - 1
        self._record("all_to_all_counts", m, m, 8, time.perf_counter() - t0)
        return out.tolist()

    def all_gatherv(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather tensors whose dim 0 differs across ranks (zero rows allowed). Returns one
        tensor per rank, in rank order, each with that rank's rows."""
        device = self.device
        n = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=device)
        sizes = self.all_gather(n).view(-1).tolist()
        self.stats.relabel_last("all_gatherv_counts")
        rows = tensor.shape[0]
        # Send our rows to every rank: all_to_all with the same block for each destination.
        payload = tensor.contiguous().repeat((self.size,) + (1,) * (tensor.dim() - 1)) \
            if self.size > 1 else tensor
        out, _ = self.all_to_all_single(payload, [rows] * self.size, sizes)
        self.stats.relabel_last("all_gatherv")
        return list(torch.split(out, sizes, dim=0))

    @property
    def device(self) -> torch.device:
        """Where this group's small tensors (counts, sizes) live: the rank's CUDA device under
        NCCL, the CPU under gloo (:func:`commlab.core.control.collective_device`)."""
        return collective_device(self.group)

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        t0 = time.perf_counter()
        wire = tensor.contiguous()
        if wire.is_cuda and self._stage_p2p:
            wire = wire.cpu()
        dist.send(wire, dst=self._global_ranks[dst], group=self.group)
        self._record("send", tensor.numel(), 0, tensor.element_size(), time.perf_counter() - t0)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        t0 = time.perf_counter()
        if tensor.is_cuda and self._stage_p2p:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype)  # host-side: gloo receives on the CPU
            dist.recv(staged, src=self._global_ranks[src], group=self.group)
            tensor.copy_(staged)
        else:
            dist.recv(tensor, src=self._global_ranks[src], group=self.group)
        self._record("recv", 0, tensor.numel(), tensor.element_size(), time.perf_counter() - t0)
        return tensor

    def barrier(self) -> None:
        t0 = time.perf_counter()
        dist.barrier(group=self.group)
        self._record("barrier", 0, 0, 0, time.perf_counter() - t0)
