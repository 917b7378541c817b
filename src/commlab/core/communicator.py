"""The Communicator: the one door through which every collective of every method passes.

It wraps torch.distributed for the world or for a subgroup and records, per call, the operation,
the scope (``global`` for the whole world, ``local`` for a subgroup), the elements and bytes this
rank sent and received, the point-to-point messages it sent, and the seconds it took. The numbers
are the cost of the algorithm gloo runs for each call (:mod:`commlab.core.costs`), computed
exactly from the tensor shapes rather than estimated, and checked against the bytes emulated links
carry (docs/network.md, "Bytes on the wire"); the seconds come from the run's device clock
(docs/network.md, "What the seconds mean"):

=====================  =====================================================================
operation              elements sent / received by rank i of P (n elements), messages sent
=====================  =====================================================================
all_reduce (ring)      sent = 2n - g_i - g_{i-1},  recv = 2n - g_i - g_{i+1}  (gloo's chunks g_j,
                       below; = 2n(P-1)/P each when they are even); one message per non-empty
                       segment sent (up to 2(P-1) S/P)
all_gather             sent = recv = (P-1) m (m elements per rank); the ring: 2(P-1) messages
                       (halves); on gloo a CPU block up to 14 KiB goes directly to every rank
                       (one all_to_all of P copies): P-1 messages
reduce_scatter         sent = recv = (P-1) n / P: on gloo one all_to_all of the P blocks and a
                       local sum (gloo's own reduce_scatter allreduces all n); P-1 messages
broadcast (binomial)   recv = n unless root;  sent = n per child in the tree: the root
                       ceil(log2 P) copies, ranks in the last half none
all_to_all             sent = sum of splits to others, recv = sum of splits from others; P-1
all_gatherv            sizes exchanged by all_gather, then an all_gather of every rank's rows
                       zero-padded to the largest rank's m elements: sent = recv = (P-1) m
send / recv            n; one message (the sender's)
barrier                nothing; ceil(log2 P) empty messages
=====================  =====================================================================

gloo's ring cuts the tensor into S = roundUp(max(ceil(bytes / 1 MiB), 2P), P) segments of
ceil(n / S) elements; rank j's chunk g_j is S/P consecutive segments (so the last chunks may be
short or empty). Every message also costs gloo's framing on the wire
(:data:`~commlab.core.costs.GLOO_FRAMING_BYTES`), which the byte counts leave out: they count
tensor data, as the papers do.

A *reduction* is a semantic event (one gradient or model synchronisation), which may take several
collectives (buckets, a scalar side-channel): methods mark it with ``with comm.reduction():`` so
that "global reductions" counts what the papers count.

Seconds come from the run's device clock (:mod:`commlab.core.clock`): CUDA events on the current
stream for CUDA tensors (device time, read at log points), host time for CPU tensors. No call
synchronises the device: the backend orders a collective's result before later work on the
current stream. A synchronous call records its own duration, not the work queued before it; an
asynchronous one (:meth:`Communicator.all_reduce_async`) records its launch as ``comm_seconds``,
and the time the stream then waits for it in :meth:`Pending.wait` as ``blocked_seconds``.

Usage::

    comm = Communicator(stats=CommStats())
    with comm.reduction():
        comm.all_reduce(flat_grads, op="avg")
    comm.stats.totals()["bytes_sent"]
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from commlab.core.clock import DeviceClock, Span
from commlab.core.control import collective_device
from commlab.core.costs import (
    broadcast_sends,
    ring_allreduce_cost,
    ring_allreduce_messages,
    ring_chunks,
)
from commlab.core.stats import CommStats

__all__ = ["Communicator", "Pending", "ring_allreduce_cost", "ring_chunks"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# torch 2.14 renamed the flat collectives; use the new names where they exist.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _direct_gather_bytes(default: int = 14 * 1024) -> int:
    """gloo all_gathers of CPU blocks up to this many bytes go in one all_to_all
    (:meth:`Communicator.all_gather`): by default about TCP's initial congestion window (10
    segments of 1448 B), so that each goes in one flight; ``COMMLAB_DIRECT_GATHER_BYTES`` sets it."""
    text = os.environ.get("COMMLAB_DIRECT_GATHER_BYTES", "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"COMMLAB_DIRECT_GATHER_BYTES must be a number of bytes >= 0, got {text!r}")
    return int(text)


DIRECT_GATHER_BYTES = _direct_gather_bytes()
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Pending:
    """An asynchronous collective in flight. ``wait()`` makes the current stream (the host, on
    the CPU) wait for it and records that wait as blocked time."""

    work: dist.Work | None
    comm: Communicator
    op: str
    result: torch.Tensor | None = None
    done: bool = False

    def wait(self) -> torch.Tensor | None:
        if not self.done:
            clock = self.comm.clock
            span = clock.start(None if self.result is None else self.result.device)
            if self.work is not None:
                self.work.wait()
            clock.stop(span, self.comm.stats.blocked_time())
            self.done = True
            if self.op == "avg" and self.result is not None:
                self.result.div_(self.comm.size)
        return self.result

    def is_completed(self) -> bool:
        return self.done or self.work is None or self.work.is_completed()


class Communicator:
    """Collectives over the world (``scope='global'``) or a subgroup (``scope='local'``)."""

    def __init__(self, group: dist.ProcessGroup | None = None, scope: str = "global",
                 stats: CommStats | None = None, clock: DeviceClock | None = None):
        if scope not in ("global", "local"):
            raise ValueError(f"scope must be 'global' or 'local', got {scope!r}")
        if not dist.is_initialized():
            raise RuntimeError("the process group is not initialised: call init_runtime() first")
        self.group = group
        self.scope = scope
        self.stats = stats if stats is not None else CommStats()
        self.clock = clock if clock is not None else (self.stats.clock or DeviceClock())
        if self.stats.clock is None:
            self.stats.clock = self.clock  # the counters' readers resolve the clock first
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._global_ranks = (
            list(range(self.size)) if group is None else dist.get_process_group_ranks(group)
        )
        self._gloo = dist.get_backend(group) == "gloo"
        # gloo moves CUDA tensors in its collectives but not point to point: send/recv stage them.
        self._stage_p2p = self._gloo

    # ------------------------------------------------------------------ structure
    def subgroup(self, group: dist.ProcessGroup) -> Communicator:
        """A Communicator over ``group`` that records into the same stats as ``local``."""
        return Communicator(group, scope="local", stats=self.stats, clock=self.clock)

    @contextmanager
    def reduction(self):
        """Mark one semantic synchronisation (counted once however many collectives it takes)."""
        self.stats.add_reduction(self.scope)
        yield

    def _start(self, t: torch.Tensor) -> Span:
        return self.clock.start(t.device)

    def _record(self, span: Span, op: str, sent: int, recv: int, esize: int, messages: int = 0) -> None:
        """Count the call now; its seconds reach the record when the clock reads ``span``."""
        self.clock.stop(span, self.stats.comm_time(self.stats.record(op, self.scope, sent, recv, esize,
                                                                     messages=messages)))

    def _record_all_reduce(self, span: Span, tensor: torch.Tensor) -> None:
        n, esize = tensor.numel(), tensor.element_size()
        sent, recv = ring_allreduce_cost(n, self.size, self.rank, esize)
        self._record(span, "all_reduce", sent, recv, esize, ring_allreduce_messages(n, self.size, self.rank, esize))

    # ------------------------------------------------------------------ dense collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce; ``op`` is sum, avg, max or min (avg = sum / size, gloo has no AVG)."""
        if op not in (*_OPS, "avg"):
            raise ValueError(f"op must be one of {[*_OPS, 'avg']}, got {op!r}")
        span = self._start(tensor)
        dist.all_reduce(tensor, op=_OPS.get(op, dist.ReduceOp.SUM), group=self.group)
        if op == "avg":
            tensor.div_(self.size)
        self._record_all_reduce(span, tensor)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "sum") -> Pending:
        """Start an in-place allreduce and return at once; the caller overlaps work and waits.

        The launch is recorded as communication time; the time the stream (the host, on the CPU)
        then waits in ``Pending.wait()`` is recorded as *blocked* time, which is what overlapping
        methods reduce."""
        if op not in ("sum", "avg"):
            raise ValueError(f"async op must be 'sum' or 'avg', got {op!r}")
        span = self._start(tensor)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._record_all_reduce(span, tensor)
        return Pending(work, self, op, result=tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from group rank ``src``."""
        span = self._start(tensor)
        dist.broadcast(tensor, src=self._global_ranks[src], group=self.group)
        n, copies = tensor.numel(), broadcast_sends(self.size, self.rank, src)
        recv = 0 if self.rank == src else n
        self._record(span, "broadcast", n * copies, recv, tensor.element_size(), copies)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gather equal-size tensors from every rank: returns shape ``(size, *tensor.shape)``.

        gloo's ring takes P-1 steps one after the other, each a message a rank must wait for: for
        a small block the steps' latency is the whole cost, whatever the block's size, and one
        all_to_all costs less. So on gloo a CPU block of at most ``DIRECT_GATHER_BYTES`` (about
        TCP's initial window: it leaves in one flight) goes directly to every rank in one
        all_to_all: the same elements sent and received, P-1 messages instead of the ring's 2(P-1)
        halves. Larger blocks keep the ring, whose every step reuses one warm connection: sent
        directly, a block past the initial window is slower on an emulated link. NCCL always keeps
        its own allgather. ``COMMLAB_DIRECT_GATHER_BYTES`` moves the limit (0: always the ring)."""
        flat = tensor.contiguous().view(-1)
        # Flat buffers: gloo checks that the output is exactly size x input elements.
        out = torch.empty(self.size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
        direct = self._direct_gather(flat)
        span = self._start(tensor)
        if direct:
            dist.all_to_all_single(out, flat.repeat(self.size), group=self.group)
        else:
            _all_gather_flat(out, flat, group=self.group)
        m = flat.numel() * (self.size - 1)
        messages = (self.size - 1 if direct else 2 * (self.size - 1)) if m else 0  # nothing for an empty tensor
        self._record(span, "all_gather", m, m, tensor.element_size(), messages)
        return out.view(self.size, *tensor.shape)

    def _direct_gather(self, flat: torch.Tensor) -> bool:
        """Whether :meth:`all_gather` sends ``flat`` to every rank in one all_to_all."""
        return (self._gloo and self.size > 1 and flat.device.type == "cpu"
                and flat.numel() * flat.element_size() <= DIRECT_GATHER_BYTES)

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or average) ``tensor`` over ranks and return this rank's 1/size slice of dim 0."""
        if tensor.shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by the group size {self.size}"
            )
        out = torch.empty(
            (tensor.shape[0] // self.size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
        )
        span = self._start(tensor)
        flat = tensor.contiguous().view(-1)
        if self.size > 1 and dist.get_backend(self.group) == "gloo":
            # gloo's reduce_scatter allreduces the whole input (2(P-1)/P n per rank on the wire);
            # exchanging the blocks directly moves the (P-1)/P n of the textbook reduce-scatter.
            blocks = torch.empty_like(flat)
            dist.all_to_all_single(blocks, flat, group=self.group)
            torch.sum(blocks.view(self.size, -1), dim=0, out=out.view(-1))  # rank order: deterministic
        else:
            _reduce_scatter_flat(out.view(-1), flat, group=self.group)
        if op == "avg":
            out.div_(self.size)
        m = out.numel() * (self.size - 1)
        self._record(span, "reduce_scatter", m, m, tensor.element_size(), self.size - 1)
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
        span = self._start(tensor)
        if self.size == 1:
            out.copy_(tensor)
        else:
            dist.all_to_all_single(out, tensor.contiguous(), recv_counts, send_counts, group=self.group)
        sent = (sum(send_counts) - send_counts[self.rank]) * row
        recv = (sum(recv_counts) - recv_counts[self.rank]) * row
        self._record(span, "all_to_all", sent, recv, tensor.element_size(), self.size - 1)
        return out, list(recv_counts)

    def exchange_counts(self, send_counts: list[int]) -> list[int]:
        """Tell every rank how many rows it will receive from each other rank."""
        device = self.device
        counts = torch.tensor(send_counts, dtype=torch.int64, device=device)
        out = torch.empty_like(counts)
        span = self._start(counts)
        if self.size == 1:
            out.copy_(counts)
        else:
            dist.all_to_all_single(out, counts, group=self.group)
        m = self.size - 1
        self._record(span, "all_to_all_counts", m, m, 8, m)
        return out.tolist()

    def all_gatherv(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> list[torch.Tensor]:
        """Gather tensors whose dim 0 differs across ranks (zero rows allowed). Returns one
        tensor per rank, in rank order, each with that rank's rows.

        Two collectives: the row counts (``all_gatherv_counts``, one int64 per rank; skipped when
        the caller knows every rank's ``sizes``), then one all_gather of every rank's rows padded
        with zeros to the largest count (``all_gatherv``): each rank sends and receives P-1 padded
        blocks, the padding included. When every rank has zero rows the second is skipped."""
        if sizes is None:
            n = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=self.device)
            sizes = [int(c) for c in self.all_gather(n).view(-1).tolist()]
            self.stats.relabel_last("all_gatherv_counts")
        width, rest = max(sizes), tuple(tensor.shape[1:])
        if width == 0:
            return [tensor.new_empty((0, *rest)) for _ in sizes]
        pad = width - tensor.shape[0]
        block = torch.cat([tensor, tensor.new_zeros((pad, *rest))]) if pad else tensor
        out = self.all_gather(block)
        self.stats.relabel_last("all_gatherv")
        return [out[j, :sizes[j]] for j in range(self.size)]

    @property
    def device(self) -> torch.device:
        """Where this group's small tensors (counts, sizes) live: the rank's CUDA device under
        NCCL, the CPU under gloo (:func:`commlab.core.control.collective_device`)."""
        return collective_device(self.group)

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        span = self._start(tensor)
        wire = tensor.contiguous()
        if wire.is_cuda and self._stage_p2p:
            wire = wire.cpu()
        dist.send(wire, dst=self._global_ranks[dst], group=self.group)
        self._record(span, "send", tensor.numel(), 0, tensor.element_size(), 1)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        span = self._start(tensor)
        if tensor.is_cuda and self._stage_p2p:
            staged = torch.empty(tensor.shape, dtype=tensor.dtype)  # host-side: gloo receives on the CPU
            dist.recv(staged, src=self._global_ranks[src], group=self.group)
            tensor.copy_(staged)
        else:
            dist.recv(tensor, src=self._global_ranks[src], group=self.group)
        self._record(span, "recv", 0, tensor.numel(), tensor.element_size())
        return tensor

    def barrier(self) -> None:
        """Every rank waits for every other (host time: a barrier blocks the host on every backend)."""
        span = self.clock.start(None)
        dist.barrier(group=self.group)
        rounds = math.ceil(math.log2(self.size)) if self.size > 1 else 0
        self._record(span, "barrier", 0, 0, 0, rounds)

    # ------------------------------------------------------------------ a group of its own; any source
    def separate(self, stats: CommStats | None = None, timeout_s: float | None = None) -> Communicator:
        """A Communicator over the same ranks on a new gloo process group of its own, recording
        into ``stats`` (default: this one's). Every rank of the world calls it (creating a group is
        collective).

        For traffic that runs beside this Communicator's, from another thread (ASGD's parameter
        server: a group's operations must be issued in one order on every rank, so a thread needs
        a group of its own), and for :meth:`recv_any`, which NCCL does not offer (gloo moves CUDA
        tensors through host buffers). ``timeout_s`` bounds its waits (default: the world's)."""
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        group = dist.new_group(self._global_ranks, timeout=timeout, backend="gloo")
        # a clock of its own: another thread's intervals must not mix with this one's pending ones
        return Communicator(group, scope=self.scope, stats=stats if stats is not None else self.stats,
                            clock=DeviceClock())

    def recv_any(self, tensor: torch.Tensor) -> int:
        """Receive into ``tensor`` from whichever rank sends first; return that rank (in this
        group). gloo only (a group from :meth:`separate`); recorded like :meth:`recv`."""
        if dist.get_backend(self.group) != "gloo":
            raise RuntimeError("recv_any needs a gloo group (NCCL has no receive from any source): "
                               "use Communicator.separate()")
        span = self._start(tensor)
        # host-side: gloo receives point to point into host memory
        staged = torch.empty(tensor.shape, dtype=tensor.dtype) if tensor.is_cuda else tensor
        source = dist.recv(staged, src=None, group=self.group)
        if staged is not tensor:
            tensor.copy_(staged)
        self._record(span, "recv", 0, tensor.numel(), tensor.element_size())
        return self._global_ranks.index(source)
