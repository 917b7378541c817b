"""A worker that dies mid-run (docs/cluster.md, section 3): one of 4 ranks is SIGKILLed after epoch 1.

The job must fail by itself (torchrun's exit code 1, not a hang the test has to kill) within
the collective timeout plus torchrun's shutdown grace, its output must name the dead rank, and
the MLflow run must be FAILED, never left RUNNING: a surviving rank 0 marks it, and when rank 0
is the one that died rank 1 does. Launching the same config again resumes from the epoch-1
checkpoint and finishes the same MLflow run.
"""

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from commlab.testing.jobs import (
    checkpoint_step,
    reap,
    signal_job,
    start_job,
    wait_for,
    worker_pids,
    write_config,
)

pytestmark = pytest.mark.slow
TIMEOUT_S = 30  # collective timeout of the run (small: a dead peer must fail the job soon)
STEPS_PER_EPOCH = 16  # 512 samples / (4 workers x batch 8)


@pytest.fixture
def jobs():
    """Jobs a test starts; whatever is left when it ends (a failed assertion) is killed."""
    started = []
    yield started
    for job in started:
        signal_job(job, signal.SIGKILL)
        reap(job, timeout=10)


def _status(uri, run_id):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).get_run(run_id).info.status


def _faults_job(tmp_path, workers: int = 4, **extra):
    """A fresh MLflow store with the ``faults`` experiment and an ssgd run config of 16 steps per
    epoch (3 epochs, slowed down so that a signal lands mid-run); returns (config, out, log, uri)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from commlab.tracking import ensure_experiments

    ensure_experiments(["faults"], uri)
    out, log = tmp_path / "run", tmp_path / "job.log"
    cfg = write_config(
        tmp_path / "run.yaml", paper="faults", method="ssgd", seed=1, workers=workers, model="mlp",
        dataset="synthetic", backend="gloo", timeout_s=TIMEOUT_S, output_dir=str(out),
        testing={"step_delay_s": 0.1}, **extra,
        train={"epochs": 3, "batch_size": 8, "lr": 0.05, "train_subset": 128 * workers, "test_subset": 128,
               "log_every": 4})
    return cfg, out, log, uri


@pytest.mark.parametrize("victim", [2, 0])
def test_dead_worker_fails_the_job_naming_the_rank(tmp_path, victim, jobs):
    cfg, out, log, uri = _faults_job(tmp_path)
    scratch = tmp_path / "t"  # the launcher's temporary folder (short: the fork server's socket is in it)
    scratch.mkdir()
    env = {"MLFLOW_TRACKING_URI": uri, "TMPDIR": str(scratch)}
    job = start_job(["launch", "--config", str(cfg)], log, env=env)
    jobs.append(job)
    wait_for(lambda: checkpoint_step(out) == STEPS_PER_EPOCH, job=job, timeout=300)
    pids = worker_pids(job)
    assert sorted(pids) == [0, 1, 2, 3]
    # forked by the launcher's preloaded fork server, not started as fresh interpreters
    parents = {Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] for pid in pids.values()}
    assert len(parents) == 1
    assert "multiprocessing.forkserver" in Path(f"/proc/{parents.pop()}/cmdline").read_text()
    # SIGUSR1 makes a rank print its threads' stacks into the job's log; it goes on training (the
    # root cause below is the victim's death, not this rank's).
    os.kill(pids[(victim + 1) % 4], signal.SIGUSR1)
    wait_for(lambda: "most recent call first" in log.read_text(), job=job, timeout=30)
    assert re.search(r'File ".*commlab/loop/\w+\.py", line \d+ in ', log.read_text())
    os.kill(pids[victim], signal.SIGKILL)
    # torchrun stops the survivors (they fail at their next collective, at the latest after
    # TIMEOUT_S) and exits 1; a hang would end in reap's SIGKILL instead (exit 137).
    rc = reap(job, timeout=TIMEOUT_S + 30 + 120)
    text = log.read_text()
    assert rc == 1, text[-3000:]
    root_cause = text[text.index("Root Cause"):]
    assert re.search(rf"rank\s*:\s*{victim} \(local_rank: {victim}\)", root_cause), root_cause
    assert "SIGKILL" in root_cause
    run_id = torch.load(out / "checkpoints" / f"step_{STEPS_PER_EPOCH}" / "rank0.pt",
                        weights_only=False)["progress"]["run_id"]
    assert _status(uri, run_id) == "FAILED"
    assert checkpoint_step(out) == STEPS_PER_EPOCH  # the last complete checkpoint is intact
    assert not list(scratch.glob("*torchelastic*"))  # the agent's folder of error files went with the launch

    if victim == 0:  # the re-launch resumes from epoch 1 and completes the same run
        job = start_job(["launch", "--config", str(cfg)], log, env=env)
        jobs.append(job)
        assert reap(job, timeout=300) == 0, log.read_text()[-3000:]
        assert checkpoint_step(out) == 3 * STEPS_PER_EPOCH
        assert _status(uri, run_id) == "FINISHED"
        assert not list(scratch.glob("*torchelastic*"))


def test_max_restarts_restarts_dead_workers_from_the_checkpoint(tmp_path, jobs):
    """With max_restarts: 1 torchrun restarts the workers after rank 1 dies; they resume from the
    last checkpoint on a fresh process group and finish the same MLflow run."""
    cfg, out, log, uri = _faults_job(tmp_path, max_restarts=1)
    job = start_job(["launch", "--config", str(cfg)], log,
                    env={"MLFLOW_TRACKING_URI": uri})
    jobs.append(job)
    wait_for(lambda: checkpoint_step(out) == STEPS_PER_EPOCH, job=job, timeout=300)
    run_id = torch.load(out / "checkpoints" / f"step_{STEPS_PER_EPOCH}" / "rank0.pt",
                        weights_only=False)["progress"]["run_id"]
    os.kill(worker_pids(job)[1], signal.SIGKILL)
    assert reap(job, timeout=TIMEOUT_S + 300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"resuming from the checkpoint at step {STEPS_PER_EPOCH} (epoch 1), torchrun restart 1" in text, \
        text[-3000:]
    assert checkpoint_step(out) == 3 * STEPS_PER_EPOCH
    state = torch.load(out / "checkpoints" / f"step_{3 * STEPS_PER_EPOCH}" / "rank0.pt", weights_only=False)
    assert state["progress"]["run_id"] == run_id  # the restarted workers continued the same run
    assert _status(uri, run_id) == "FINISHED"


def test_aborted_workers_leave_the_run_failed_naming_the_rank(tmp_path, jobs):
    """Every worker dies of SIGABRT at once, as NCCL's watchdog aborts each rank on a collective
    timeout: no worker can mark the MLflow run, so the launcher that survives them does, FAILED
    with the failing rank and the signal named."""
    from commlab.tracking import RUN_RECORD, client

    cfg, out, log, uri = _faults_job(tmp_path, workers=2)
    job = start_job(["launch", "--config", str(cfg)], log, env={"MLFLOW_TRACKING_URI": uri})
    jobs.append(job)
    wait_for(lambda: checkpoint_step(out) == STEPS_PER_EPOCH, job=job, timeout=300)
    run_id = json.loads((out / RUN_RECORD).read_text())["run_id"]
    pids = worker_pids(job)
    for pid in pids.values():
        os.kill(pid, signal.SIGABRT)
    rc = reap(job, timeout=TIMEOUT_S + 120)
    text = log.read_text()
    assert rc == 1, text[-3000:]
    run = client(uri).get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["failed_rank"] in ("0", "1")
    assert run.data.tags["failure"] == f"worker rank {run.data.tags['failed_rank']} died with SIGABRT", run.data.tags
    assert f"MLflow run {run_id} marked FAILED: worker rank" in text
