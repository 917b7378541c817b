"""MLflow: one experiment per paper, one run per (paper, method variant, seed), rank 0 only.

The store defaults to SQLite inside the project (``sqlite:///<cwd>/mlflow.db``);
``MLFLOW_TRACKING_URI`` or the config's ``tracking.uri`` override it (use a tracking server on
clusters: SQLite on NFS/Lustre is not safe). Metrics are buffered and written in batches at epoch
ends, and on resume anything at or below the last logged step is dropped, so a crashed and
resumed run never records a step twice. A run that fails is marked FAILED; one stopped by SIGTERM
is marked KILLED and becomes RUNNING again when it resumes.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from commlab.config import flatten

# Telemetry off before mlflow is imported anywhere (no network here, and none wanted).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per call


def tracking_uri(configured: str | None = None) -> str:
    """Environment first, then the config, then SQLite in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def client(uri: str | None = None):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(uri)
    mlflow.set_tracking_uri(uri)
    return MlflowClient(uri)


def ensure_experiments(names: list[str], uri: str | None = None) -> dict[str, str]:
    """Create the experiments that do not exist yet; return name -> id. Call this once before
    parallel jobs start (two processes creating the SQLite schema at once fail)."""
    c = client(uri)
    ids = {}
    for name in names:
        exp = c.get_experiment_by_name(name)
        ids[name] = exp.experiment_id if exp else c.create_experiment(name)
    return ids


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


class RunTracker:
    """Rank 0's handle on its MLflow run."""

    def __init__(self, config: dict, tags: dict[str, str], run_id: str | None = None):
        tracking = config.get("tracking", {})
        self.client = client(tracking.get("uri"))
        experiment = tracking.get("experiment") or config.get("paper") or "adhoc"
        self.experiment_id = self._experiment(experiment)
        self.buffer: list = []
        self.logged_upto = -1
        if run_id:  # resume the same run
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            history = self.client.get_metric_history(run_id, "train_loss")
            self.logged_upto = max((m.step for m in history), default=-1)
        else:
            name = f"{config.get('name') or config['method']}-seed{config['seed']}"
            run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
            self.run_id = run.info.run_id
            self._log_params(config)

    def _experiment(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # noqa: BLE001 - another job created it meanwhile
            return self.client.get_experiment_by_name(name).experiment_id

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in sorted(flatten(config).items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffer metrics for ``step``; written at the next :meth:`flush`."""
        from mlflow.entities import Metric

        if step <= self.logged_upto:
            return  # already recorded before a restart
        ts = int(time.time() * 1000)
        self.buffer.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())

    def flush(self) -> None:
        for i in range(0, len(self.buffer), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=self.buffer[i:i + MAX_BATCH])
        self.buffer = []

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        if Path(path).exists():
            self.client.log_artifact(self.run_id, str(path), folder)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def finish(self, status: str) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=status)


def flattened_params(config: dict) -> dict:
    return flatten(config)
