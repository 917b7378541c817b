"""Workers forked from the preloaded fork server (commlab.launch.preloaded, what the benchmarks
use) train to the same numbers as workers started as fresh interpreters, and fail the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from commlab.launch import run_on_loopback
from commlab.launch.preloaded import ForkedWorker, fork_workers
from commlab.launch.torchrun import train_argv

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, name: str, preloaded: bool, **extra) -> tuple[int, dict, str]:
    folder = tmp_path / name
    folder.mkdir()
    config = {"method": "topk_allgather", "dataset": "synthetic", "model": "mlp", "workers": 2, "seed": 3,
              "timeout_s": 60, "output_dir": str(folder / "out"), "tracking": {"enabled": False},
              "train": {"epochs": 1, "batch_size": 16, "lr": 0.05, "max_steps": 6, "log_every": 2,
                        "test_subset": 128, "checkpoint_every_epochs": 0}, **extra}
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    sentinel, log = folder / "sentinel.json", folder / "train.log"
    rc = run_on_loopback(train_argv(str(folder / "run.yaml"), str(sentinel)), 2, log=str(log),
                         extra_env={"OMP_NUM_THREADS": "1"}, preloaded=preloaded)
    record = json.loads(sentinel.read_text()) if sentinel.exists() else {}
    return rc, record, log.read_text() if log.exists() else ""


def test_forked_workers_train_to_the_same_numbers_as_started_ones(tmp_path):
    rc_started, started, _ = _run(tmp_path, "started", preloaded=False)
    rc_forked, forked, log = _run(tmp_path, "forked", preloaded=True)
    assert rc_started == rc_forked == 0, log
    def numbers(final: dict) -> dict:
        return {k: v for k, v in final.items() if not k.endswith("seconds")}

    assert "train_loss" in started["final"] and "test_accuracy" in started["final"]
    assert numbers(forked["final"]) == numbers(started["final"])  # bit for bit: same seed, same world


def test_a_forked_runs_bad_input_ends_it_with_the_workers_message(tmp_path):
    rc, record, log = _run(tmp_path, "bad", preloaded=True, model="no_such_model")
    assert rc == 2 and not record
    assert "commlab train:" in log and "no_such_model" in log


def test_a_forked_workers_exit_reads_as_a_popen_would():
    (worker,) = fork_workers(["-m", "commlab.loop", "--config", "/nonexistent.yaml"], 1,
                             env=lambda rank: {"RANK": "0", "WORLD_SIZE": "1"}, log="/dev/null")
    assert isinstance(worker, ForkedWorker)
    assert worker.wait(60) == 2 == worker.poll()  # the missing config: the worker's exit status comes back
    (worker,) = fork_workers(["-m", "commlab.loop", "--config", "/nonexistent.yaml"], 1,
                             env=lambda rank: {"RANK": "0", "WORLD_SIZE": "1"}, log="/dev/null")
    worker.kill()
    assert worker.wait(60) in (-9, 2)  # killed (as Popen says it), unless it had already exited


def test_only_the_training_worker_is_forked():
    with pytest.raises(ValueError, match="commlab.loop"):
        fork_workers(["-c", "print(1)"], 1, env=lambda rank: {})


def test_commlab_launch_starts_the_workers_fork_server_before_it_imports_torch(tmp_path):
    """The launcher starts the fork server first, so that the server's imports overlap the
    launcher's own (torch in both): with torch imported by the command line first (the train
    options' module pulled it in once), every run's workers started about 2 s later."""
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"method": "ssgd", "workers": 2}))
    probe = ("import sys\n"
             "import commlab.launch.torchrun as torchrun\n"
             "def started():\n"
             "    print('torch imported:', 'torch' in sys.modules)\n"
             "    sys.exit(0)\n"
             "torchrun.start_worker_server = started\n"
             "from commlab.cli import main\n"
             "main(['launch', '--config', sys.argv[1]])\n")
    out = subprocess.run([sys.executable, "-c", probe, str(config)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "torch imported: False", out.stdout + out.stderr
