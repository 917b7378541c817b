"""The same seed twice on CPU gives identical metrics (docs/running.md, "Reproducibility").

Two 2-worker `commlab launch` jobs of one config (only the output folder and golden file
differ) run at the same time: both succeed (each torchrun --standalone picks its own free
ports), and their golden loss curves, MLflow histories (timings aside), final parameters and
communication counters are identical.
"""

import json

import pytest
import torch

from commlab.testing.jobs import checkpoint_step, is_timing, reap, run_history, start_job, write_config

pytestmark = pytest.mark.slow


def test_same_seed_twice_gives_identical_metrics(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from commlab.tracking import ensure_experiments

    ensure_experiments(["determinism"], uri)
    jobs = {}
    for name in ("a", "b"):
        cfg = write_config(
            tmp_path / f"{name}.yaml", paper="determinism", name="ssgd", method="ssgd", seed=7, workers=2,
            model="mlp", dataset="synthetic", backend="gloo", timeout_s=120, output_dir=str(tmp_path / name),
            golden=str(tmp_path / f"{name}_golden.json"),
            train={"epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4,
                   "train_subset": 512, "test_subset": 256, "log_every": 2})
        jobs[name] = start_job(["launch", "--config", str(cfg)], tmp_path / f"{name}.log",
                               env={"MLFLOW_TRACKING_URI": uri})
    for name, job in jobs.items():
        assert reap(job, timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

    golden_a = json.loads((tmp_path / "a_golden.json").read_text())
    golden_b = json.loads((tmp_path / "b_golden.json").read_text())
    assert len(golden_a) == 16 and golden_a == golden_b  # 32 steps, a point every 2

    run_a = json.loads((tmp_path / "a" / "sentinel.json").read_text())["run_id"]
    run_b = json.loads((tmp_path / "b" / "sentinel.json").read_text())["run_id"]
    assert run_a != run_b
    hist_a, hist_b = run_history(uri, run_a, is_timing), run_history(uri, run_b, is_timing)
    assert {"train_loss", "test_loss", "test_accuracy", "bytes_sent", "samples"} <= set(hist_a)
    assert hist_a == hist_b

    for rank in range(2):
        a, b = (torch.load(tmp_path / n / "checkpoints" / f"step_{checkpoint_step(tmp_path / n)}" / f"rank{rank}.pt",
                           weights_only=False) for n in ("a", "b"))
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert a["stats"]["counters"]["bytes_sent"] == b["stats"]["counters"]["bytes_sent"] > 0
