"""The worker entry point: ``commlab train`` and every worker the launcher starts come here.

    python -m commlab.loop --config run.yaml [--sentinel FILE] [key=value ...]

The config is loaded and validated (the method's options parsed once, here), then the loop runs.
A bad config or missing data exits 2 with one message (printed by rank 0 only: under torchrun
every rank hits the same error).

Every worker names its process after its rank, ``commlab-rank<N>`` (:data:`WORKER_NAME`): the
workers of one node are forked from one fork server and share its command line, so in ``ps``,
``top`` or ``htop`` (and ``/proc/<pid>/comm``) the name is what tells the ranks apart, e.g. to
watch one rank's CPU or to signal one rank. ``kill -USR1`` a rank prints where each of its
threads is to its stderr (the run's log under ``commlab launch``), and the run goes on.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` options (shared by ``commlab train`` and ``python -m commlab.loop``)."""
    parser.add_argument("--config", help="run config YAML (defaults apply to missing keys)")
    parser.add_argument("--sentinel", help="write the run record JSON here (default: <output_dir>/sentinel.json)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--tracking-relay", metavar="SOCKET", help=argparse.SUPPRESS)  # commlab launch's
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


WORKER_NAME = "commlab-rank{rank}"  # a training worker's process name (ps, top, /proc/PID/comm)


def name_process(rank: int) -> None:
    """Name this process :data:`WORKER_NAME` for ``rank`` (Linux; elsewhere a no-op)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(15, WORKER_NAME.format(rank=rank).encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass


def stacks_on_sigusr1() -> None:
    """SIGUSR1 prints every thread's stack to the process's stderr (fd 2, also when ``sys.stderr``
    is replaced, as under ``commlab train`` called in-process): a rank that seems hung (a collective,
    a loader worker, a file system) tells where it is without a debugger or py-spy on the node. Its
    loader workers inherit the handler."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no stderr at all, or no SIGUSR1 here
        pass


def _say_once(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Train the config ``args`` name; the exit status."""
    from commlab import timeline
    from commlab.config import ConfigError, load_run
    from commlab.loop.heap import keep_freed_memory

    timeline.restart()  # this worker's own phases, from its start (a forked one inherited the module)
    name_process(int(os.environ.get("RANK", "0")))  # torchrun's agent set RANK in this process
    stacks_on_sigusr1()
    try:
        keep_freed_memory()  # before the run allocates: freed tensors stay in the heap (loop/heap.py)
    except ValueError as err:  # a malformed COMMLAB_MALLOC / MALLOC_*_ variable
        _say_once(f"commlab train: {err}")
        return 2
    try:
        with timeline.phase("worker_setup"):
            config, options = load_run(args.config, args.overrides)
    except ConfigError as err:
        _say_once(f"commlab train: {err}")
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config, sort_keys=False))
        return 0
    from commlab.loop.loop import train

    try:
        train(config, sentinel=args.sentinel, options=options, tracking_relay=args.tracking_relay)
    except (FileNotFoundError, ValueError) as err:
        _say_once(f"commlab train: {err}")
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlab.loop", description="Run one experiment's worker.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
