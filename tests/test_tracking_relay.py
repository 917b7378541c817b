"""The launcher's tracking relay (commlab.tracking_relay): rank 0's MLflow calls made by the
launcher record exactly what rank 0's own calls record, errors come back as themselves, a dead
rank 0 leaves the run as it would, and rank 0 never imports MLflow. (A launched run's whole record:
tests/test_tracking.py.)"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from commlab.config import DEFAULTS, deep_merge
from commlab.tracking import RunTracker
from commlab.tracking_relay import RelayedTracker, TrackingRelay, open_tracker

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def relay(uri):
    relay = TrackingRelay(uri)
    yield relay
    relay.close()
    assert not relay._thread.is_alive() and not Path(relay.address).exists()


def _params(tmp_path, uri, name):
    return deep_merge(DEFAULTS, {"paper": "relaycheck", "name": name, "method": "ssgd", "seed": 1, "model": "mlp",
                                 "dataset": "synthetic", "tracking": {"uri": uri, "experiment": "relaycheck"},
                                 "model_parameters": 1234})


def _record(tracker, artifact):
    tracker.set_tag("mlflow.runName", "probe")
    for step in (2, 4):
        tracker.log_metrics({"train_loss": 1.0 / step, "bytes_sent": 100.0 * step}, step)
    tracker.flush()
    tracker.log_metrics({"test_accuracy": 87.5}, 4)
    tracker.log_artifact(artifact)
    tracker.finish("FINISHED")


def _stored(client, run_id):
    run = client.get_run(run_id)
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics}
    tags = {k: v for k, v in run.data.tags.items() if k != "commlab.name"}
    return (run.info.status, run.data.params, tags, history,
            sorted(a.path for a in client.list_artifacts(run_id)))


def test_a_relayed_run_records_what_a_direct_run_records(tmp_path, uri, relay):
    artifact = tmp_path / "train.log"
    artifact.write_text("log\n")
    tags = {"paper": "relaycheck", "method": "ssgd", "commlab.name": "x"}
    direct = RunTracker(_params(tmp_path, uri, "probe"), tags)
    _record(direct, artifact)
    relayed = open_tracker(_params(tmp_path, uri, "probe"), tags, None, relay.address)
    assert isinstance(relayed, RelayedTracker)
    _record(relayed, artifact)
    client = MlflowClient(uri)
    assert relayed.run_id != direct.run_id
    expected = _stored(client, direct.run_id)
    assert expected[0] == "FINISHED" and expected[3]["train_loss"] == [(2, 0.5), (4, 0.25)]
    assert expected[4] == ["train.log"] and expected[1]["model_parameters"] == "1234"
    assert _stored(client, relayed.run_id) == expected


def test_a_failed_store_call_raises_its_own_error_in_rank_0(tmp_path, uri, relay):
    direct = RunTracker(_params(tmp_path, uri, "a"), {})
    relayed = open_tracker(_params(tmp_path, uri, "b"), {}, None, relay.address)
    errors = []
    for tracker in (direct, relayed):
        with pytest.raises(MlflowException) as err:
            tracker.set_tag("x" * 300, "too long a key")
        errors.append((type(err.value), err.value.error_code, str(err.value)))
        tracker.finish("FINISHED")
    assert errors[0] == errors[1] and "key" in errors[0][2] and errors[0][1] == "INVALID_PARAMETER_VALUE"


def test_a_rank_0_that_dies_leaves_the_run_as_it_would_and_a_restart_reopens_it(tmp_path, uri, relay):
    first = open_tracker(_params(tmp_path, uri, "probe"), {}, None, relay.address)
    first.log_metrics({"train_loss": 0.5}, 2)
    first.flush()
    first.log_metrics({"train_loss": 0.25}, 4)  # buffered: dies with its rank 0
    first._conn.close()  # the process is gone: no finish
    client = MlflowClient(uri)
    time.sleep(0.2)
    run = client.get_run(first.run_id)
    assert run.info.status == "RUNNING"
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "train_loss")] == [(2, 0.5)]

    again = open_tracker(_params(tmp_path, uri, "probe"), {}, first.run_id, relay.address)  # restarted rank 0
    assert again.run_id == first.run_id
    again.log_metrics({"train_loss": 0.5}, 2)  # already stored: dropped
    again.log_metrics({"train_loss": 0.3}, 4)
    again.finish("FINISHED")
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "train_loss")] == [(2, 0.5), (4, 0.3)]
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_rank_0_logs_directly_when_the_relay_does_not_answer(tmp_path, uri, capsys):
    tracker = open_tracker(_params(tmp_path, uri, "probe"), {}, None, str(tmp_path / "no-such-socket"))
    assert isinstance(tracker, RunTracker)
    tracker.finish("FINISHED")
    assert "tracking relay does not answer" in capsys.readouterr().err
    assert MlflowClient(uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_the_printed_command_runs_the_workers_without_the_launchers_relay(monkeypatch, capsys):
    """The workers get the relay; the printed torchrun line, which a user may run again by hand after
    the launcher (and its relay's socket) are gone, does not."""
    from commlab.launch import command

    started, methods = [], []

    def run_torchrun(args, on_failure, start_method):
        started.append(args)
        methods.append(start_method)
        return 0

    monkeypatch.setattr(command, "run_torchrun", run_torchrun)
    assert command._launch_workers({"workers": 2}, "run.yaml", None, None, command.FailureRecord(),
                                   relay="/tmp/relay.sock") == 0
    printed = capsys.readouterr().out.strip()
    assert started[0][-2:] == ["--tracking-relay", "/tmp/relay.sock"]
    assert printed == "[commlab launch] " + " ".join(command.TORCHRUN + started[0][:-2]) + "  " + command.RELAY_REMARK
    assert methods == ["forkserver"]  # a cold launch: its workers come from a preloaded fork server


def test_rank_0_opens_its_run_through_the_relay_without_importing_mlflow(tmp_path, uri, relay):
    """The point of the relay: rank 0 spends none of MLflow's import (about 2 s of CPU), also
    while it assembles the run's params and tags (the loop's one call, open_logger)."""
    config = {**_params(tmp_path, uri, "probe"), "output_dir": str(tmp_path / "out")}
    probe = (
        "import sys\n"
        "from types import SimpleNamespace\n"
        "from commlab.loop.logger import open_logger\n"
        "from commlab.tracking import RunFacts\n"
        "rank0 = SimpleNamespace(is_main=True, rank=0, world_size=1)\n"
        f"logger = open_logger({config!r}, RunFacts(workers=1, backend='gloo', data_hash=None), rank0, None, "
        f"{relay.address!r})\n"
        "logger.log_metrics({'train_loss': 0.5}, 2)\n"
        "logger.close('FINISHED')\n"
        "print(logger.run_id, sorted(m for m in sys.modules if m == 'mlflow' or m.startswith('mlflow.')))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-2000:]
    run_id, modules = out.stdout.split(" ", 1)
    assert modules.strip() == "[]"
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run_id, "train_loss")] == [0.5]
