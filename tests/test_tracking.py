"""What the MLflow UI reads from a run made by RunTracker: the experiment's kind and description,
the source and git tags, the dataset input and the emulated network's numbers as metrics; and
what the loop's one call to open its run (commlab.loop.logger.open_logger) records
(commlab.tracking)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from commlab.config import DEFAULTS, deep_merge, flatten
from commlab.grid import grid_title
from commlab.launch.command import RELAY_REMARK
from commlab.provenance import ENTRY_MODULE, git_commit
from commlab.tracking import (
    DESCRIPTION_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    RUN_RECORD,
    RunFacts,
    RunTracker,
    ensure_experiments,
)

ROOT = Path(__file__).resolve().parents[1]
HASH = "a3" * 32  # a content hash as meta.json holds it (64 hex digits)
NETWORK = {"network_emulated": True, "network_bandwidth_mbit": 100.0, "network_latency_ms": 0.0,
           "network_label": "emulated 100 Mbit/s", "network_measured_mbit": 97.25, "network_probe_bytes": 6250000}


@pytest.fixture
def uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _config(tmp_path, uri, **extra):
    config = deep_merge(DEFAULTS, {"paper": "kstep", "method": "ssgd", "seed": 1, "model": "mlp",
                                   "dataset": "fashion_mnist", "data_dir": str(tmp_path / "prepared"),
                                   "tracking": {"uri": uri, "experiment": "kstep"},
                                   "network": {"bandwidth_mbit": 100.0, "latency_ms": 5.0}})
    (tmp_path / "prepared" / "fashion_mnist").mkdir(parents=True)
    return {**config, **extra}


def _tags(**extra):
    return {"paper": "kstep", "method": "ssgd", "data_hash": HASH, **extra}


def test_new_run_carries_source_dataset_and_network_metrics(tmp_path, uri, monkeypatch):
    monkeypatch.chdir(ROOT)  # the paper grids' titles: config/papers/<paper>.yaml
    tracker = RunTracker({**_config(tmp_path, uri), **NETWORK}, _tags())
    tracker.finish("FINISHED")
    c = MlflowClient(uri)
    run = c.get_run(tracker.run_id)

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert run.data.tags["mlflow.source.type"] == "LOCAL"
    assert run.data.tags["mlflow.source.name"] == str(ENTRY_MODULE)
    assert run.data.tags["mlflow.source.git.commit"] == commit
    assert run.data.tags["paper"] == "kstep"  # the caller's tags next to them

    [entry] = run.inputs.dataset_inputs
    assert entry.dataset.name == "fashion_mnist" and entry.dataset.digest == HASH[:12]
    assert entry.dataset.source_type == "local"
    assert str(tmp_path / "prepared" / "fashion_mnist") in entry.dataset.source
    assert {t.key: t.value for t in entry.tags} == {"mlflow.data.context": "train"}

    metrics = run.data.metrics
    assert metrics == {"network.bandwidth_mbit": 100.0, "network.latency_ms": 5.0, "network_bandwidth_mbit": 100.0,
                       "network_latency_ms": 0.0, "network_measured_mbit": 97.25, "network_probe_bytes": 6250000.0}
    assert all(h.step == 0 for key in metrics for h in c.get_metric_history(tracker.run_id, key))
    params = run.data.params
    assert not any(k.startswith("network_") and k in metrics for k in params)  # measurements: metrics only
    assert params["network_label"] == "emulated 100 Mbit/s" and params["network_emulated"] == "True"
    assert params["network.bandwidth_mbit"] == "100.0"  # the config keeps its settings as params
    assert params["train.lr"] == str(DEFAULTS["train"]["lr"])

    experiment = c.get_experiment(tracker.experiment_id)
    assert experiment.name == "kstep" and experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert experiment.tags[DESCRIPTION_TAG] == grid_title("kstep") and grid_title("kstep").startswith("K-step")


def test_the_source_is_the_module_every_training_process_runs():
    """`python -m commlab.loop` (what the launcher starts on every worker) and `commlab train` both
    run commlab.loop.worker: the file a run names as its source exists and is that module."""
    import importlib.util
    import inspect

    from commlab.launch.torchrun import train_argv

    assert ENTRY_MODULE.is_file()
    assert Path(importlib.util.find_spec("commlab.loop.worker").origin).resolve() == ENTRY_MODULE
    assert train_argv("run.yaml", None)[:2] == ["-m", "commlab.loop"]
    assert "from commlab.loop.worker import main" in (ENTRY_MODULE.parent / "__main__.py").read_text()
    import commlab.cli

    assert "from commlab.loop.worker import run" in inspect.getsource(commlab.cli)


def test_explicit_dataset_and_network_arguments(tmp_path, uri):
    """The keywords say what config and tags would otherwise give; generated data has no folder."""
    tracker = RunTracker(_config(tmp_path, uri, network=None), _tags(data_hash="ignored"),
                         dataset_name="cifar10", dataset_digest="b7" * 32, dataset_path=tmp_path / "elsewhere",
                         network_info={"network_measured_mbit": 12.5})
    run = MlflowClient(uri).get_run(tracker.run_id)
    [entry] = run.inputs.dataset_inputs
    assert (entry.dataset.name, entry.dataset.digest, entry.dataset.source_type) == ("cifar10", "b7" * 6, "local")
    assert str(tmp_path / "elsewhere") in entry.dataset.source
    assert run.data.metrics == {"network_measured_mbit": 12.5}
    assert run.data.params["network"] == "None"

    tracker = RunTracker(_config(tmp_path / "b", uri, network=None, dataset="synthetic"),
                         _tags(data_hash="synthetic-1"))
    [entry] = MlflowClient(uri).get_run(tracker.run_id).inputs.dataset_inputs
    assert (entry.dataset.name, entry.dataset.digest, entry.dataset.source_type) == \
        ("synthetic", "synthetic-1", "code")  # generated on the fly: no folder


def test_reopened_run_logs_nothing_twice(tmp_path, uri):
    first = RunTracker({**_config(tmp_path, uri), **NETWORK}, _tags())
    first.finish("KILLED")
    again = RunTracker({**_config(tmp_path / "b", uri), **NETWORK}, _tags(), run_id=first.run_id)
    assert again.run_id == first.run_id
    again.finish("FINISHED")
    c = MlflowClient(uri)
    assert len(c.get_run(first.run_id).inputs.dataset_inputs) == 1
    assert len(c.get_metric_history(first.run_id, "network_measured_mbit")) == 1


def test_ensure_experiments_sets_kind_and_description_on_new_and_old_experiments(uri, monkeypatch):
    monkeypatch.chdir(ROOT)  # the paper grids' titles: config/papers/<paper>.yaml
    c = MlflowClient(uri)
    old = c.create_experiment("baseline")  # as an older commlab made it: no kind, no description
    c.set_experiment_tag(c.create_experiment("adpsgd"), EXPERIMENT_KIND_TAG, "genai_development")
    c.set_experiment_tag(c.get_experiment_by_name("adpsgd").experiment_id, DESCRIPTION_TAG, "an old note")
    ids = ensure_experiments(["baseline", "adpsgd", "redsync", "adhoc"], uri)
    assert ids["baseline"] == old
    for name, exp_id in ids.items():
        tags = c.get_experiment(exp_id).tags
        assert tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND, name
        assert tags.get(DESCRIPTION_TAG) == grid_title(name), name
    assert c.get_experiment(ids["redsync"]).tags[DESCRIPTION_TAG].startswith("RedSync: residual gradient compression")
    assert DESCRIPTION_TAG not in c.get_experiment(ids["adhoc"]).tags  # no paper: no description
    assert grid_title("adhoc") is None


def test_mlflow_init_command_sets_kind_and_description(tmp_path, uri):
    """The workflow's mlflow_init rule runs this command (in the project's root)."""
    subprocess.run([sys.executable, "-m", "commlab", "mlflow-init", "oktopk", "--marker", str(tmp_path / "m")],
                   check=True, capture_output=True, env={**os.environ, "MLFLOW_TRACKING_URI": uri}, cwd=ROOT)
    tags = MlflowClient(uri).get_experiment_by_name("oktopk").tags
    assert tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert tags[DESCRIPTION_TAG] == ("Ok-Topk: near-optimal sparse allreduce (Li & Hoefler, PPoPP'22), "
                                     "with sparse baselines")


def test_only_a_recording_rank_computes_the_tags(monkeypatch):
    """The run's tags run git: rank 0 with tracking on computes them, no other rank, and no rank
    with tracking off."""
    import commlab.tracking
    from commlab.loop.logger import NullLogger, open_logger

    def no_git():
        raise AssertionError("tags computed where nothing records them")

    monkeypatch.setattr(commlab.tracking, "git_commit", no_git)
    facts = RunFacts(workers=1, backend="gloo", data_hash=None)
    other_rank = SimpleNamespace(is_main=False, rank=1, world_size=1)
    assert isinstance(open_logger({"tracking": {"enabled": True}}, facts, other_rank, "r1"), NullLogger)
    rank0 = SimpleNamespace(is_main=True, rank=0, world_size=1)
    assert isinstance(open_logger({"tracking": {"enabled": False}}, facts, rank0, None), NullLogger)


# What the launcher puts into a run's config under an emulated network (network.emulated).
EMULATED = {"network_emulated": True, "network_bandwidth_mbit": 100.0, "network_latency_ms": 0.0,
            "network_label": "emulated 100 Mbit/s", "network_measured_mbit": 97.25, "network_qdisc": "tbf"}


def _loop_config(tmp_path, uri, network=None):
    config = deep_merge(DEFAULTS, {"paper": "kstep", "name": "probe", "method": "kstep", "seed": 1, "scale": "smoke",
                                   "model": "mlp", "dataset": "fashion_mnist", "data_dir": str(tmp_path / "prepared"),
                                   "output_dir": str(tmp_path / "out"), "tracking": {"uri": uri, "experiment": "kstep"},
                                   "method_params": {"k": 4}})
    config["network"] = network
    (tmp_path / "prepared" / "fashion_mnist").mkdir(parents=True, exist_ok=True)
    return config


FACTS = RunFacts(workers=2, backend="gloo", data_hash=HASH, method_options={"k": 4, "local_steps": 1},
                 method_settings={"schedule.period": 4}, model_parameters=1234, test_samples=500)


def _open_and_close(config, facts=FACTS):
    from commlab.loop.logger import RunLogger, open_logger

    logger = open_logger(config, facts, SimpleNamespace(is_main=True, rank=0, world_size=1), None)
    assert isinstance(logger, RunLogger)
    logger.close("FINISHED")
    return logger.run_id


@pytest.mark.parametrize("emulated", [False, True])
def test_the_loops_one_call_records_the_runs_params_tags_and_network(tmp_path, uri, monkeypatch, emulated):
    """open_logger on rank 0 opens a run that holds the config flattened, every method option, the
    method's derived settings, the model's size, the evaluation's size, the run's tags over the
    source tags, the scale in its name, the dataset as input; under an emulated network the link
    as the launcher built and measured it (settings as params, numbers as metrics at step 0, its
    label as a tag); and the run record for the launcher beside the run's outputs."""
    from commlab.malloc import describe
    from commlab.provenance import source_tags

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the paper's title: config/papers/kstep.yaml
    settings = {"bandwidth_mbit": 100.0, "latency_ms": 0.0}
    config = _loop_config(tmp_path, uri, {**settings, "emulated": EMULATED} if emulated else None)
    run_id = _open_and_close(config)
    client = MlflowClient(uri)
    run = client.get_run(run_id)

    # Params: the config (its network section without the launcher's part) and what the loop adds.
    others = {k: v for k, v in config.items() if k != "network"}
    expected = {key: str(value) for key, value in flatten(others).items()}
    expected |= {"method_params.k": "4", "method_params.local_steps": "1", "schedule.period": "4",
                 "model_parameters": "1234", "test_images": "500"}
    if emulated:
        expected |= {"network.bandwidth_mbit": "100.0", "network.latency_ms": "0.0", "network_emulated": "True",
                     "network_label": "emulated 100 Mbit/s", "network_qdisc": "tbf"}
    else:
        expected["network"] = "None"
    assert run.data.params == expected
    # Metrics: the network's numbers only, at step 0 (a measurement is no param).
    network_metrics = {"network.bandwidth_mbit": 100.0, "network.latency_ms": 0.0, "network_bandwidth_mbit": 100.0,
                       "network_latency_ms": 0.0, "network_measured_mbit": 97.25} if emulated else {}
    assert run.data.metrics == network_metrics
    assert all(point.step == 0 for key in network_metrics for point in client.get_metric_history(run_id, key))
    # Tags: the run's own over MLflow's source tags, and its name with the scale.
    tags = {"paper": "kstep", "method": "kstep", "name": "probe", "seed": "1", "workers": "2", "backend": "gloo",
            "git_commit": git_commit(), "data_hash": HASH, "model": "mlp", "dataset": "fashion_mnist",
            "scale": "smoke", "worker_malloc": describe(), **source_tags(), "mlflow.runName": "probe-seed1-smoke"}
    if emulated:
        tags["network"] = "emulated 100 Mbit/s"
    assert run.data.tags == tags and run.info.run_name == "probe-seed1-smoke"
    [entry] = run.inputs.dataset_inputs
    assert (entry.dataset.name, entry.dataset.digest) == ("fashion_mnist", HASH[:12])
    assert str(tmp_path / "prepared" / "fashion_mnist") in entry.dataset.source
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "kstep" and experiment.tags[DESCRIPTION_TAG] == grid_title("kstep")
    record = json.loads((tmp_path / "out" / RUN_RECORD).read_text())
    assert record == {"run_id": run_id, "uri": uri}


