"""Preemption and resume: a 2-worker job SIGKILLed after epoch 1, re-launched, SIGTERMed mid-epoch 3
and re-launched again ends with the parameters, MLflow metrics and sentinel of an uninterrupted
run, logged to one MLflow run with every step recorded once (docs/cluster.md, section 3;
docs/running.md, "Reproducibility").

Runs ssgd and two methods whose state a resumed run must restore and whose metrics a method logs
itself: Ok-Topk (residuals, thresholds, regions; metric windows of its own) and ADPSGD (the
rule's state; its decisions logged at their own steps, which a resumed run must not log twice).
Each is four launches of a real job (`commlab launch`: torchrun, gloo), each in its own process
group, signalled from outside as SLURM does. Every other method with state of its own is saved
and restored mid-run in one process per rank by tests/test_method_checkpoint.py, which is
cheaper and covers them all.
"""

import json
import signal

import pytest
import torch

from commlab.registry import ALGORITHMS
from commlab.testing.jobs import (
    checkpoint_step,
    is_timing,
    reap,
    run_history,
    signal_job,
    start_job,
    wait_for,
    write_config,
)
from commlab.testing.quick import quick_params

pytestmark = pytest.mark.slow

# Methods resumed through real jobs here: state of their own, and metrics they log themselves.
THROUGH_JOBS = ["oktopk", "adpsgd"]
STEPS_PER_EPOCH, EPOCHS = 16, 3  # 512 samples / (2 workers x batch 16)


def _log_every(method):
    """ssgd logs every 3 steps, which do not divide the epoch: the loop's loss window runs across
    the epoch-1 checkpoint. Methods report their own metric windows (algo_*), which they need not
    checkpoint: for them log points fall on epoch ends."""
    return 3 if method == "ssgd" else 4


def _config(path, out, method, **extra):
    return write_config(
        path, paper="resume", name=method, method=method, method_params=quick_params(method, 2), seed=3,
        workers=2, model="mlp", dataset="synthetic", backend="gloo", timeout_s=60, output_dir=str(out),
        train={"epochs": EPOCHS, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "train_subset": 512,
               "test_subset": 256, "log_every": _log_every(method)}, **extra,
    )


def _final_state(out, rank):
    step = checkpoint_step(out)
    return torch.load(out / "checkpoints" / f"step_{step}" / f"rank{rank}.pt", weights_only=False)


def _status(uri, run_id):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).get_run(run_id).info.status


@pytest.fixture
def jobs():
    """Jobs a test starts; whatever is left when it ends (a failed assertion) is killed."""
    started = []
    yield started
    for job in started:
        signal_job(job, signal.SIGKILL)
        reap(job, timeout=10)


def test_the_methods_resumed_through_jobs_declare_exact_state():
    for name in THROUGH_JOBS:
        resume = ALGORITHMS.get(name).resume
        assert resume is not None and resume.state and not resume.inexact, name


