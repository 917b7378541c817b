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

A rank that never reports is not waited on for ever: past ``3 * timeout_s``, or ``grace_s`` after
another rank failed (its peers then usually wait in a collective that cannot complete), the error
names the ranks still running and where every thread of theirs was, and of their children (loader
workers), read with :mod:`faulthandler` on SIGUSR1. A hang then fails in minutes with its cause in
the message, not as a bare ``queue.Empty`` after the whole timeout.

The ranks are forked from a fork server that imported torch once (``forkserver`` start method):
a fresh interpreter per rank (``spawn``) would pay torch's import, seconds of CPU, on every call,
and plain ``fork`` of a process that has run torch ops can inherit a broken thread pool. The fork
server starts with the caller's environment at the first call; each rank's RANK/WORLD_SIZE/
MASTER_* are set in the rank itself. Where ``forkserver`` does not exist (Windows), ``spawn``.
"""

from __future__ import annotations

import faulthandler
import functools
import io
import os
import queue as queues
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from commlab.core.runtime import free_port, init_runtime, shutdown_runtime


def _worker(rank, world_size, port, fn, args, queue, timeout_s, backend, device, stacks):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # SIGUSR1 writes every thread's stack here; processes this rank forks (loader workers) inherit
    # the handler and the file, and append theirs. Kept open for the process's life.
    dump = open(stacks, "a", buffering=1)  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
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


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on (Linux's /proc; none where it is absent)."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []
    return children + [d for c in children for d in _descendants(c)]


def _signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` and its descendants, listed before any is signalled (a killed
    parent's children are re-parented and drop out of its list)."""
    for each in [pid, *_descendants(pid)]:
        try:
            os.kill(each, sig)
        except OSError:  # gone meanwhile
            pass


def _stacks_of(procs: dict, stacks: Path, waited_s: float) -> str:
    """Where each process of ``procs`` (rank -> process) and its children are: SIGUSR1 makes them
    write their threads' stacks to ``stacks``/rank-N.txt."""
    for proc in procs.values():
        _signal_tree(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)  # the handlers write at once; a second is ample
    parts = []
    for rank in procs:
        written = stacks / f"rank-{rank}.txt"
        text = written.read_text(errors="replace").strip() if written.exists() else ""
        parts.append(f"rank {rank} did not finish in {waited_s:.0f} s; the stacks of its threads and of its "
                     f"children (loader workers), in no set order:\n"
                     f"{text or '(none written: the process never reached its handler)'}")
    return "\n".join(parts)


def run_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 60.0,
              preload: tuple[str, ...] = PRELOAD, backend: str = "gloo", device: str = "cpu",
              grace_s: float = 30.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo on the CPU by default;
    ``device="cuda"`` puts gloo ranks on the GPUs, ``backend="nccl"`` needs a GPU per rank); return
    per-rank results. ``preload``: modules the fork server imports once when it starts (its first
    use in a process). ``timeout_s`` is the process group's; the ranks get three times that to
    finish, or ``grace_s`` once one has failed."""
    ctx = _start_context(tuple(preload))
    queue = ctx.Queue()
    port = free_port()
    stacks = Path(tempfile.mkdtemp(prefix="commlab-ranks-"))
    procs = {r: ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout_s, backend, device,
                                                    str(stacks / f"rank-{r}.txt")))
             for r in range(world_size)}
    for p in procs.values():
        p.start()
    start = time.monotonic()
    deadline = start + timeout_s * 3
    results: dict[int, object] = {}
    errors, reported, dead_since = [], set(), {}
    try:
        while len(reported) < world_size:
            try:
                # Short waits: a rank that died without a word (killed, out of memory) is seen in a
                # second or two, not at the deadline.
                rank, status, value = queue.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queues.Empty:
                silent = {r: p for r, p in procs.items() if r not in reported}
                now = time.monotonic()
                for r, p in silent.items():
                    if p.exitcode is not None:
                        dead_since.setdefault(r, now)
                # Two seconds dead and still silent: what it put on the queue would have arrived.
                gone = {r: p for r, p in silent.items() if now - dead_since.get(r, now) >= 2.0}
                if gone:
                    errors += [f"rank {r}: exited with code {p.exitcode} before it reported" for r, p in gone.items()]
                    reported.update(gone)
                    deadline = min(deadline, now + grace_s)
                elif now >= deadline:
                    errors.append(_stacks_of(silent, stacks, now - start))
                    break
                continue
            reported.add(rank)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                deadline = min(deadline, time.monotonic() + grace_s)
    finally:
        for rank, p in procs.items():
            if rank in reported:
                p.join(timeout=10)
            if p.is_alive():
                # Its children too: a hung loader worker outlives its killed parent otherwise.
                _signal_tree(p.pid, signal.SIGKILL)
                p.join(timeout=10)
        shutil.rmtree(stacks, ignore_errors=True)
    if errors:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