def test_the_loops_one_call_without_scale_test_set_or_known_data(tmp_path, uri):
    """An ad-hoc run: named without a scale, tagged scale adhoc, no test_images param, and no
    dataset input when the data's hash is unknown (the tag says None)."""
    config = {**_loop_config(tmp_path, uri), "scale": None, "paper": "adhoc", "name": None,
              "tracking": {"uri": uri, "experiment": None}}
    run_id = _open_and_close(config, RunFacts(workers=1, backend="gloo", data_hash=None))
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.run_name == "kstep-seed1" and run.data.tags["scale"] == "adhoc"
    assert run.data.tags["name"] == "kstep" and run.data.tags["data_hash"] == "None"
    assert "test_images" not in run.data.params and run.data.params["model_parameters"] == "0"
    assert run.inputs.dataset_inputs == []
    assert MlflowClient(uri).get_experiment(run.info.experiment_id).name == "adhoc"


def _run_without_git(rank, world, config):
    import commlab.tracking
    from looprun import run

    def no_git():
        raise AssertionError(f"rank {rank} ran git for tags nothing records")

    commlab.tracking.git_commit = no_git
    return run(config)[0]["step"]


def test_a_run_without_tracking_runs_no_git(tmp_path):
    """Two ranks of a real run with tracking off: neither computes the tags (git, on every rank,
    before the first step)."""
    from commlab.testing import run_distributed
    from looprun import run_config

    config = run_config(tmp_path, tmp_path, "nogit", "synthetic", "mlp", 8, **{"train.max_steps": 2})
    assert run_distributed(_run_without_git, 2, args=(config,), timeout_s=120) == [2, 2]


