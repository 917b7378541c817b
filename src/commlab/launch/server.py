"""The warm launcher: one process that has imported torch, the training loop and MLflow forks the
launcher of every local job, so that a workflow of many short jobs pays those imports once.

    commlab serve --socket /tmp/commlab-launch-x/socket [--parent PID] [--idle-exit-s S]
    COMMLAB_LAUNCH_SERVER=/tmp/commlab-launch-x/socket commlab launch --config run.yaml

A fresh ``commlab launch`` spends seconds of CPU before its first step: its own interpreter and
torch, a fork server importing torch and the loop again for the workers, MLflow's client for the
tracking relay. A local Snakemake run starts one server (workflow/rules/train.smk: ``onstart``)
and stops it at its end; every job's ``commlab launch`` finds it through
``COMMLAB_LAUNCH_SERVER`` and becomes a thin client:

* the client connects to the socket (a folder of mode 0700: this user's processes only), hands
  over its standard input, output and error (``SCM_RIGHTS``) and sends its arguments, working
  folder and environment as JSON;
* the server forks a child that takes those descriptors, folder and environment and runs
  :func:`commlab.launch.command.launch` on the arguments, exactly the launch a plain
  ``commlab launch`` runs, except that its workers are forked from the child itself (torchrun's
  ``fork`` start method: it imported what they need and has run no torch operation) and that rank 0
  logs to MLflow itself (its client is imported already: no relay thread may run while it forks);
* the server tells the client the child's pid, then its exit status, which the client exits with.
  The client forwards SIGTERM, SIGINT and SIGHUP to the child (the workers checkpoint, as in a
  plain launch); a client that dies (``kill -9`` of the job) makes the server SIGTERM its child.

When no server answers (the variable unset, a stale socket, a server still importing that then
failed) the client launches the job itself: the server is only ever a saving. Inside a SLURM
allocation the client never uses one (the job may run on another node than the server).

Invariants: the server never runs a torch operation, never starts a thread and never opens the
MLflow store, so a fork of it is as clean as a fresh interpreter that imported the same modules;
every job is a new process, and nothing of one job reaches the next. The server runs the code it
imported at its start: code changed during a workflow run takes effect at the next run. It exits on
SIGTERM (its children first), when its parent dies, or after ``--idle-exit-s`` without a job.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from commlab.launch.client import recv_message, send_message

#: What a job's launcher and its workers import, once, before the server forks any of them.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "torch.distributed.launcher.api",
           "commlab.loop.loop", "commlab.loop.worker", "commlab.launch.warm", "commlab.launch.command",
           "commlab.tracking", "commlab.tracking_relay", "mlflow.tracking")


# ---------------------------------------------------------------------- server
def preload() -> list[str]:
    """Import :data:`PRELOAD` and MLflow's SQL store (nothing is opened); the threads other than
    this one that are running afterwards (there must be none: the server forks)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from commlab.tracking import warm_up

    warm_up()
    return [t.name for t in threading.enumerate() if t is not threading.main_thread()]


class _Job:
    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.conn = pid, conn
        self.pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        self.client_gone = False


