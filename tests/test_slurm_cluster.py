"""The SLURM profile on a real Slurm 22.05 (Debian's slurmctld, slurmd, slurmdbd, munge, MariaDB):
one controller and two compute nodes on this machine, each in its own network and UTS namespace
(commlab.testing.localslurm), an MLflow tracking server on the login side, Snakemake with
workflow/profiles/slurm submitting every training run with sbatch.

Checked: the smoke grid (baseline paper, synthetic data) completes with every run FINISHED in
MLflow; a `nodes: 2` run trains across both nodes (one torchrun per node, c10d rendezvous) to the
same losses and accuracies, to the last bit, as the one-node run with the same seed and world
size; `scontrol requeue` mid-run checkpoints (exit 143), SLURM runs the job again and it resumes the
same MLflow run without logging a step twice; a node killed mid-run fails the job (NODE_FAIL) and
the retry finishes the run on the other node. Needs root (namespaces) and apt-get (`make
test-packages` installs the packages); skipped, saying why, otherwise.
"""

from __future__ import annotations

import json
import time

import pytest

from commlab.testing.jobs import checkpoint_step, is_timing, run_history, wait_for
from slurm_cluster import MlflowServer, finish, mlflow_runs, project_copy, snakemake, start_cluster, stop_started

pytestmark = pytest.mark.slow

SYNTHETIC = {"dataset": "synthetic", "model": "mlp"}
# Two runs of one seed and world size 2: two workers on one node, one worker on each of two nodes.
DELAY = {"testing": {"step_delay_s": 0.3}}
SMOKE = {"seeds": [0], "scales": {"smoke": {"seeds": [0]}}}
GRID = {**SMOKE, "base": {"workers": 2, "train": {"epochs": 1, "train_subset": 1024, "test_subset": 500}},
        "runs": {"one_node": {"method": "ssgd"}, "two_nodes": {"method": "ssgd", "nodes": 2, "workers": 1}}}

def slow_grid(name: str) -> dict:
    """A run long enough to be interrupted: 4 x 16 steps, 0.3 s after each (DELAY), a checkpoint per epoch."""
    train = {"epochs": 4, "train_subset": 1024, "test_subset": 500, "log_every": 4}
    return {**SMOKE, "base": {"workers": 2, "train": train, **DELAY}, "runs": {name: {"method": "ssgd"}}}





@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield c
    stop_started()
    c.down()


@pytest.fixture(autouse=True)
def _no_snakemake_left():
    yield
    stop_started()  # a failed test leaves none behind


