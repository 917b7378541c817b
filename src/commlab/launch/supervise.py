"""Supervising workers started as plain processes (one per emulated-network namespace, or on
loopback), as torchrun supervises its own: the first failure stops the others and names the rank,
SIGTERM/SIGINT are forwarded so that the workers checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from commlab.launch.netem import Terminated

MASTER_PORT = 29500  # each emulated run has private namespaces: a fixed port cannot collide


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`~commlab.launch.netem.Terminated` in the main
    thread, so that ``finally`` blocks run (SIGTERM's default action skips them: a launcher would
    orphan its workers, a benchmark leave its scratch folder). Only where nobody has claimed
    SIGTERM yet (an emulated network claims it for itself), and only in the main thread, the one
    a signal handler runs in."""
    claimed = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if claimed:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        if claimed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def worker_env(rank: int, world_size: int, extra: dict) -> dict[str, str]:
    """The full environment of worker ``rank``: this process's, the rank variables torchrun sets, ``extra``."""
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", **extra}


def start_workers(argv: list[str], world_size: int, env: Callable[[int], dict],
                  prefix: Callable[[int], list[str]] = lambda rank: [],
                  log: str | None = None, namespace: Callable[[int], str] | None = None,
                  preloaded: bool = False) -> list:
    """Start ``world_size`` processes ``prefix(rank) + [python, *argv]`` with ``env(rank)`` added;
    their output goes to ``log`` (appended) when given, else to this process's output.

    ``preloaded``: fork them instead from this process's preloaded fork server
    (:mod:`commlab.launch.preloaded`; ``argv`` must be ``-m commlab.loop ...``), in network
    namespace ``namespace(rank)`` when given (``prefix`` is then not used)."""
    if preloaded:
        from commlab.launch.preloaded import fork_workers

        return fork_workers(argv, world_size, lambda rank: worker_env(rank, world_size, env(rank)), namespace, log)
    procs = []
    out = open(log, "ab") if log else None  # noqa: SIM115 - the children hold it; closed below
    try:
        for rank in range(world_size):
            procs.append(subprocess.Popen(prefix(rank) + [sys.executable, *argv],
                                          env=worker_env(rank, world_size, env(rank)), stdout=out,
                                          stderr=subprocess.STDOUT if out else None))
    except BaseException:
        stop_workers(procs, 0.0)
        raise
    finally:
        if out:
            out.close()
    return procs


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal s -> 128 + s


def stop_workers(procs: list[subprocess.Popen], grace_s: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to the live workers, wait up to ``grace_s``, then SIGKILL the rest."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def supervise(procs: list[subprocess.Popen], fail_grace_s: float = 5.0, signal_grace_s: float = 30.0,
              poll_s: float = 0.1, on_failure=None) -> int:
    """Wait for the workers like torchrun: 0 when all succeed; the first failure stops the others.

    On SIGTERM/SIGINT (:class:`commlab.launch.netem.Terminated` or KeyboardInterrupt) the signal is
    forwarded so that the workers checkpoint, they get ``signal_grace_s`` to exit, and the
    exception propagates. A failed worker's peers are blocked in a collective and ignore SIGTERM
    until their next control point, so they get only ``fail_grace_s``. ``on_failure(rank, returncode)``
    hears of the first failed worker (a negative code: killed by that signal)."""
    with sigterm_raises():  # without an emulated network nobody has claimed SIGTERM yet
        try:
            return _wait_for_workers(procs, fail_grace_s, on_failure, poll_s)
        except (Terminated, KeyboardInterrupt) as err:
            sig = err.signum if isinstance(err, Terminated) else signal.SIGINT
            print(f"[commlab launch] {signal.Signals(sig).name}: forwarding to the workers",
                  file=sys.stderr, flush=True)
            stop_workers(procs, signal_grace_s, sig)
            raise


def _wait_for_workers(procs: list, fail_grace_s: float, on_failure, poll_s: float) -> int:
    """0 once every worker has succeeded; at the first failure, the others stopped and its code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"[commlab launch] worker rank {rank} failed (exit code {_exit_code(code)}); "
                  f"stopping the other workers", file=sys.stderr, flush=True)
            stop_workers(procs, fail_grace_s)
            if on_failure is not None:
                on_failure(rank, code)
            return _exit_code(code)
        if all(c == 0 for c in codes):
            return 0
        time.sleep(poll_s)


def run_in_network(net, argv: list[str], extra_env: dict | None = None, log: str | None = None,
                   preloaded: bool = False, **supervise_kw) -> int:
    """Run one worker per namespace of ``net`` (an up :class:`~commlab.launch.netem.EmulatedNetwork`);
    ``preloaded``: forked from the preloaded fork server (:func:`start_workers`)."""
    extra_env = dict(extra_env or {})
    procs = start_workers(argv, net.world_size,
                          env=lambda rank: {**net.env(rank), "MASTER_PORT": str(MASTER_PORT), **extra_env},
                          prefix=net.exec_prefix, log=log, namespace=net.namespace, preloaded=preloaded)
    return supervise(procs, **supervise_kw)


def run_on_loopback(argv: list[str], world_size: int, extra_env: dict | None = None, log: str | None = None,
                    preloaded: bool = False, **supervise_kw) -> int:
    """The same supervision without emulation (workers on 127.0.0.1), for side-by-side measurements."""
    from commlab.core.runtime import free_port

    port = str(free_port())
    procs = start_workers(argv, world_size, log=log, preloaded=preloaded,
                          env=lambda rank: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(extra_env or {})})
    return supervise(procs, **supervise_kw)