class LaunchServer:
    """The server's state: the listening socket, the jobs running, when it last had none."""

    def __init__(self, path: str, parent: int | None = None, idle_exit_s: float | None = None):
        self.path, self.parent, self.idle_exit_s = path, parent, idle_exit_s
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)  # before the imports: jobs that connect meanwhile wait in the backlog
        self.listener.listen(64)
        self.jobs: dict[int, _Job] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.stopping = False
        self.idle_since = time.monotonic()

    def serve(self) -> int:
        threads = preload()
        if threads:
            print(f"[commlab serve] threads {threads} run after the imports: forking would not be safe; exiting",
                  file=sys.stderr, flush=True)
            return 1
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        print(f"[commlab serve] ready at {self.path} (pid {os.getpid()})", flush=True)
        try:
            while not self.stopping:
                for key, _ in self.selector.select(timeout=0.5):
                    if key.data == "accept":
                        self._accept()
                    elif isinstance(key.data, tuple) and key.data[0] == "exited":
                        self._reap(key.data[1])
                    else:
                        self._client_readable(key.data[1])
                self._poll_exits()
                if self._should_exit():
                    break
        finally:
            self._shutdown()
        return 0

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    def _should_exit(self) -> bool:
        if self.parent is not None and os.getppid() != self.parent:
            print("[commlab serve] the workflow that started it has ended; exiting", flush=True)
            return True
        if self.jobs:
            self.idle_since = time.monotonic()
            return False
        return self.idle_exit_s is not None and time.monotonic() - self.idle_since > self.idle_exit_s

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            request = recv_message(conn)
        except (OSError, ValueError) as err:
            print(f"[commlab serve] a malformed request ({err}); ignored", file=sys.stderr, flush=True)
            conn.close()
            return
        if request is None or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self._child(conn, fds, request)  # never returns
        for fd in fds:
            os.close(fd)
        job = self.jobs[pid] = _Job(pid, conn)
        try:
            send_message(conn, {"pid": pid})
        except OSError:
            job.client_gone = True
            _terminate(pid)
        self.selector.register(conn, selectors.EVENT_READ, ("client", pid))
        if job.pidfd is not None:
            self.selector.register(job.pidfd, selectors.EVENT_READ, ("exited", pid))

    def _child(self, conn: socket.socket, fds: list[int], request: dict) -> None:
        """The job's launcher: the client's descriptors, folder and environment, then the launch."""
        rc = 1
        try:
            self.selector.close()
            self.listener.close()
            conn.close()
            for job in self.jobs.values():
                job.conn.close()
                if job.pidfd is not None:
                    os.close(job.pidfd)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own standard streams
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            rc = run_request(request)
        except SystemExit as err:
            rc = err.code if isinstance(err.code, int) else 1
        except BaseException:  # noqa: BLE001 - the job's log gets the traceback, the client an exit status
            import traceback

            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(rc)

    def _client_readable(self, pid: int) -> None:
        job = self.jobs.get(pid)
        if job is None or job.client_gone:
            return
        try:
            data = job.conn.recv(1)
        except OSError:
            data = b""
        if not data:  # the job's client died: its launcher must not outlive it
            job.client_gone = True
            self.selector.unregister(job.conn)
            _terminate(pid)

    def _poll_exits(self) -> None:
        for pid, job in list(self.jobs.items()):
            if job.pidfd is None:
                self._reap(pid)

    def _reap(self, pid: int) -> None:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 1 << 8
        if not done:
            return
        job = self.jobs.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code  # killed by signal s: 128 + s, as a shell says it
        if job.pidfd is not None:
            self.selector.unregister(job.pidfd)
            os.close(job.pidfd)
        if not job.client_gone:
            self.selector.unregister(job.conn)
            try:
                send_message(job.conn, {"exit": code})
            except OSError:
                pass
        job.conn.close()

    def _shutdown(self, grace_s: float = 60.0) -> None:
        """Stop the jobs still running (they checkpoint), wait for them, remove the socket."""
        for pid in self.jobs:
            _terminate(pid)
        deadline = time.monotonic() + grace_s
        while self.jobs and time.monotonic() < deadline:
            for pid in list(self.jobs):
                self._reap(pid)
            time.sleep(0.1)
        for pid in list(self.jobs):
            _terminate(pid, signal.SIGKILL)
            self._reap(pid)
        self.listener.close()
        try:
            os.unlink(self.path)
            os.rmdir(Path(self.path).parent)
        except OSError:
            pass


def _terminate(pid: int, sig: int = signal.SIGTERM) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_request(request: dict) -> int:
    """In the forked child: the launch the client asked for."""
    import argparse

    from commlab.launch.command import add_arguments, launch

    parser = argparse.ArgumentParser(prog="commlab launch")
    add_arguments(parser)
    args = parser.parse_args(request["argv"])
    # What torchrun's agent sets for its workers when it is unset (and warns of, through the logging
    # that the warm imports configured): the same environment, without the warning in every job's log.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return launch(args.config, args.sentinel, args.network_mbit, args.latency_ms, marks=request.get("marks"),
                  warm=True)


def serve(path: str, parent: int | None = None, idle_exit_s: float | None = None) -> int:
    """``commlab serve``: serve launches at the Unix socket ``path`` until stopped."""
    if os.name != "posix" or not hasattr(socket, "recv_fds"):
        print("commlab serve: needs a POSIX system with Unix sockets", file=sys.stderr)
        return 2
    folder = Path(path).parent
    if folder.stat().st_mode & 0o077:
        print(f"commlab serve: {folder} must be private (mode 0700): other users could start jobs as you",
              file=sys.stderr)
        return 2
    try:
        server = LaunchServer(path, parent, idle_exit_s)
    except OSError as err:
        print(f"commlab serve: cannot listen at {path}: {err}", file=sys.stderr)
        return 2
    return server.serve()
