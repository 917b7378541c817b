"""MLflow: one experiment per paper, one run per (paper, method variant, seed), rank 0 only.

Where the project meets MLflow: the store and its one client (:func:`client`), the experiments
(:func:`ensure_experiments`), what a training run records (:func:`run_params`, :func:`run_tags`:
the config and what the rank learnt building the run, :class:`RunFacts`), the run itself
(:class:`RunTracker`) and its failure marks. The loop opens its run with one call,
:func:`commlab.loop.logger.open_logger`; where the code came from (commit, source tags) is
:mod:`commlab.provenance`'s.

The store defaults to SQLite inside the project (``sqlite:///<cwd>/mlflow.db``);
``MLFLOW_TRACKING_URI`` or the config's ``tracking.uri`` override it. On clusters use a tracking
server (``mlflow server --backend-store-uri postgresql://...``) or a database server: SQLite's
file locking is not reliable on NFS/Lustre (docs/cluster.md).

Lifecycle of a run, across restarts (the run id travels in every checkpoint):

* created RUNNING, named ``<name>-seed<seed>[-<scale>]`` (:func:`run_name`), with the tags of
  :func:`run_tags` and the flattened params of :func:`run_params`;
* metrics are buffered and written in batches at epoch ends (and at least every
  ``FLUSH_EVERY_S`` seconds), so a long epoch still shows progress;
* stopped by SIGTERM (preemption): checkpoint, then KILLED; the re-launched job reopens the same
  run (RUNNING again) and drops every metric point at or below the step already stored for that
  key, so a resumed run never records a step twice;
* any error: FAILED. If rank 0 itself dies, rank 1 marks the run FAILED (:func:`mark_failed`);
  if the whole job is SIGKILLed nobody can, the run stays RUNNING until the re-launch continues
  it.

What the MLflow UI shows besides params and metrics:

* every experiment carries ``mlflow.experimentKind = custom_model_development`` (MLflow 3's
  "Machine learning" kind), so opening it shows the training runs, not the GenAI overview, and a
  paper's experiment carries the paper's title as its description (``mlflow.note.content``, the
  ``title:`` of config/papers/<paper>.yaml), set when it is created and on existing experiments;
* every new run carries MLflow's source tags (``mlflow.source.name``: the training entry every
  process runs, src/commlab/loop/worker.py, as ``python -m commlab.loop`` or ``commlab train``;
  ``type``, ``git.commit``, ``git.branch``, ``git.repoURL``: the Source and Version columns) and
  its dataset as a run input (name, the prepared data's content hash as digest, its folder as
  source: the Dataset column), taken from what the run already knows, never by reading the data
  again;
* an emulated network's numeric settings and measurements (``network.bandwidth_mbit``,
  ``network_measured_mbit``, ...) are metrics at step 0, so runs can be charted against link speed
  (:func:`split_network`, the one place that reads the config's network section for MLflow).

Under ``commlab launch`` on one node, rank 0's calls are made for it by the launcher, which has
imported MLflow while the workers started (:mod:`commlab.tracking_relay`): the same calls, in the
same order, with the same results.

SQLite allows one writer at a time; parallel jobs briefly meet "database is locked". Every store
call retries such transient errors with exponential backoff (:func:`with_retries`).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from commlab.config import flatten
from commlab.grid import grid_title
from commlab.malloc import describe
from commlab.provenance import git_commit, source_tags

# Telemetry off before mlflow is imported anywhere (no network here, and none wanted).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per call
FLUSH_EVERY_S = 60.0  # write buffered metrics at least this often, besides epoch ends
RETRIES = 10  # attempts per store call on transient errors (about 40 s of backoff in all)
# The last: two runs of one experiment logging the same dataset at once race between MLflow's
# look-up and its insert; the retry finds the other run's row and links it.
TRANSIENT = ("database is locked", "database is busy", "temporarily_unavailable", "unable to open database",
             "connection reset", "connection refused", "timed out", "unique constraint failed: datasets.")


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # read by the MLflow 3 UI to choose the experiment's page
EXPERIMENT_KIND = "custom_model_development"  # "Machine learning": opens on the runs table
DESCRIPTION_TAG = "mlflow.note.content"  # an experiment's description (a paper's: its grid's title)
DATASET_DIGEST_CHARS = 12  # MLflow stores at most 36; `commlab data prepare` prints the same 12
NETWORK_PREFIXES = ("network.", "network_")  # the config's section, the launcher's measured values


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


SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # stores MLflow keeps through SQLAlchemy


def warm_up(configured: str | None = None) -> None:
    """Import MLflow's client and, for a database store (``configured``: the config's
    ``tracking.uri``), its SQL store with its table mappings set up: what a first call spends
    (seconds of CPU), spent ahead of it by the launcher's tracking relay
    (:mod:`commlab.tracking_relay`). Nothing is read or written: a run that never opens leaves
    the store as it was."""
    from mlflow.tracking import MlflowClient  # noqa: F401

    if tracking_uri(configured).startswith(SQL_SCHEMES):
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore  # noqa: F401
        from sqlalchemy.orm import configure_mappers

        configure_mappers()


def ensure_experiments(names: list[str], uri: str | None = None) -> dict[str, str]:
    """Create the experiments that do not exist yet, each of the training-runs kind and described
    by its paper's title (existing ones get both too); return name -> id. Call this once before
    parallel jobs start (two processes creating the SQLite schema at once fail)."""
    store = client(uri)
    return {name: _experiment_id(store, name) for name in names}


def _experiment_id(store, name: str) -> str:
    """The experiment's id, created if missing; its kind set to training runs either way, and its
    description to its paper's title where it is a paper's (:func:`commlab.grid.grid_title`)."""
    description = grid_title(name)
    wanted = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, **({DESCRIPTION_TAG: description} if description else {})}
    experiment = with_retries(store.get_experiment_by_name, name, what="get experiment")
    if experiment is None:
        try:
            return with_retries(store.create_experiment, name, tags=wanted, what="create experiment")
        except Exception:  # noqa: BLE001 - another job created it meanwhile
            experiment = with_retries(store.get_experiment_by_name, name, what="get experiment")
    # Older stores' experiments have no kind (the UI then guesses GenAI) and no description. These
    # experiments hold training runs only, so any other kind is set back (a write only when a tag differs).
    for key, value in wanted.items():
        if experiment.tags.get(key) != value:
            with_retries(store.set_experiment_tag, experiment.experiment_id, key, value,
                         what=f"set experiment tag {key}")
    return experiment.experiment_id


def dataset_input(name: str, digest: str, path: str | Path | None):
    """A run input naming a dataset by its content hash, without reading it: the Dataset column.
    ``path`` is the prepared folder (a local source); None for data generated on the fly."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    source, source_type = ({"uri": str(Path(path).resolve())}, "local") if path else ({"generated": name}, "code")
    dataset = Dataset(name=name, digest=str(digest)[:DATASET_DIGEST_CHARS], source_type=source_type,
                      source=json.dumps(source))
    return DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, "train")])


