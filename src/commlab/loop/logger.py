"""The loop's one logger: rank 0 logs to its MLflow run, every other rank gets a null logger.

:func:`open_logger` is the loop's one call to open its run, made once on every rank: on rank 0
with tracking on it assembles the run's params and tags from the config and the rank's
:class:`~commlab.tracking.RunFacts` (:func:`commlab.tracking.run_params`, :func:`commlab.tracking.run_tags`:
git runs there and nowhere else), opens the run (a new one, or the checkpoint's reopened; through
the launcher's relay when there is one, :mod:`commlab.tracking_relay`) and notes its id beside the
run's outputs for the launcher (:func:`commlab.tracking.write_run_record`).

The loop calls ``log_metrics`` / ``flush`` / ``log_artifact`` / ``close`` on every rank without
asking which rank it is. Every rank learns the run id (it travels in the checkpoints), so that
rank 1 can mark the run FAILED when rank 0 died: nobody else would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from commlab.config import run_dir
from commlab.timeline import phase

if TYPE_CHECKING:
    from commlab.tracking import RunFacts


class NullLogger:
    """Logs nothing. On rank 1, closing a failed run marks it FAILED (a no-op when rank 0 did)."""

    def __init__(self, run_id: str | None = None, rank: int = 0, uri: str | None = None):
        self.run_id, self.rank, self.uri = run_id, rank, uri

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        pass

    def close(self, status: str) -> None:
        if status == "FAILED" and self.rank == 1 and self.run_id:
            from commlab.tracking import mark_failed

            _never_mask(lambda: mark_failed(self.run_id, self.uri), self.rank, self.run_id, status)


class RunLogger(NullLogger):
    """Rank 0's MLflow run: a :class:`commlab.tracking.RunTracker` in this process, or its calls
    made by the launcher's relay (:class:`commlab.tracking_relay.RelayedTracker`). Every call is
    timed as the run's ``mlflow`` phase (:mod:`commlab.timeline`)."""

    def __init__(self, tracker):
        self.tracker = tracker
        super().__init__(tracker.run_id, 0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with phase("mlflow"):
            self.tracker.log_metrics(metrics, step)

    def flush(self) -> None:
        with phase("mlflow"):
            self.tracker.flush()

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        with phase("mlflow"):
            self.tracker.log_artifact(path, folder)

    def close(self, status: str) -> None:
        """Set the run's final status (FINISHED, KILLED or FAILED); never masks the run's own error."""
        with phase("mlflow"):
            _never_mask(lambda: self.tracker.finish(status), self.rank, self.run_id, status)


def _never_mask(call: Callable[[], object], rank: int, run_id: str | None, status: str) -> None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - never mask the error that ended the run
        print(f"[commlab] rank {rank}: could not mark the MLflow run {run_id} {status}: {err}",
              file=sys.stderr, flush=True)


def open_logger(config: dict, facts: RunFacts, runtime, run_id: str | None, relay: str | None = None) -> NullLogger:
    """Every rank's logger for this run. ``facts``: what the rank learnt building the run;
    ``runtime``: its rank and world (``is_main``, ``rank``, ``world_size``); ``run_id``: the
    checkpoint's run (None on a first start); ``relay``: the launcher's tracking relay (rank 0
    logs through it)."""
    tracking = config["tracking"]
    if not tracking.get("enabled", True):
        return NullLogger(run_id, runtime.rank)
    logger = _open_run(config, facts, run_id, relay) if runtime.is_main else None
    if runtime.world_size > 1:
        run_id = _shared_run_id(logger.run_id if logger else None, config["timeout_s"])
    return logger or NullLogger(run_id, runtime.rank, tracking.get("uri"))


def _open_run(config: dict, facts: RunFacts, run_id: str | None, relay: str | None) -> RunLogger:
    """Rank 0: the run opened with its params and tags, and its id noted for the launcher, should
    every worker die (an NCCL watchdog aborts them all)."""
    from commlab.tracking import run_params, run_tags, write_run_record
    from commlab.tracking_relay import open_tracker

    tracker = open_tracker(run_params(config, facts), run_tags(config, facts), run_id, relay)
    write_run_record(run_dir(config), tracker.run_id, config["tracking"].get("uri"))
    return RunLogger(tracker)


def _shared_run_id(run_id: str | None, timeout_s: float) -> str | None:
    """Rank 0's ``run_id``, on every rank. The others wait for rank 0's MLflow set-up on a group
    of their own with a generous timeout: a slow tracking server is not a dead peer."""
    waiting = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(600.0, timeout_s)))
    shared = [run_id]  # broadcast_object_list fills the list in place on the other ranks
    dist.broadcast_object_list(shared, src=0, group=waiting)
    return shared[0]
