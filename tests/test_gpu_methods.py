"""Every registered method on a GPU (marked ``gpu``: ``make test-gpu``; skipped without CUDA).

* a world of one on NCCL, the backend a one-GPU node gives a one-worker run: every method takes
  its main branch (sparse, compressed, delayed, averaging) for 32 steps, and a run stopped at its
  epoch-1 checkpoint and launched again ends with the same parameters and metrics, bit for bit,
  as the uninterrupted run (CUDA kernels chosen deterministically, reductions in a fixed order);
* four gloo ranks sharing the GPU with CUDA tensors (``device: cuda``): the methods' multi-rank
  code paths on CUDA (gloo has CUDA allreduce, broadcast, allgather and alltoall), ending with
  the replicas every method promises to keep equal bitwise equal on every rank.

NCCL with several ranks needs a GPU per rank, which one machine with one GPU does not have: the
test that needs it says so and skips.
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from commlab.registry import ALGORITHMS
from commlab.testing.jobs import checkpoint_step, reap, signal_job, start_job, wait_for, write_config
from commlab.testing.quick import quick_run_config

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")]
METHODS = ALGORITHMS.names()


def _train(cfg: dict, path, log, **overrides) -> dict:
    """One world-of-one worker (``commlab train``) on ``cfg``; the run's sentinel record."""
    config = write_config(path, **{**cfg, **overrides})
    job = start_job(["train", "--config", str(config)], log)
    assert reap(job, timeout=600) == 0, log.read_text()[-3000:]
    return json.loads((Path(cfg["output_dir"]) / "sentinel.json").read_text())


def _killed_after_epoch_one(cfg: dict, path, log) -> None:
    """Start ``cfg`` and SIGKILL it once its epoch-1 checkpoint is written (a node lost mid-run)."""
    config = write_config(path, **{**cfg, "testing": {"step_delay_s": 0.05}})
    job = start_job(["train", "--config", str(config)], log)
    wait_for(lambda: checkpoint_step(cfg["output_dir"]) == 16, job=job, timeout=300)
    signal_job(job, signal.SIGKILL)
    reap(job, timeout=60)


def _final_state(out_dir, rank: int = 0) -> dict:
    """A rank's last checkpoint (written when the run finished), read on the CPU."""
    folder = Path(out_dir) / "checkpoints"
    step = json.loads((folder / "latest.json").read_text())["dir"]
    return torch.load(folder / step / f"rank{rank}.pt", map_location="cpu", weights_only=False)


@pytest.mark.parametrize("method", METHODS)
def test_world_of_one_on_nccl_runs_and_resumes_bit_exactly(method, tmp_path):
    whole = quick_run_config(method, tmp_path / "whole", backend="nccl")
    done = _train(whole, tmp_path / "whole.yaml", tmp_path / "whole.log")
    split = quick_run_config(method, tmp_path / "split", backend="nccl")
    _killed_after_epoch_one(split, tmp_path / "first.yaml", tmp_path / "split.log")
    resumed = _train(split, tmp_path / "second.yaml", tmp_path / "split.log")
    assert "resuming from the checkpoint at step 16" in (tmp_path / "split.log").read_text()

    assert math.isfinite(done["final"]["train_loss"]) and math.isfinite(done["final"]["test_loss"])
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert resumed["final"][key] == done["final"][key], key
    a, b = _final_state(tmp_path / "whole"), _final_state(tmp_path / "split")
    assert a["progress"]["step"] == b["progress"]["step"] == 32
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    # a CUDA checkpoint read on the CPU (map_location) has every tensor there
    assert all(t.device.type == "cpu" for t in a["model"].values())


@pytest.mark.parametrize("method", METHODS)
def test_gloo_ranks_sharing_the_gpu_keep_their_replicas_equal(method, tmp_path):
    workers = 4
    cfg = quick_run_config(method, tmp_path / "run", workers=workers, backend="gloo", device="cuda")
    config = write_config(tmp_path / "run.yaml", **cfg)
    log = tmp_path / "job.log"
    job = start_job(["launch", "--config", str(config)], log)
    assert reap(job, timeout=600) == 0, log.read_text()[-3000:]
    record = json.loads((tmp_path / "run" / "sentinel.json").read_text())
    assert math.isfinite(record["final"]["test_loss"])
    key = ALGORITHMS.get(method).replica_key  # where the replicas the method keeps equal are saved
    replicas = [_nested(_final_state(tmp_path / "run", r), key) for r in range(workers)]
    for r in range(1, workers):
        for name, tensor in replicas[0].items():
            if tensor.dtype.is_floating_point and "running" not in name:  # parameters, not BN statistics
                assert torch.equal(tensor, replicas[r][name]), f"rank {r}: {key}.{name}"


def _nested(state: dict, key: str) -> dict:
    for part in key.split("."):
        state = state[part]
    return state


@pytest.mark.skipif(GPUS >= 2, reason="runs where there is a second GPU")
def test_multi_rank_nccl_needs_a_gpu_per_rank():
    pytest.skip(f"NCCL with several ranks needs one GPU per rank; this machine has {GPUS}: the methods' "
                "multi-rank NCCL paths (stream semantics of async collectives, NCCL all_to_all) need 2+ GPUs")


@pytest.mark.skipif(GPUS < 2, reason="NCCL with several ranks needs one GPU per rank (2+ GPUs)")
@pytest.mark.parametrize("method", ["ssgd", "oktopk", "redsync", "ssdsgd", "kstep_hier"])
def test_nccl_ranks_on_separate_gpus_keep_their_replicas_equal(method, tmp_path):
    workers = min(GPUS, 4)
    cfg = quick_run_config(method, tmp_path / "run", workers=workers, backend="nccl")
    job = start_job(["launch", "--config", str(write_config(tmp_path / "run.yaml", **cfg))], tmp_path / "job.log")
    assert reap(job, timeout=600) == 0, (tmp_path / "job.log").read_text()[-3000:]