@pytest.mark.parametrize("command, workers", [("train", 1), ("launch", 2)])
def test_a_training_run_carries_scale_source_and_dataset(tmp_path, uri, command, workers):
    """A real run of the loop (generated data) lands in MLflow with the scale as tag and in its
    name, the source and git tags, the dataset as a run input, model_parameters, its metrics, and
    no checkpoint among its artifacts (tracking.log_checkpoints is off by default): alone
    (``commlab train``, rank 0 logs itself) and under ``python -m commlab launch``, whose tracking
    relay makes rank 0's calls (commlab.tracking_relay; no fallback said)."""
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(
        "paper: trackcheck\nname: probe\nmethod: ssgd\nseed: 3\nscale: smoke\nmodel: mlp\ndataset: synthetic\n"
        f"workers: {workers}\noutput_dir: {tmp_path / 'out'}\ntracking: {{uri: '{uri}', experiment: trackcheck}}\n"
        "train: {epochs: 1, max_steps: 4, log_every: 2, batch_size: 16}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "commlab", command, "--config", str(run_yaml)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (RELAY_REMARK in out.stdout) == (command == "launch") and "relay" not in out.stderr
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("trackcheck")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    (run,) = client.search_runs([experiment.experiment_id])
    tags = run.data.tags
    assert tags["scale"] == "smoke" and tags["mlflow.runName"] == "probe-seed3-smoke"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head and tags["git_commit"].split("-")[0] == head
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.source.name"] == str(ENTRY_MODULE)
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["synthetic"]
    assert int(run.data.params["model_parameters"]) > 0 and run.data.tags["workers"] == str(workers)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [2, 4]
    assert run.info.status == "FINISHED"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "checkpoint" not in artifacts, artifacts
