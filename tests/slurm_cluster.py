"""Fixtures of the real-SLURM tests (tests/test_slurm_cluster.py): a local cluster
(:mod:`commlab.testing.localslurm`), an MLflow tracking server on the login side of its network, and
Snakemake with the SLURM profile run against both in a scratch copy of the workflow."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from commlab.testing.jobs import scratch_env
from commlab.testing.localslurm import HOST_ADDR, ClusterError, LocalCluster, missing_tools

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "workflow" / "profiles" / "slurm"
VENV_BIN = Path(sys.executable).parent


def ensure_packages() -> None:
    """Install the cluster's Debian packages through `make test-packages`, or skip saying why."""
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (network and UTS namespaces, daemons as root)")
    if not missing_tools():
        return
    if shutil.which("apt-get") is None or shutil.which("make") is None:
        pytest.skip(f"no apt-get/make to install {', '.join(missing_tools())}")
    out = subprocess.run(["make", "test-packages"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if missing := missing_tools():
        pytest.skip(f"`make test-packages` did not provide {', '.join(missing)}: {out.stderr[-500:]}")


def start_cluster(root: Path, nodes: int = 2) -> LocalCluster:
    ensure_packages()
    cluster = LocalCluster(root, nodes)
    try:
        return cluster.up()
    except ClusterError as err:
        pytest.fail(str(err))


class MlflowServer:
    """``mlflow server`` on the cluster's login address (jobs on every node reach it)."""

    def __init__(self, root: Path, timeout: float = 120):
        with socket.socket() as s:
            s.bind((HOST_ADDR, 0))
            port = s.getsockname()[1]
        self.uri = f"http://{HOST_ADDR}:{port}"
        self.log = root / "mlflow-server.log"
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
        with open(self.log, "wb") as out:
            # --allowed-hosts: MLflow answers 403 to any Host header but localhost's otherwise
            self.proc = subprocess.Popen(
                [str(VENV_BIN / "mlflow"), "server", "--host", HOST_ADDR, "--port", str(port),
                 "--allowed-hosts", f"{HOST_ADDR}:{port}", "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination",
                 str(root / "mlartifacts")], stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def project_copy(dest: Path, grid: dict | None = None, **config) -> Path:
    """The workflow in ``dest``; ``grid`` becomes paper ``slurmcheck`` (its report notebook is the
    baseline's); ``config`` is written to cluster.yaml, merged over config/smoke.yaml."""
    dest.mkdir(parents=True)
    for name in ("Snakefile", "workflow", "config", "dvc.yaml", "params.yaml"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / name)
    if grid:
        (dest / "config" / "papers" / "slurmcheck.yaml").write_text(yaml.safe_dump(grid))
        shutil.copy(dest / "workflow" / "notebooks" / "baseline.py", dest / "workflow" / "notebooks" / "slurmcheck.py")
    (dest / "cluster.yaml").write_text(yaml.safe_dump(config))
    return dest


STARTED: list[subprocess.Popen] = []  # Snakemake processes, killed by stop_started() after a failed test


def stop_started() -> None:
    """SIGKILL every Snakemake still running (on SIGTERM it waits for scancel of its jobs)."""
    for proc in STARTED:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    STARTED.clear()


def snakemake(proj: Path, cluster: LocalCluster, uri: str, *targets: str, retries: int = 0,
              env: dict | None = None) -> subprocess.Popen:
    """Start Snakemake with the SLURM profile in ``proj`` (output in proj/snakemake.log)."""
    # the jobs inherit TMPDIR (sbatch exports the environment): what a killed launcher cannot remove
    # stays in the project's folder, not in /tmp
    env = {**os.environ, **cluster.env, **scratch_env(proj.absolute()), "MLFLOW_TRACKING_URI": uri,
           "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
           "PATH": os.pathsep.join([str(VENV_BIN), os.environ["PATH"]]), **(env or {})}
    cmd = [str(VENV_BIN / "snakemake"), "--workflow-profile", str(PROFILE), "--configfile", "config/smoke.yaml",
           "cluster.yaml", "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks",
           "2", "--latency-wait", "5", "--retries", str(retries), *targets]
    with open(proj / "snakemake.log", "wb") as out:
        STARTED.append(subprocess.Popen(cmd, cwd=proj, env=env, stdout=out, stderr=subprocess.STDOUT))
    return STARTED[-1]


def finish(proc: subprocess.Popen, proj: Path, timeout: float = 600) -> str:
    """Wait for Snakemake (killing it after ``timeout``); its output, asserted successful."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log = (proj / "snakemake.log").read_text()
    train_logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted((proj / "logs").rglob("*.log")))
    assert proc.returncode == 0, f"snakemake exited {proc.returncode}\n{log[-6000:]}\n{train_logs}"
    return log


def mlflow_runs(uri: str) -> dict[str, object]:
    """run name -> MLflow run, over every experiment of the server."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return {r.info.run_name: r for r in client.search_runs(exps, max_results=1000)}