def split_network(config: dict) -> tuple[dict, dict]:
    """``(params, metrics)`` of a flattened config: the network's numbers (the config's
    ``network.*`` section and the launcher's ``network_*`` measurements) are metrics; the
    config's section stays among the params as well, as the run's settings.

    Under an emulated network the launcher puts the link as built and measured into the config's
    section (``network.emulated``: ``network_label``, ``network_measured_mbit``, ...): those keys
    are recorded as top-level ``network_*`` keys, and a section left empty as ``network: None``."""
    if isinstance(config.get("network"), dict):
        network = dict(config["network"])
        emulated = network.pop("emulated", None) or {}
        config = {**config, "network": network or None, **emulated}
    params, metrics = {}, {}
    for key, value in flatten(config).items():
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if key.startswith(NETWORK_PREFIXES) and is_number:
            metrics[key] = float(value)
            if key.startswith("network_"):
                continue  # a measurement, not a setting
        params[key] = value
    return params, metrics


@dataclass(frozen=True)
class RunFacts:
    """What a rank learns while it builds its run, recorded beside the config."""

    workers: int  # the world size
    backend: str  # the backend in use (``auto`` resolved)
    data_hash: str | None  # the prepared data's content hash (meta.json), None when unknown
    method_options: dict = field(default_factory=dict)  # the method's options, defaults included
    method_settings: dict = field(default_factory=dict)  # what the method derives from them (schedule.*)
    model_parameters: int = 0
    test_samples: int | None = None  # the evaluation's size, where the task has a test set


