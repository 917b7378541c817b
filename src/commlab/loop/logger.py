"""The loop's one logger: rank 0 logs to its MLflow run, every other rank gets a null logger.

The loop calls ``log_metrics`` / ``flush`` / ``log_artifact`` / ``close`` on every rank without
asking which rank it is. Every rank learns the run id (it travels in the checkpoints), so that
rank 1 can mark the run FAILED when rank 0 died: nobody else would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist


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
    """Rank 0's MLflow run (:class:`commlab.tracking.RunTracker`): the checkpoint's run reopened,
    or a new one with the run's tags and ``params`` (the flattened config and what the run adds).
    ``relay``: the launcher's tracking relay, which makes the calls (:mod:`commlab.tracking_relay`)."""

    def __init__(self, params: dict, tags: dict[str, str], run_id: str | None, relay: str | None = None):
        from commlab.tracking_relay import open_tracker

        self.tracker = open_tracker(params, tags, run_id, relay)
        super().__init__(self.tracker.run_id, 0)
        if params.get("scale") and self.tracker.run_id != run_id:  # a new run: the scale in its name
            name = f"{params.get('name') or params['method']}-seed{params['seed']}-{params['scale']}"
            self.tracker.set_tag("mlflow.runName", name)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step)

    def flush(self) -> None:
        self.tracker.flush()

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        self.tracker.log_artifact(path, folder)

    def close(self, status: str) -> None:
        """Set the run's final status (FINISHED, KILLED or FAILED); never masks the run's own error."""
        _never_mask(lambda: self.tracker.finish(status), self.rank, self.run_id, status)


def _never_mask(fn, rank: int, run_id: str | None, status: str) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - never mask the error that ended the run
        print(f"[commlab] rank {rank}: could not mark the MLflow run {run_id} {status}: {err}",
              file=sys.stderr, flush=True)


def open_logger(config: dict, params: dict, tags: Callable[[], dict[str, str]], rt, run_id: str | None,
                relay: str | None = None) -> NullLogger:
    """Every rank's logger for this run; ``run_id`` is the checkpoint's run (None on a first start),
    ``relay`` the launcher's tracking relay (rank 0 logs through it). ``tags()`` is called where
    they are recorded only, on rank 0 with tracking on (they run git)."""
    tracking = config["tracking"]
    if not tracking.get("enabled", True):
        return NullLogger(run_id, rt.rank)
    logger = RunLogger(params, tags(), run_id, relay) if rt.is_main else None
    if rt.world_size > 1:
        # The others wait for rank 0's MLflow set-up on a group of their own with a generous
        # timeout: a slow tracking server is not a dead peer.
        waiting = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(600.0, config["timeout_s"])))
        box = [logger.run_id if logger else None]
        dist.broadcast_object_list(box, src=0, group=waiting)
        run_id = box[0]
    return logger or NullLogger(run_id, rt.rank, tracking.get("uri"))
