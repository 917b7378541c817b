"""MLflow: one experiment per paper, one run per (paper, method variant, seed), rank 0 only.

The store defaults to SQLite inside the project (``sqlite:///<cwd>/mlflow.db``);
``MLFLOW_TRACKING_URI`` or the config's ``tracking.uri`` override it. On clusters use a tracking
server (``mlflow server --backend-store-uri postgresql://...``) or a database server: SQLite's
file locking is not reliable on NFS/Lustre (docs/cluster.md).

Lifecycle of a run, across restarts (the run id travels in every checkpoint):

* created RUNNING with tags and the flattened config as params;
* metrics are buffered and written in batches at epoch ends (and at least every
  ``FLUSH_EVERY_S`` seconds), so a long epoch still shows progress;
* stopped by SIGTERM (preemption): checkpoint, then KILLED; the re-launched job reopens the same
  run (RUNNING again) and drops every metric point at or below the step already stored for that
  key, so a resumed run never records a step twice;
* any error: FAILED. If rank 0 itself dies, rank 1 marks the run FAILED (:func:`mark_failed`);
  if the whole job is SIGKILLed nobody can, the run stays RUNNING until the re-launch continues
  it.

SQLite allows one writer at a time; parallel jobs briefly meet "database is locked". Every store
call retries such transient errors with exponential backoff (:func:`with_retries`).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

from commlab.config import flatten

# Telemetry off before mlflow is imported anywhere (no network here, and none wanted).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per call
FLUSH_EVERY_S = 60.0  # write buffered metrics at least this often, besides epoch ends
RETRIES = 10  # attempts per store call on transient errors (about 40 s of backoff in all)
TRANSIENT = ("database is locked", "database is busy", "temporarily_unavailable", "unable to open database",
             "connection reset", "connection refused", "timed out")


def tracking_uri(configured: str | None = None) -> str:
    """Environment first, then the config, then SQLite in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def is_transient(err: BaseException) -> bool:
    """Whether a store error is worth retrying (lock contention, a server briefly away)."""
    text = f"{type(err).__name__} {err} {getattr(err, 'error_code', '')}".lower()
    return any(marker in text for marker in TRANSIENT)


def with_retries(fn, *args, what: str = "MLflow call", attempts: int = RETRIES, **kwargs):
    """``fn(*args, **kwargs)``, retried with jittered exponential backoff on transient errors."""
    for attempt in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - filtered by is_transient
            if attempt == attempts - 1 or not is_transient(err):
                raise
            delay = min(8.0, 0.1 * 2**attempt) * (0.5 + random.random())
            print(f"[commlab] {what}: {str(err).splitlines()[0][:120]}; retry in {delay:.1f} s",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
    raise AssertionError("unreachable")


def client(uri: str | None = None):
    """A client of ``uri`` when given, else of :func:`tracking_uri`. (Not ``mlflow.set_tracking_uri``:
    it exports MLFLOW_TRACKING_URI, which would then override every later explicit store.)"""
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri or tracking_uri())


def ensure_experiments(names: list[str], uri: str | None = None) -> dict[str, str]:
    """Create the experiments that do not exist yet; return name -> id. Call this once before
    parallel jobs start (two processes creating the SQLite schema at once fail)."""
    c = client(uri)
    return {name: _experiment_id(c, name) for name in names}


def _experiment_id(c, name: str) -> str:
    exp = with_retries(c.get_experiment_by_name, name, what="get experiment")
    if exp:
        return exp.experiment_id
    try:
        return with_retries(c.create_experiment, name, what="create experiment")
    except Exception:  # noqa: BLE001 - another job created it meanwhile
        return with_retries(c.get_experiment_by_name, name, what="get experiment").experiment_id


def git_commit() -> str:
    """The commit of the code that runs, with ``-dirty`` when the tree has changes."""
    try:
        root = Path(__file__).resolve().parents[2]
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def mark_failed(run_id: str, configured: str | None = None) -> bool:
    """Mark ``run_id`` FAILED if it is still RUNNING (for a rank other than the dead rank 0);
    ``configured`` is the config's ``tracking.uri``. Returns whether it changed the status."""
    c = client(tracking_uri(configured))
    run = with_retries(c.get_run, run_id, what="get run")
    if run.info.status != "RUNNING":
        return False
    with_retries(c.set_terminated, run_id, status="FAILED", what="mark run FAILED")
    return True


class RunTracker:
    """Rank 0's handle on its MLflow run (a new one, or the checkpoint's ``run_id`` reopened)."""

    def __init__(self, config: dict, tags: dict[str, str], run_id: str | None = None):
        tracking = config.get("tracking", {})
        self.uri = tracking_uri(tracking.get("uri"))
        self.client = client(self.uri)
        self.experiment_id = _experiment_id(self.client, tracking.get("experiment") or config.get("paper") or "adhoc")
        self.buffer: list = []
        self.last_flush = time.monotonic()
        self.logged_upto: dict[str, int] = {}  # metric key -> highest step already in the store
        if run_id and self._reopen(run_id):
            self.run_id = run_id
            return
        name = f"{config.get('name') or config['method']}-seed{config['seed']}"
        run = with_retries(self.client.create_run, self.experiment_id, run_name=name, tags=tags,
                           what="create run")
        self.run_id = run.info.run_id
        self._log_params(config)

    def _reopen(self, run_id: str) -> bool:
        """Continue a checkpointed run: RUNNING again, and remember what is already stored."""
        try:
            run = with_retries(self.client.get_run, run_id, what="get run")
        except Exception as err:  # noqa: BLE001 - e.g. another store than the first attempt's
            print(f"[commlab] the checkpoint's MLflow run {run_id} is not in {self.uri} ({err}); "
                  f"starting a new run", file=sys.stderr, flush=True)
            return False
        with_retries(self.client.update_run, run_id, status="RUNNING", what="reopen run")
        for key in run.data.metrics:
            history = with_retries(self.client.get_metric_history, run_id, key, what="metric history")
            self.logged_upto[key] = max((m.step for m in history), default=-1)
        return True

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in sorted(flatten(config).items())]
        for i in range(0, len(params), 100):
            with_retries(self.client.log_batch, self.run_id, params=params[i:i + 100], what="log params")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics for ``step`` (dropping keys already stored at this step or later);
        written at the next :meth:`flush`, or now when the last flush is old."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.buffer.extend(Metric(k, float(v), ts, step) for k, v in metrics.items()
                           if step > self.logged_upto.get(k, -1))
        if time.monotonic() - self.last_flush > FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self.buffer), MAX_BATCH):
            with_retries(self.client.log_batch, self.run_id, metrics=self.buffer[i:i + MAX_BATCH],
                         what="log metrics")
        for m in self.buffer:
            self.logged_upto[m.key] = max(self.logged_upto.get(m.key, -1), m.step)
        self.buffer = []
        self.last_flush = time.monotonic()

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        if Path(path).exists():
            with_retries(self.client.log_artifact, self.run_id, str(path), folder, what="log artifact")

    def set_tag(self, key: str, value: str) -> None:
        with_retries(self.client.set_tag, self.run_id, key, value, what="set tag")

    def finish(self, status: str) -> None:
        """Write what is buffered and set the final status (FINISHED, KILLED or FAILED)."""
        try:
            self.flush()
        finally:
            with_retries(self.client.set_terminated, self.run_id, status=status, what=f"mark run {status}")


def flattened_params(config: dict) -> dict:
    return flatten(config)
