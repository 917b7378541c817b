"""The warm launcher (commlab.launch.server): a served launch trains to the same numbers as a cold
one and logs the same MLflow run; without a server the launch runs itself; signals reach the
served job, a killed client stops it, and the server ends with the workflow that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from commlab.launch.client import SERVER_ENV

pytestmark = pytest.mark.slow


def _start_server(log: Path, parent: int | None = None) -> tuple[subprocess.Popen, str]:
    folder = tempfile.mkdtemp(prefix="commlab-launch-test-")
    path = f"{folder}/socket"
    cmd = [sys.executable, "-m", "commlab", "serve", "--socket", path]
    cmd += ["--parent", str(parent)] if parent else []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while "ready at" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc, path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, path = _start_server(log)
    yield path
    proc.terminate()
    assert proc.wait(timeout=60) == 0, log.read_text()
    assert not Path(path).exists()  # the socket and its folder go with the server


def _config(folder: Path, **train) -> Path:
    config = {"method": "ssgd", "dataset": "synthetic", "model": "mlp", "workers": 2, "seed": 3, "timeout_s": 60,
              "paper": "served", "output_dir": str(folder / "out"),
              "tracking": {"enabled": True, "uri": f"sqlite:///{folder / 'mlflow.db'}", "experiment": "served"},
              "train": {"epochs": 2, "batch_size": 16, "lr": 0.05, "train_subset": 256, "test_subset": 128,
                        "log_every": 4, **train}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    return folder / "run.yaml"


def _launch(config: Path, server: str | None, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV}
    if server:
        env[SERVER_ENV] = server
    log = open(config.parent / "launch.log", "w")  # noqa: SIM115 - closed when the process is waited for
    return subprocess.Popen([sys.executable, "-m", "commlab", "launch", "--config", str(config),
                             "--sentinel", str(config.parent / "sentinel.json")], env=env, stdout=log,
                            stderr=subprocess.STDOUT, **popen)


def _finish(proc: subprocess.Popen, folder: Path, timeout: float = 300) -> tuple[int, str]:
    rc = proc.wait(timeout=timeout)
    return rc, (folder / "launch.log").read_text()


def _training(folder: Path) -> bool:
    """Rank 0 has opened its MLflow run (its record is written just before the first step)."""
    from commlab.tracking import RUN_RECORD

    return (folder / "out" / RUN_RECORD).exists()


def _numbers(folder: Path) -> dict:
    final = json.loads((folder / "sentinel.json").read_text())["final"]
    return {k: v for k, v in final.items() if not k.endswith("seconds")}


def test_a_served_launch_trains_and_logs_as_a_cold_one(tmp_path, server):
    from commlab.tracking import client

    cold, served = tmp_path / "cold", tmp_path / "served"
    for folder, address in ((cold, None), (served, server)):
        rc, log = _finish(_launch(_config(folder), address), folder)
        assert rc == 0, log
    assert "train_loss" in _numbers(cold) and "test_accuracy" in _numbers(cold)
    assert _numbers(served) == _numbers(cold)  # bit for bit: same seed, same world, workers forked warm
    timelines = {f.name: json.loads((f / "out" / "timeline.json").read_text()) for f in (cold, served)}
    assert timelines["served"]["served"] and not timelines["cold"]["served"]
    assert timelines["served"]["seconds"]["steps"] > 0
    runs = {}
    for folder in (cold, served):
        store = client(f"sqlite:///{folder / 'mlflow.db'}")
        (run,) = store.search_runs([store.get_experiment_by_name("served").experiment_id])
        runs[folder.name] = run
    assert runs["served"].info.status == runs["cold"].info.status == "FINISHED"
    def params(run) -> dict:  # the folders differ, and so the store's address
        return {k: v for k, v in run.data.params.items() if k not in ("output_dir", "tracking.uri")}

    assert params(runs["served"]) == params(runs["cold"])
    assert set(runs["served"].data.metrics) == set(runs["cold"].data.metrics)
    assert runs["served"].data.metrics["train_loss"] == runs["cold"].data.metrics["train_loss"]


def test_without_an_answering_server_the_launch_runs_itself(tmp_path, monkeypatch, capsys):
    import socket

    from commlab.launch.client import served_launch

    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "no-such-socket"))  # none started: not a word
    assert served_launch(["--config", "run.yaml"], {"start": 0.0, "main": 0.0}) is None
    assert capsys.readouterr().err == ""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale"))  # a server's socket left behind: nobody listens there
    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "stale"))
    assert served_launch(["--config", "run.yaml"], {"start": 0.0, "main": 0.0}) is None
    assert "does not answer" in capsys.readouterr().err
    stale.close()
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # inside an allocation the server may be on another node
    assert served_launch(["--config", "run.yaml"], {"start": 0.0, "main": 0.0}) is None
    assert capsys.readouterr().err == ""


def test_a_served_job_stopped_by_sigterm_checkpoints_and_resumes(tmp_path, server):
    folder = tmp_path / "stopped"
    config = _config(folder, epochs=1, train_subset=1024)
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "testing": {"step_delay_s": 0.5}}))
    proc = _launch(config, server)
    latest = folder / "out" / "checkpoints" / "latest.json"
    log = folder / "launch.log"
    deadline = time.monotonic() + 120
    while not _training(folder):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # as Snakemake or SLURM stops a job: the client forwards it
    rc, text = _finish(proc, folder)
    assert rc == 143, text  # preempted: checkpointed, not finished
    assert json.loads(latest.read_text())["step"] > 0
    config.write_text(yaml.safe_dump(raw))  # the same run without the delay
    rc, text = _finish(_launch(config, server), folder)
    assert rc == 0 and "resuming from the checkpoint" in text, text
    assert json.loads((folder / "sentinel.json").read_text())["final"]["train_loss"] > 0


def test_a_killed_client_stops_its_served_job(tmp_path, server):
    folder = tmp_path / "orphan"
    config = _config(folder, epochs=1, train_subset=1024)  # 32 steps
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "testing": {"step_delay_s": 1.0}}))
    proc = _launch(config, server)
    log = folder / "launch.log"
    deadline = time.monotonic() + 120
    while not _training(folder):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    proc.kill()  # kill -9 of the job's client: nobody forwards anything
    proc.wait()
    latest = folder / "out" / "checkpoints" / "latest.json"
    deadline = time.monotonic() + 120
    while not latest.exists():  # the server stopped the job's launcher: the workers checkpointed
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    assert json.loads(latest.read_text())["step"] < 32
    assert not (folder / "sentinel.json").exists()


def test_the_server_ends_with_the_workflow_that_started_it(tmp_path):
    log, folder = tmp_path / "server.log", tmp_path / "sock"
    folder.mkdir(mode=0o700)
    # A stand-in for Snakemake: it starts the server as its child, naming itself as the parent.
    workflow = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-m', 'commlab', 'serve', '--socket', {str(folder / 'socket')!r}, "
        f"'--parent', str(os.getpid())], stdout=open({str(log)!r}, 'w'), stderr=subprocess.STDOUT); "
        "time.sleep(600)")])
    deadline = time.monotonic() + 180
    while "ready at" not in (log.read_text() if log.exists() else ""):
        assert workflow.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    workflow.kill()  # the workflow dies without stopping it (kill -9: no onerror hook runs)
    workflow.wait()
    deadline = time.monotonic() + 30
    while "has ended" not in log.read_text() or (folder / "socket").exists():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_serve_refuses_a_folder_others_can_enter(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "commlab", "serve", "--socket", str(folder / "socket")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "must be private" in out.stderr
