"""Parallel jobs against one MLflow store and one machine (docs/cluster.md, section 5).

* A grid of 8 runs driven by `snakemake --cores 2` (a scratch copy of the workflow with a tiny
  grid on generated data): every run ends FINISHED in MLflow with its complete metric history,
  runs overlap in time (parallel torchrun jobs on free ports), and the store loses nothing.
* 8 processes hammering one SQLite store with small metric batches at once (the worst case of
  the 'database is locked' contention): every point of every run arrives.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _project_copy(tmp: Path) -> Path:
    proj = tmp / "proj"
    proj.mkdir()
    for name in ("Snakefile", "workflow", "config", "dvc.yaml", "params.yaml"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, proj / name)
    # 4 variants x 2 seeds = 8 runs of one worker each, a few steps on generated data.
    (proj / "config" / "papers" / "conc.yaml").write_text(yaml.safe_dump({
        "title": "concurrency check", "seeds": [0, 1],
        "runs": {f"ssgd_lr{i}": {"method": "ssgd", "train": {"lr": 0.01 * (i + 1)}} for i in range(4)},
    }))
    shutil.copy(proj / "workflow" / "notebooks" / "baseline.py", proj / "workflow" / "notebooks" / "conc.py")
    (proj / "conc_test.yaml").write_text(yaml.safe_dump({
        "scale": "laptop", "papers": ["conc"],
        "defaults": {"dataset": "synthetic", "model": "mlp", "workers": 1, "backend": "gloo", "timeout_s": 120,
                     "train": {"epochs": 1, "batch_size": 16, "lr": 0.05, "train_subset": 128,
                               "test_subset": 64, "log_every": 2}},
    }))
    return proj


def _most_train_jobs_at_once(log: str) -> int:
    """Peak number of `train` jobs running together, from Snakemake's start/finish lines."""
    running, peak, rule = set(), 0, None
    for line in log.splitlines():
        if started := re.match(r"\s*(?:local)?rule (\w+):\s*$", line):
            rule = started.group(1)
        elif (job := re.match(r"\s*jobid: (\d+)", line)) and rule == "train":
            running.add(job.group(1))
            peak, rule = max(peak, len(running)), None
        elif done := re.match(r"\s*Finished jobid: (\d+) \(Rule: train\)", line):
            running.discard(done.group(1))
    return peak


@pytest.mark.skipif(not (ROOT / "Snakefile").exists(), reason="no Snakefile")
def test_snakemake_grid_of_8_runs_loses_nothing(tmp_path):
    proj = _project_copy(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    out = subprocess.run([sys.executable, "-m", "snakemake", "train_conc", "--cores", "2", "--configfile",
                          "conc_test.yaml"], cwd=proj, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("conc").experiment_id])
    sentinels = sorted(proj.glob("results/laptop/conc/*/seed*/sentinel.json"))
    assert len(sentinels) == 8 and len(runs) == 8
    assert {json.loads(p.read_text())["run_id"] for p in sentinels} == {r.info.run_id for r in runs}
    for run in runs:
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "train_loss")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == [2, 4, 6, 8]  # 128 / 16 steps
        assert {"test_accuracy", "bytes_sent", "samples", "wall_seconds"} <= set(run.data.metrics)
        assert run.data.params["train.lr"] in {str(0.01 * (i + 1)) for i in range(4)}
    # Snakemake ran training jobs side by side (2 cores, one worker each): read from its own job
    # log, since MLflow run spans cover only the training loop and need not overlap on a slow
    # start-up even when the jobs do.
    assert _most_train_jobs_at_once(out.stdout + out.stderr) == 2
    logs = [p.read_text() for p in proj.glob("logs/train/laptop/conc/*/*.log")]
    assert len(logs) == 8 and not any("Traceback" in log for log in logs)


WRITER = """
import sys
from commlab.tracking import RunTracker
config = {"paper": "stress", "method": "ssgd", "seed": int(sys.argv[1]), "name": "w", "tracking": {}}
tracker = RunTracker(config, {"writer": sys.argv[1]})
for step in range(1, 41):
    tracker.log_metrics({"a": step, "b": -step, "c": step * 0.5}, step)
    tracker.flush()  # one write per step: as much lock contention as 8 writers can make
tracker.finish("FINISHED")
print(tracker.run_id)
"""


def test_eight_concurrent_writers_on_one_sqlite_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from commlab.tracking import ensure_experiments

    ensure_experiments(["stress"], uri)  # the workflow creates the store once, before the jobs
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(8)]
    run_ids = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-2000:]
        run_ids.append(stdout.strip().splitlines()[-1])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    assert len(set(run_ids)) == 8
    for run_id in run_ids:
        assert client.get_run(run_id).info.status == "FINISHED"
        for key, sign in (("a", 1), ("b", -1)):
            points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            assert points == [(s, float(sign * s)) for s in range(1, 41)], key
