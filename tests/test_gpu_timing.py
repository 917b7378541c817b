"""The device clock on CUDA (marked ``gpu``: ``make test-gpu``; skipped without CUDA).

* A long kernel queued before an allreduce is not charged to the allreduce: the Communicator's
  seconds for the call stay far below the kernel's, while host time from the call to the device's
  completion (what a host clock with a ``synchronize`` at the end reads) includes it. On a world
  of one on NCCL and on two gloo ranks sharing the GPU with CUDA tensors; nothing is read per
  call (the interval is pending until the stats are read).
* An asynchronous allreduce waited on before it completes is blocked time: two gloo ranks with
  CUDA tensors, the second joining late, so the first one's wait lasts until it joins.

NCCL with several ranks needs a GPU per rank; the same checks over NCCL ranks run where there are
two GPUs or more.
"""

from __future__ import annotations

import time

import pytest
import torch

from commlab.testing import run_distributed

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]

KERNEL_S = 0.3  # the spin kernel queued before the allreduce
LATE_S = 0.4  # how late the second rank joins the asynchronous allreduce


def _spin_cycles(seconds: float) -> int:
    """GPU clock cycles for a ``torch.cuda._sleep`` of at least about ``seconds`` (the clock rate
    climbs while the GPU warms up, so the estimate is refined until a spin lasts long enough)."""
    cycles = 10_000_000
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        took = start.elapsed_time(end) / 1000
        if took >= seconds:
            break
        cycles = int(cycles * 1.2 * seconds / max(took, 1e-4))
    return cycles


def _kernel_then_allreduce(rank, world):
    from commlab.core import CommStats, Communicator

    device = torch.device("cuda", torch.cuda.current_device())
    comm = Communicator(stats=CommStats())
    x = torch.ones(1 << 20, device=device)
    comm.all_reduce(x)  # warm-up: communicators and buffers exist before the timed call
    x.fill_(1.0)
    cycles = _spin_cycles(KERNEL_S)
    comm.stats.totals()
    before = comm.stats.counters["comm_seconds"]
    spin = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    spin[0].record()
    if rank == 0:
        torch.cuda._sleep(cycles)  # queued: the host goes on at once
    spin[1].record()
    comm.all_reduce(x)
    pending = comm.clock.pending
    torch.cuda.synchronize(device)
    host_s = time.perf_counter() - t0
    charged = comm.stats.totals()["comm_seconds"] - before
    return {"kernel_s": spin[0].elapsed_time(spin[1]) / 1000, "host_s": host_s, "charged_s": charged,
            "pending": pending, "value": x[0].item()}


@pytest.mark.parametrize("backend, world", [("nccl", 1), ("gloo", 2)])
def test_a_kernel_queued_before_an_allreduce_is_not_charged_to_it(backend, world):
    results = run_distributed(_kernel_then_allreduce, world, backend=backend, device="cuda", timeout_s=120)
    first = results[0]
    assert all(r["value"] == world for r in results)
    assert first["kernel_s"] > 0.5 * KERNEL_S
    assert first["pending"] == 1  # the call's interval waits for the stats to be read
    # Host time to completion includes the kernel (the old reading); the device clock does not.
    assert first["host_s"] > 0.8 * first["kernel_s"], first
    assert first["charged_s"] < 0.25 * first["kernel_s"], first


def _late_peer(rank, world):
    from commlab.core import CommStats, Communicator

    device = torch.device("cuda", torch.cuda.current_device())
    comm = Communicator(stats=CommStats())
    x = torch.full((1 << 20,), float(rank + 1), device=device)
    comm.all_reduce(torch.ones(4, device=device))  # warm-up
    comm.stats.totals()
    comm.stats.counters["blocked_seconds"] = comm.stats.counters["comm_seconds"] = 0.0
    if rank == 1:
        time.sleep(LATE_S)
    pending = comm.all_reduce_async(x, op="avg")
    result = pending.wait()  # rank 0: long before rank 1 has joined
    totals = comm.stats.totals()
    return {"blocked_s": totals["blocked_seconds"], "launch_s": totals["comm_seconds"],
            "value": result[0].item()}


def test_an_async_allreduce_waited_on_early_is_blocked_time():
    results = run_distributed(_late_peer, 2, backend="gloo", device="cuda", timeout_s=120)
    first = results[0]
    assert all(r["value"] == 1.5 for r in results)
    assert first["blocked_s"] > 0.5 * LATE_S, first
    assert first["launch_s"] < 0.5 * LATE_S, first
