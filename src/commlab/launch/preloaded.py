"""Training workers forked from one preloaded fork server, for a launcher that starts many short
runs (the benchmarks: ``commlab bench throughput`` starts dozens of short runs in the default
workflow).

A fresh worker interpreter spends seconds of CPU importing torch, torch._dynamo (which
torch.optim imports on its first optimizer) and the training loop, and rank 0 more on MLflow's
client: on a short benchmark run, with more workers than cores, those imports are most of the
run. Here the fork server imports them once per launcher process (:data:`PRELOAD`) and every run's workers are
forked from it. Each run still gets new processes (nothing of one run reaches the next: the
server itself never trains) with the environment, log file and network namespace a plain
``ip netns exec NS python -m commlab.loop ...`` worker would have, and the handles answer like
:class:`subprocess.Popen`, so :func:`commlab.launch.supervise.supervise` watches them unchanged.

A forked worker enters its emulated link's network namespace with ``setns(2)`` rather than
``ip netns exec``, which would also remount ``/sys``: so the wire counters are read from
``/proc/net/dev``, which always shows the reading process's own namespace
(:func:`commlab.core.stats.read_interface`).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import sys
from collections.abc import Callable

from commlab.launch.torchrun import WORKER_PRELOAD

#: What the fork server imports once: the worker's own preload and MLflow's client with its SQL
#: store (rank 0 logs to the benchmark's private store itself).
PRELOAD = [*WORKER_PRELOAD, "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store"]
WORKER_MODULE = ["-m", "commlab.loop"]
CLONE_NEWNET = 0x40000000


def enter_network_namespace(name: str) -> None:
    """Move this (single-threaded) process into the named network namespace (``ip netns add``'s
    ``/run/netns/<name>``). Needs CAP_SYS_ADMIN, as emulated links do anyway."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _forked_worker(argv: list[str], env: dict[str, str], namespace: str | None, log: str | None) -> None:
    """The body of one forked worker: the environment, output and namespace of a started one,
    then :func:`commlab.loop.worker.main` on the arguments after ``-m commlab.loop``."""
    os.environ.clear()
    os.environ.update(env)
    if log:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the worker's loop installs its own
    if namespace:
        enter_network_namespace(namespace)
    from commlab.loop.worker import main

    sys.exit(main(argv[len(WORKER_MODULE):]))


class ForkedWorker:
    """A forked worker with the part of :class:`subprocess.Popen` that supervision uses."""

    def __init__(self, process: mp.Process):
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode  # negative: killed by that signal, as Popen says it

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode


def fork_workers(argv: list[str], world_size: int, env: Callable[[int], dict],
                 namespace: Callable[[int], str] | None = None, log: str | None = None) -> list[ForkedWorker]:
    """Fork ``world_size`` workers running ``python *argv`` (which must be ``-m commlab.loop ...``)
    with ``env(rank)`` and, when given, in network namespace ``namespace(rank)``."""
    if argv[:len(WORKER_MODULE)] != WORKER_MODULE:
        raise ValueError(f"preloaded workers run {' '.join(WORKER_MODULE)} only, not {argv[:2]}")
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)  # read when the server starts (once)
    ctx = mp.get_context("forkserver")
    workers: list[ForkedWorker] = []
    try:
        for rank in range(world_size):
            process = ctx.Process(target=_forked_worker, name=f"commlab-worker-{rank}",
                                  args=(argv, env(rank), namespace(rank) if namespace else None, log))
            process.start()
            workers.append(ForkedWorker(process))
    except BaseException:
        for w in workers:
            w.kill()
            w.wait()
        raise
    return workers