@pytest.fixture(scope="module")
def mlflow_uri(cluster, tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server.uri
    server.stop()


def _jobs(cluster, name: str | None = None) -> list[dict]:
    """The cluster's jobs (sacct, every attempt: -D), optionally only those of one Snakemake job name."""
    out = cluster.slurm("sacct", "-D", "-X", "-P", "-n", "-o", "JobID,JobName,State,NodeList,ExitCode,Comment%200")
    keys = ["id", "name", "state", "nodes", "exit", "comment"]
    rows = [dict(zip(keys, line.split("|"), strict=False)) for line in (out or "").splitlines()]
    return [r for r in rows if name is None or name in r["comment"]]


def _accounted(cluster, name: str | None = None, completed: int = 1, keep=lambda job: True) -> list[dict]:
    """:func:`_jobs` (those ``keep`` takes) once sacct holds ``completed`` finished attempts:
    slurmctld sends a job's end, and the comment its name is read from, to slurmdbd
    asynchronously, so under load sacct lags the job by seconds. After a minute, what it holds."""
    rows: list[dict] = []

    def settled() -> bool:
        rows[:] = [j for j in _jobs(cluster, name) if keep(j)]
        return sum(j["state"] == "COMPLETED" for j in rows) >= completed

    try:
        wait_for(settled, timeout=60, poll=1)
    except AssertionError:
        pass  # the caller's assertions show what sacct holds
    return rows


def _running(cluster, name: str) -> dict:
    """The running job of one Snakemake job (squeue: sacct stores the comment at the end)."""
    out = cluster.slurm("squeue", "-h", "-t", "RUNNING", "-o", "%i|%k|%N") or ""
    rows = [dict(zip(["id", "comment", "nodes"], line.split("|"), strict=False)) for line in out.splitlines()]
    match = [r for r in rows if name in r["comment"]]
    assert len(match) == 1, out
    return match[0]


def _steps_unique(uri: str, run_id: str) -> dict[str, list]:
    history = run_history(uri, run_id)
    for key, points in history.items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {steps}"
    return history


def test_smoke_grid_completes_on_slurm(cluster, mlflow_uri, tmp_path):
    proj = project_copy(tmp_path / "proj", papers=["baseline"], defaults=SYNTHETIC)
    t0 = time.monotonic()
    finish(snakemake(proj, cluster, mlflow_uri, "train_baseline"), proj)
    print(f"smoke grid (baseline) on SLURM: {time.monotonic() - t0:.0f} s")
    sentinels = [json.loads(p.read_text()) for p in sorted(proj.glob("results/**/sentinel.json"))]
    assert sorted(s["name"] for s in sentinels) == ["ddp", "ddp_bf16", "ssgd"]  # baseline smoke, seed 0
    runs = {r.info.run_id: r for r in mlflow_runs(mlflow_uri).values()}
    for s in sentinels:
        run = runs[s["run_id"]]
        assert run.info.status == "FINISHED"
        assert 0 < run.data.metrics["train_loss"] < 2.3  # below chance level's log(10)
    jobs = _accounted(cluster, completed=3, keep=lambda j: "rule_train" in j["comment"])
    assert len(jobs) == 3 and all(j["state"] == "COMPLETED" and j["nodes"] in ("c1", "c2") for j in jobs)


def test_two_nodes_train_like_one(cluster, mlflow_uri, tmp_path):
    proj = project_copy(tmp_path / "proj", GRID, papers=["slurmcheck"], defaults=SYNTHETIC)
    finish(snakemake(proj, cluster, mlflow_uri, "train_slurmcheck"), proj)
    runs = mlflow_runs(mlflow_uri)
    one, two = runs["one_node-seed0-smoke"], runs["two_nodes-seed0-smoke"]
    assert one.info.status == two.info.status == "FINISHED"
    # the two-node job held both nodes and its torchrun step ran one task on each
    two_nodes = [j for j in _accounted(cluster, "two_nodes") if j["state"] == "COMPLETED"]
    assert len(two_nodes) == 1 and two_nodes[0]["nodes"] == "c[1-2]"
    steps = cluster.slurm("sacct", "-j", two_nodes[0]["id"], "-P", "-n", "-o", "JobID,NodeList,NTasks")
    assert any(line.split("|")[1:] == ["c[1-2]", "2"] for line in steps.splitlines()), steps
    # each node's torchrun agent kept its folder of error files in the run's folder, one per node;
    # the one-node launch's agent folder was temporary
    (two_dir,), (one_dir,) = proj.glob("results/**/two_nodes/seed0"), proj.glob("results/**/one_node/seed0")
    agents = sorted(d.name for d in (two_dir / "torchelastic").iterdir())
    assert len(agents) == 2 and all(a.startswith(f"{two_nodes[0]['id']}_") for a in agents), agents
    assert not (one_dir / "torchelastic").exists()
    # same seed, same world size: every loss and accuracy the same to the last bit
    h1, h2 = run_history(mlflow_uri, one.info.run_id), run_history(mlflow_uri, two.info.run_id)
    keys = [k for k in h1 if ("loss" in k or "acc" in k) and not is_timing(k)]
    assert {"train_loss", "test_accuracy"} <= set(keys)
    for key in keys:
        assert h1[key] == h2[key], key


def test_requeued_job_resumes_the_same_run(cluster, mlflow_uri, tmp_path):
    proj = project_copy(tmp_path / "proj", slow_grid("requeued"), papers=["slurmcheck"], defaults=SYNTHETIC)
    smk = snakemake(proj, cluster, mlflow_uri, "train_slurmcheck")
    wait_for(lambda: any(p.exists() for p in proj.glob("results/**/checkpoints/latest.json")), timeout=300,
             job=smk, poll=0.5)  # mid-run: after the first epoch
    job = _running(cluster, "requeued")
    cluster.slurm("scontrol", "requeue", job["id"])
    # SIGTERM to every process of the job: the workers checkpoint and the launch exits 143, the
    # MLflow run is KILLED; SLURM queues the job again (same id), eligible two minutes later
    wait_for(lambda: "PENDING" in (cluster.slurm("squeue", "-h", "-j", job["id"], "-o", "%T") or ""),
             timeout=120, job=smk, poll=0.5)
    # The job is PENDING as soon as slurmctld takes the requeue, while its processes may still be
    # writing the stop checkpoint: rank 0 marks the run KILLED only after it.
    wait_for(lambda: mlflow_runs(mlflow_uri)["requeued-seed0-smoke"].info.status == "KILLED", timeout=60, job=smk,
             poll=0.5)
    train_log = "\n".join(p.read_text() for p in (proj / "logs" / "train").rglob("*.log"))
    assert "SIGTERM: the workers were stopped; exit 143" in train_log, train_log[-3000:]
    steps = [checkpoint_step(p.parents[1]) for p in proj.glob("results/**/checkpoints/latest.json")]
    assert steps[0] % 16 != 0, steps  # written on SIGTERM, mid-epoch (16 steps per epoch)
    cluster.slurm("scontrol", "update", f"JobId={job['id']}", "StartTime=now")  # skip the two minutes
    finish(smk, proj)
    attempts = _accounted(cluster, "requeued")
    assert [j["state"] for j in attempts] == ["REQUEUED", "COMPLETED"] and len({j["id"] for j in attempts}) == 1
    runs = [r for name, r in mlflow_runs(mlflow_uri).items() if name == "requeued-seed0-smoke"]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = _steps_unique(mlflow_uri, runs[0].info.run_id)
    assert [s for s, _ in history["train_loss"]][-1] == 64  # 4 epochs x 16 steps, every one logged once
    assert "resuming from the checkpoint" in "\n".join(p.read_text() for p in (proj / "logs").rglob("*.log"))


def test_killed_node_fails_the_job_and_the_requeued_job_finishes(cluster, mlflow_uri, tmp_path):
    proj = project_copy(tmp_path / "proj", slow_grid("node_killed"), papers=["slurmcheck"], defaults=SYNTHETIC)
    smk = snakemake(proj, cluster, mlflow_uri, "train_slurmcheck")
    try:
        wait_for(lambda: any(p.exists() for p in proj.glob("results/**/checkpoints/latest.json")), timeout=300,
                 job=smk, poll=0.5)  # after the first epoch's checkpoint
        job = _running(cluster, "node_killed")
        t0 = time.monotonic()
        assert cluster.kill_node(job["nodes"])  # slurmd, the job step, torchrun and its workers: SIGKILL
        # slurmctld declares the node DOWN after SlurmdTimeout, fails the job (NODE_FAIL) and
        # queues it again (--requeue); skip the two minutes a requeued job waits
        wait_for(lambda: "PENDING" in (cluster.slurm("squeue", "-h", "-j", job["id"], "-o", "%T") or ""),
                 timeout=120, job=smk, poll=0.5)
        print(f"node {job['nodes']} killed: job {job['id']} requeued {time.monotonic() - t0:.0f} s later")
        cluster.slurm("scontrol", "update", f"JobId={job['id']}", "StartTime=now")
        log = finish(smk, proj, timeout=400)
        print(f"requeued job finished {time.monotonic() - t0:.0f} s after the node was killed")
    finally:
        for node in cluster.node_names:
            if cluster.node_states().get(node) not in ("idle", "mix", "alloc"):
                cluster.start_node(node)
        cluster.wait_idle(120)
    attempts = _accounted(cluster, "node_killed")
    # what `sacct -D` tells: the attempt on the killed node failed with NODE_FAIL
    assert [(j["state"], j["nodes"]) for j in attempts][0] == ("NODE_FAIL", job["nodes"]), attempts
    assert attempts[-1]["state"] == "COMPLETED" and attempts[-1]["nodes"] != job["nodes"], attempts
    assert "NODE_FAIL" not in log or "Leaving it to SLURM to requeue the job" in log  # no second submission
    runs = [r for name, r in mlflow_runs(mlflow_uri).items() if name == "node_killed-seed0-smoke"]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = _steps_unique(mlflow_uri, runs[0].info.run_id)
    assert [s for s, _ in history["train_loss"]][-1] == 64
    assert "resuming from the checkpoint at step 16" in "\n".join(p.read_text() for p in (proj / "logs").rglob("*.log"))