def run_params(config: dict, facts: RunFacts) -> dict:
    """A new run's params, before flattening: the config, every method option (the defaults
    included, so that runs compare on all of them), the model's size, what the method derives
    and the evaluation's size (the reports' standard errors need it)."""
    params = {**config, "method_params": facts.method_options, "model_parameters": facts.model_parameters,
              **facts.method_settings}
    if facts.test_samples is not None:
        params["test_images"] = facts.test_samples
    return params


def run_tags(config: dict, facts: RunFacts) -> dict[str, str]:
    """A new run's tags (MLflow's source tags come on top when it is created). Runs git: compute
    them only where they are recorded. Under an emulated network the link's label is a tag too."""
    tags = {"paper": config["paper"], "method": config["method"],
            "name": config.get("name") or config["method"], "seed": str(config["seed"]),
            "workers": str(facts.workers), "backend": facts.backend, "git_commit": git_commit(),
            "data_hash": str(facts.data_hash), "model": config["model"],
            "dataset": config["dataset"], "scale": config.get("scale") or "adhoc",
            "worker_malloc": describe()}  # speed, not numbers, depends on it (commlab.loop.heap)
    emulated = (config.get("network") or {}).get("emulated")
    if emulated:
        tags["network"] = str(emulated.get("network_label", emulated.get("network_bandwidth_mbit")))
    return tags


def run_name(config: dict) -> str:
    """``<name>-seed<seed>``, with ``-<scale>`` when the config names its scale."""
    name = f"{config.get('name') or config['method']}-seed{config['seed']}"
    return f"{name}-{config['scale']}" if config.get("scale") else name


def _prepared_folder(data_dir: str | None, name: str | None) -> Path | None:
    """``<data_dir>/<name>`` when that folder exists (a prepared dataset), else None."""
    folder = Path(data_dir) / name if data_dir and name else None
    return folder if folder and folder.is_dir() else None


def mark_failed(run_id: str, configured: str | None = None, reason: str | None = None,
                rank: int | None = None) -> bool:
    """Mark ``run_id`` FAILED if it is still RUNNING (for a rank other than the dead rank 0, or the
    launcher after every worker died); ``configured`` is the config's ``tracking.uri``. ``reason``
    and ``rank``, when given, become the run's ``failure`` and ``failed_rank`` tags (also on a run
    a worker already marked FAILED). Returns whether it changed the status."""
    c = client(tracking_uri(configured))
    run = with_retries(c.get_run, run_id, what="get run")
    if run.info.status not in ("RUNNING", "FAILED"):
        return False  # finished, or preempted (KILLED): a later failure of the job is not the run's
    for key, value in (("failure", reason), ("failed_rank", rank)):
        if value is not None:
            with_retries(c.set_tag, run_id, key, str(value), what=f"tag run {key}")
    if run.info.status != "RUNNING":
        return False
    with_retries(c.set_terminated, run_id, status="FAILED", what="mark run FAILED")
    return True


RUN_RECORD = "mlflow_run.json"  # in the run's folder: which MLflow run its workers log to


def write_run_record(folder: str | Path, run_id: str, configured: str | None = None) -> None:
    """Rank 0, once its MLflow run is open: note the run id and store in the run's folder, so that
    the launcher can close the run when every worker died (an NCCL watchdog aborts them all)."""
    path = Path(folder) / RUN_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "uri": tracking_uri(configured)}))
    os.replace(tmp, path)