@pytest.mark.parametrize("method", ["ssgd", *THROUGH_JOBS])
def test_killed_and_preempted_run_resumes_exactly(tmp_path, method, jobs):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from commlab.tracking import ensure_experiments

    ensure_experiments(["resume"], uri)  # as the workflow does once, before parallel jobs
    env = {"MLFLOW_TRACKING_URI": uri}
    ref_out, out = tmp_path / "ref", tmp_path / "run"
    slow = {"testing": {"step_delay_s": 0.1}}  # about 1.6 s per epoch: room to signal mid-epoch
    ref_cfg, cfg = _config(tmp_path / "ref.yaml", ref_out, method), _config(tmp_path / "run.yaml", out, method, **slow)
    log = tmp_path / "job.log"

    # The uninterrupted reference runs alongside (the interrupted job mostly sleeps).
    ref = start_job(["launch", "--config", str(ref_cfg)], tmp_path / "ref.log", env=env)
    jobs.append(ref)

    # 1. SIGKILL of the whole job once epoch 1 is checkpointed: nothing can mark the run.
    job = start_job(["launch", "--config", str(cfg)], log, env=env)
    jobs.append(job)
    wait_for(lambda: checkpoint_step(out) == STEPS_PER_EPOCH, job=job, timeout=300)
    signal_job(job, signal.SIGKILL)
    reap(job)
    assert checkpoint_step(out) == STEPS_PER_EPOCH
    # What the killed launcher could not remove is in the test's folder (start_job's TMPDIR), not /tmp.
    assert list((tmp_path / "tmp").glob("commlab-torchelastic-*")), "the killed launcher's agent folder"
    run_id = _final_state(out, 0)["progress"]["run_id"]
    assert _status(uri, run_id) == "RUNNING"  # documented: the re-launch continues it

    # 2. Re-launched: resumes from epoch 1; SIGTERM once epoch 2 is checkpointed -> the workers
    #    checkpoint at their next control point, mid-epoch 3, and the job exits 143.
    job = start_job(["launch", "--config", str(cfg)], log, env=env)
    jobs.append(job)
    wait_for(lambda: checkpoint_step(out) == 2 * STEPS_PER_EPOCH, job=job, timeout=300)
    signal_job(job, signal.SIGTERM)
    assert reap(job) == 143, log.read_text()[-3000:]
    stopped = checkpoint_step(out)
    assert 2 * STEPS_PER_EPOCH < stopped < EPOCHS * STEPS_PER_EPOCH, stopped  # mid-epoch 3
    assert _final_state(out, 0)["progress"]["pos"] == stopped - 2 * STEPS_PER_EPOCH
    assert _status(uri, run_id) == "KILLED"

    # 3. Re-launched again: runs to the end, in the same MLflow run.
    job = start_job(["launch", "--config", str(cfg)], log, env=env)
    jobs.append(job)
    assert reap(job, timeout=300) == 0, log.read_text()[-3000:]
    assert reap(ref, timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    sentinel = json.loads((out / "sentinel.json").read_text())
    ref_sentinel = json.loads((ref_out / "sentinel.json").read_text())
    assert sentinel["run_id"] == run_id and _status(uri, run_id) == "FINISHED"

    # Same parameters, optimizer and algorithm state on every rank, bit for bit.
    for rank in range(2):
        ours, theirs = _final_state(out, rank), _final_state(ref_out, rank)
        assert ours["progress"]["step"] == theirs["progress"]["step"] == EPOCHS * STEPS_PER_EPOCH
        for key, value in theirs["model"].items():
            assert torch.equal(ours["model"][key], value), key
        for a, b in zip(ours["optimizer"]["state"].values(), theirs["optimizer"]["state"].values(), strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b), "optimizer state"
        assert ours["stats"]["counters"]["bytes_sent"] == theirs["stats"]["counters"]["bytes_sent"]

    # Same metrics at the same steps, each step once (timings aside), and the same sentinel.
    hist, ref_hist = run_history(uri, run_id, is_timing), run_history(uri, ref_sentinel["run_id"], is_timing)
    assert set(hist) == set(ref_hist) and {"train_loss", "test_accuracy", "bytes_sent"} <= set(hist)
    for key, points in ref_hist.items():
        assert hist[key] == points, key
        steps = [s for s, _ in hist[key]]
        assert len(steps) == len(set(steps)), f"{key} recorded a step twice"
    assert len(hist["train_loss"]) == EPOCHS * STEPS_PER_EPOCH // _log_every(method)
    assert [s for s, _ in hist["test_accuracy"]] == [16, 32, 48]
    assert {k: v for k, v in sentinel["final"].items() if not is_timing(k)} == \
        {k: v for k, v in ref_sentinel["final"].items() if not is_timing(k)}


def _as_if_saved_on(path, location: str) -> None:
    """Rewrite a checkpoint file so that every tensor in it claims to come from ``location`` (a GPU
    checkpoint read on this CPU-only machine, or on a node whose GPU index differs)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    real = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: location
    try:
        torch.save(state, path)
    finally:
        torch.serialization.location_tag = real


def test_a_checkpoint_from_another_device_resumes_bit_exactly(tmp_path, jobs):
    """A world of one (SSD-SGD: a global replica, lazily created GLU state) killed after epoch 1; its
    checkpoint is made to claim it was written on cuda:1, and the re-launch on this CPU loads it
    with map_location into the run's live tensors and ends bit for bit like an uninterrupted run."""
    from commlab.testing.quick import quick_run_config

    method = "ssdsgd" if "ssdsgd" in ALGORITHMS else "ssgd"
    ref = quick_run_config(method, tmp_path / "ref")
    cfg = {**quick_run_config(method, tmp_path / "run"), "testing": {"step_delay_s": 0.1}}
    ref_job = start_job(["train", "--config", str(write_config(tmp_path / "ref.yaml", **ref))], tmp_path / "ref.log")
    jobs.append(ref_job)
    job = start_job(["train", "--config", str(write_config(tmp_path / "run.yaml", **cfg))], tmp_path / "run.log")
    jobs.append(job)
    out = tmp_path / "run"
    wait_for(lambda: checkpoint_step(out) == 16, job=job, timeout=300)
    signal_job(job, signal.SIGKILL)
    reap(job)
    saved = out / "checkpoints" / "step_16" / "rank0.pt"
    _as_if_saved_on(saved, "cuda:1")
    with pytest.raises(RuntimeError, match="CUDA"):  # what a load without map_location meets
        torch.load(saved, weights_only=False)

    job = start_job(["train", "--config", str(tmp_path / "run.yaml")], tmp_path / "run.log")
    jobs.append(job)
    assert reap(job, timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
    assert reap(ref_job, timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    assert "resuming from the checkpoint at step 16" in (tmp_path / "run.log").read_text()
    ours, theirs = _final_state(out, 0), _final_state(tmp_path / "ref", 0)
    assert ours["progress"]["step"] == theirs["progress"]["step"] == 32
    for key, value in theirs["model"].items():
        assert torch.equal(ours["model"][key], value), key
    for key, value in theirs["algorithm"].get("global_model", {}).items():
        assert torch.equal(ours["algorithm"]["global_model"][key], value), key
