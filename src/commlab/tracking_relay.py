"""Rank 0's MLflow calls made by the launcher: the relay that takes MLflow off a run's critical path.

Rank 0 of a fresh worker imports MLflow's client and its SQL store (a large import) and opens
its run while every other rank waits for the run id; the launcher, meanwhile, idles in torchrun's
agent. So ``commlab launch`` (one node) starts a :class:`TrackingRelay`: a thread that
imports MLflow as soon as the workers are on their way and then runs, for rank 0, the very same
:class:`commlab.tracking.RunTracker` calls rank 0 would make itself. Rank 0 gets the relay's
address as ``--tracking-relay`` and uses a :class:`RelayedTracker` with the tracker's interface
(``run_id``, ``log_metrics``, ``flush``, ``log_artifact``, ``set_tag``, ``finish``), without
importing MLflow at all. The launcher's thread imports MLflow on a core the workers' fork server
leaves idle while the workers start, so no rank waits for the import.

Nothing else changes: the run is created, logged and closed by the same code, in the same order
(every call waits for its answer, and a failed call raises its own exception in rank 0); files
rank 0 hands over (artifacts) are on the same machine. A rank 0 that dies leaves the run as a dead
rank 0 would: its unflushed metrics are gone, the status is left to rank 1 and the launcher
(:func:`commlab.tracking.mark_failed`, :func:`commlab.tracking.record_failure`). A restarted rank 0
connects again and reopens the run from its checkpoint. When the relay cannot be reached, rank 0
says so and logs directly.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import threading
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

_CALLS = ("log_metrics", "flush", "log_artifact", "set_tag", "finish")  # RunTracker's, besides opening


class TrackingRelay:
    """The launcher's side: a Unix socket in a private folder, one thread serving one rank 0 at a
    time (a torchrun restart's rank 0 connects again). ``relay.address`` is what rank 0 is given;
    :meth:`close` stops the thread and removes the socket."""

    def __init__(self, uri: str | None = None):
        self.uri = uri  # the config's tracking.uri: the store to warm up
        self._folder = tempfile.mkdtemp(prefix="commlab-relay-")  # mode 0700: this user's only
        self.address = str(Path(self._folder) / "socket")
        try:
            self._listener = Listener(self.address, family="AF_UNIX")
        except OSError:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="commlab-tracking-relay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving: the workers have exited by now, so no call is in progress."""
        self._closing = True
        try:  # wakes the thread's accept(): closing the socket from here would not
            Client(self.address, family="AF_UNIX").close()
        except OSError:
            pass
        self._thread.join(timeout=10)  # at most the warm-up's import, when the workers failed at once
        self._listener.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _serve(self) -> None:
        # MLflow's client and SQL store first: this is the import rank 0 does not wait for.
        try:
            from commlab.tracking import warm_up

            warm_up(self.uri)
        except Exception:  # noqa: BLE001 - the first call reports it, as rank 0's own import would
            pass
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # closed
                return
            if self._closing:
                conn.close()
                return
            with conn:
                _serve_one(conn)


def _serve_one(conn: Connection) -> None:
    """One rank 0's calls until it hangs up: ``("open", params, tags, run_id)``, then tracker calls."""
    tracker = None
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 exited (or died: its buffered metrics go with it, as they would)
        try:
            if name == "open":
                from commlab.tracking import RunTracker

                params, tags, run_id = args
                tracker = RunTracker(params, tags, run_id=run_id)
                result = tracker.run_id
            elif name not in _CALLS:
                raise RuntimeError(f"tracking relay: {name!r} is not a tracker call")
            elif tracker is None:
                raise RuntimeError(f"tracking relay: {name!r} before the run was opened")
            else:
                result = getattr(tracker, name)(*args)
            reply = ("ok", result)
        except Exception as err:  # noqa: BLE001 - raised again in rank 0
            reply = ("error", _picklable(err))
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


def _picklable(err: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - e.g. an exception whose constructor wants other arguments
        return RuntimeError(f"{type(err).__name__}: {err}")


class RelayedTracker:
    """Rank 0's side: :class:`commlab.tracking.RunTracker`'s calls, made by the relay at the other
    end of ``conn`` (a new run with ``params`` and ``tags``, or the checkpoint's ``run_id`` reopened)."""

    def __init__(self, conn: Connection, params: dict, tags: dict[str, str], run_id: str | None = None):
        self._conn = conn
        self.run_id = self._call("open", params, tags, run_id)

    def _call(self, name: str, *args):
        self._conn.send((name, args))
        status, result = self._conn.recv()
        if status == "error":
            raise result
        return result

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._call("log_metrics", metrics, step)

    def flush(self) -> None:
        self._call("flush")

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        self._call("log_artifact", str(Path(path).resolve()), folder)

    def set_tag(self, key: str, value: str) -> None:
        self._call("set_tag", key, value)

    def finish(self, status: str) -> None:
        try:
            self._call("finish", status)
        finally:
            self._conn.close()


def open_tracker(params: dict, tags: dict[str, str], run_id: str | None, relay: str | None):
    """Rank 0's tracker: through the relay at ``relay`` when one is given and answers, else
    :class:`commlab.tracking.RunTracker` in this process."""
    if relay:
        try:
            conn = Client(relay, family="AF_UNIX")
        except OSError as err:
            print(f"[commlab] the launcher's tracking relay does not answer ({err}); logging to MLflow directly",
                  file=sys.stderr, flush=True)
        else:
            return RelayedTracker(conn, params, tags, run_id)  # the store's errors are the run's, as ever
    from commlab.tracking import RunTracker

    return RunTracker(params, tags, run_id=run_id)


def start_relay(config: dict) -> TrackingRelay | None:
    """A relay for this launch when the run logs to MLflow and a socket can be made here (None
    otherwise: rank 0 then logs directly, as ``commlab train`` does)."""
    tracking = config.get("tracking") or {}
    if not tracking.get("enabled", True) or os.name != "posix":
        return None
    try:
        return TrackingRelay(tracking.get("uri"))
    except OSError as err:  # e.g. a TMPDIR whose path is too long for a Unix socket
        print(f"[commlab launch] no tracking relay ({err}); rank 0 logs to MLflow itself", file=sys.stderr, flush=True)
        return None