def record_failure(folder: str | Path, reason: str, rank: int | None = None) -> str | None:
    """The launcher's last word on a job whose workers failed: the run named by the folder's
    :data:`RUN_RECORD` is marked FAILED if still RUNNING and tagged with ``reason`` and the failing
    ``rank``. Returns the run id, or None when there is no record (the run never opened) or the
    store cannot be reached (said on stderr: the job's own failure is what matters)."""
    path = Path(folder) / RUN_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    try:
        mark_failed(record["run_id"], record.get("uri"), reason, rank)
    except Exception as err:  # noqa: BLE001 - never mask the job's failure
        print(f"[commlab launch] could not mark MLflow run {record.get('run_id')} FAILED: {err}",
              file=sys.stderr, flush=True)
        return None
    return record["run_id"]


class RunTracker:
    """Rank 0's handle on its MLflow run (a new one, or the checkpoint's ``run_id`` reopened).

    ``config`` is the run config, flattened into params (the loop's: :func:`run_params`); ``tags``
    are set on a new run over the source tags of :func:`commlab.provenance.source_tags` (the loop's:
    :func:`run_tags`); a new run is named by :func:`run_name`. A new run also gets its dataset as a run input and the
    emulated network's numbers as metrics at step 0 (see :func:`split_network`). The optional
    keywords say what would otherwise be taken from ``config`` and ``tags``:

    * ``dataset_name``: the dataset's name (default: ``config["dataset"]``);
    * ``dataset_digest``: its content hash (default: ``tags["data_hash"]``; no input when neither
      is known), shortened to :data:`DATASET_DIGEST_CHARS` characters;
    * ``dataset_path``: the prepared folder (default: ``<data_dir>/<dataset name>`` when it exists;
      none for generated data);
    * ``network_info``: the launcher's description of an emulated network (``network_*`` keys,
      as in ``COMMLAB_NETWORK_JSON``), also accepted as top-level ``network_*`` keys of ``config``.

    A reopened run keeps what it already has: nothing of this is logged again."""

    def __init__(self, config: dict, tags: dict[str, str], run_id: str | None = None, *,
                 dataset_name: str | None = None, dataset_digest: str | None = None,
                 dataset_path: str | Path | None = None, network_info: dict | None = None):
        tracking = config.get("tracking", {})
        self.uri = tracking_uri(tracking.get("uri"))
        self.client = client(self.uri)
        experiment = tracking.get("experiment") or config.get("paper") or "adhoc"
        self.experiment_id = _experiment_id(self.client, experiment)
        self.buffer: list = []
        self.last_flush = time.monotonic()
        self.logged_upto: dict[str, int] = {}  # metric key -> highest step already in the store
        if run_id and self._reopen(run_id):
            self.run_id = run_id
            return
        run = with_retries(self.client.create_run, self.experiment_id, run_name=run_name(config),
                           tags={**source_tags(), **tags}, what="create run")
        self.run_id = run.info.run_id
        params, network_metrics = split_network({**config, **(network_info or {})})
        self._log_params(params)
        if network_metrics:
            self.log_metrics(network_metrics, step=0)
            self.flush()
        dataset_name = dataset_name or config.get("dataset")
        self._log_dataset(dataset_name, dataset_digest or tags.get("data_hash"),
                          dataset_path or _prepared_folder(config.get("data_dir"), dataset_name))

    def _log_dataset(self, name: str | None, digest: str | None, path) -> None:
        if not name or not digest or digest == "None":
            return
        try:
            with_retries(self.client.log_inputs, self.run_id, datasets=[dataset_input(name, digest, path)],
                         what="log dataset input")
        except Exception as err:  # noqa: BLE001 - the data hash is a tag of the run already; train on
            print(f"[commlab] could not log the dataset input {name} ({digest}) of run {self.run_id}: "
                  f"{str(err).splitlines()[0][:160]}", file=sys.stderr, flush=True)

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

    def _log_params(self, flat: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in sorted(flat.items())]
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
