"""The backend a node's workers use (docs/cluster.md, "GPUs"): ``auto`` is NCCL only with a GPU per
worker and says why it chose gloo otherwise; an NCCL run that cannot work stops before any worker
starts, naming the GPU and worker counts; emulated links run gloo."""

from __future__ import annotations

import pytest

from commlab.cli import main
from commlab.core.runtime import choose_backend, nccl_environment
from commlab.testing.jobs import write_config


@pytest.mark.parametrize("gpus", [0, 1])
def test_auto_with_four_workers_and_too_few_gpus_chooses_gloo_and_says_why(gpus):
    choice = choose_backend("auto", workers_per_node=4, gpus=gpus)
    assert (choice.backend, choice.device_type) == ("gloo", "cpu")
    expected = "no CUDA device is visible" if gpus == 0 else \
        "this node has 1 visible GPU(s) for 4 workers (NCCL needs one GPU per worker)"
    assert choice.note == f"backend auto -> gloo: {expected}"


def test_auto_with_a_gpu_per_worker_chooses_nccl_silently():
    assert choose_backend("auto", workers_per_node=4, gpus=4) == choose_backend("auto", 1, gpus=8)
    choice = choose_backend("auto", workers_per_node=4, gpus=4)
    assert (choice.backend, choice.device_type, choice.note) == ("nccl", "cuda", None)
    assert choose_backend("auto", 4, gpus=4, device="cpu").backend == "gloo"  # device: cpu keeps the CPU


def test_nccl_that_cannot_work_names_the_gpu_and_worker_counts():
    with pytest.raises(ValueError, match=r"one GPU per worker: this node has 1 visible GPU\(s\) and workers: 4"):
        choose_backend("nccl", workers_per_node=4, gpus=1)
    with pytest.raises(ValueError, match=r"this node has 0 visible GPU\(s\) and workers: 1"):
        choose_backend("nccl", workers_per_node=1, gpus=0)
    with pytest.raises(ValueError, match="device 'cuda' needs a CUDA device"):
        choose_backend("gloo", 1, gpus=0, device="cuda")
    with pytest.raises(ValueError, match="runs on GPUs only"):
        choose_backend("nccl", 1, gpus=1, device="cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend("mpi", 1, gpus=0)


def test_gloo_ranks_may_share_the_gpus():
    shared = choose_backend("gloo", 4, gpus=1, device="cuda")
    assert (shared.backend, shared.device_type, shared.note) == ("gloo", "cuda", None)
    auto = choose_backend("auto", 4, gpus=1, device="cuda")
    assert (auto.backend, auto.device_type) == ("gloo", "cuda") and "1 visible GPU(s) for 4 workers" in auto.note


def test_the_nccl_watchdog_follows_the_run_timeout():
    env = nccl_environment(300)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "360"


def _config(tmp_path, **extra):
    fragment = {"method": "ssgd", "workers": 4, "model": "mlp", "dataset": "synthetic", "backend": "nccl",
                "output_dir": str(tmp_path / "run"), "train": {"epochs": 1, "batch_size": 8, "lr": 0.05}}
    return write_config(tmp_path / "run.yaml", **{**fragment, **extra})


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 4, reason="needs fewer than 4 GPUs")
def test_launch_refuses_nccl_before_any_worker_starts(tmp_path, capsys):
    assert main(["launch", "--config", str(_config(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "commlab launch: backend 'nccl'" in err and "workers: 4" in err
    assert not (tmp_path / "run").exists()  # no worker ran


def test_emulated_links_refuse_nccl(tmp_path, capsys):
    assert main(["launch", "--config", str(_config(tmp_path)), "--network-mbit", "100"]) == 2
    err = capsys.readouterr().err
    assert "emulated networks run on gloo" in err and "P2P/SHM" in err
    assert not (tmp_path / "run").exists()
