"""Run a function on several gloo ranks in separate processes on this machine (benchmarks, tests).

    from commlab.launch.ranks import run_ranks

    def body(rank, world, x):
        comm = Communicator()
        ...
        return result            # must be picklable

    results = run_ranks(body, world_size=4, args=(x,))   # one result per rank, in rank order

(The test kit's ``commlab.testing.run_distributed`` is this function.)

Each process gets RANK/WORLD_SIZE/MASTER_* set, calls :func:`init_runtime`, runs ``fn``,
and tears the group down. An exception on any rank is re-raised here with its traceback.

The ranks are forked from a fork server that imported torch once (``forkserver`` start method):
a fresh interpreter per rank (``spawn``) would pay torch's import, seconds of CPU, on every call,
and plain ``fork`` of a process that has run torch ops can inherit a broken thread pool. The fork
server starts with the caller's environment at the first call; each rank's RANK/WORLD_SIZE/
MASTER_* are set in the rank itself. Where ``forkserver`` does not exist (Windows), ``spawn``.
"""

from __future__ import annotations

import functools
import io
import os
import traceback

import torch
import torch.multiprocessing as mp

from commlab.core.runtime import free_port, init_runtime, shutdown_runtime


def _worker(rank, world_size, port, fn, args, queue, timeout_s, backend, device):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        init_runtime(backend, timeout_s=timeout_s, device=device)
        # Serialise here: tensors passed through the queue as shared memory would vanish when
        # this process exits before the parent reads them.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        shutdown_runtime()


# Imported once by the fork server, so that every rank starts with them loaded.
PRELOAD = ("torch", "torch.distributed", "commlab.core")


@functools.cache
def _start_context(preload: tuple[str, ...]):
    """The multiprocessing context of the ranks (one fork server per process, made on first use:
    the first call's ``preload`` is what the server imports)."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:  # no fork server on this platform
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def run_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 60.0,
              preload: tuple[str, ...] = PRELOAD, backend: str = "gloo", device: str = "cpu") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo on the CPU by default;
    ``device="cuda"`` puts gloo ranks on the GPUs, ``backend="nccl"`` needs a GPU per rank); return
    per-rank results. ``preload``: modules the fork server imports once when it starts (its first
    use in a process)."""
    ctx = _start_context(tuple(preload))
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout_s, backend, device))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout_s * 3)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
