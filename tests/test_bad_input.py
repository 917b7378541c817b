"""Bad input fails early with one clear message naming what is wrong, and loses nothing already
recorded (docs/cluster.md, section 4: bad configs and a missing dataset fail with clear messages).

Config errors are caught by `commlab train` / `commlab launch` before any worker starts (exit 2).
Errors only a worker can see (more workers than samples, data missing or corrupted, a
checkpoint of another experiment) stop it before it creates an MLflow run or writes a file: a
finished run in the same output folder keeps its checkpoint, sentinel and MLflow run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commlab.cli import build_parser, main
from commlab.registry import ALGORITHMS
from commlab.testing.jobs import write_config

SPARSE = next((m for m in ("oktopk", "redsync", "gaussiank", "topk_allgather") if m in ALGORITHMS), None)


def _base(tmp_path, **extra):
    fragment = {"paper": "bad", "method": "ssgd", "seed": 0, "workers": 1, "model": "mlp", "dataset": "synthetic",
                "backend": "gloo", "timeout_s": 60, "output_dir": str(tmp_path / "run"),
                "train": {"epochs": 1, "batch_size": 32, "lr": 0.05, "train_subset": 256, "test_subset": 128,
                          "log_every": 4}}
    fragment.update(extra)
    return write_config(tmp_path / "run.yaml", **fragment)


def _fails(capsys, argv, *expected):
    """Run the CLI in-process: exit 2 and one message line holding every ``expected`` part."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for part in expected:
        assert part in err, err
    return err


# ---- config errors: before any worker ---------------------------------------------------------
def test_unknown_method(tmp_path, capsys):
    cfg = _base(tmp_path)
    _fails(capsys, ["train", "--config", str(cfg), "method=nosuch"],
           "config key method", "unknown method 'nosuch'", "ssgd")
    # `commlab launch` (what Snakemake runs) checks before starting torchrun.
    bad = _base(tmp_path, method="nosuch")
    _fails(capsys, ["launch", "--config", str(bad)], "commlab launch:", "unknown method 'nosuch'")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(SPARSE is None, reason="no sparse method registered")
def test_bad_density(tmp_path, capsys):
    cfg = _base(tmp_path, method=SPARSE)
    _fails(capsys, ["train", "--config", str(cfg), "method_params.density=2"],
           "method_params", "density must be in (0, 1], got 2")
    _fails(capsys, ["train", "--config", str(cfg), "method_params.density=0"], "density", "got 0")


@pytest.mark.skipif("kstep" not in ALGORITHMS, reason="kstep not registered")
def test_period_zero(tmp_path, capsys):
    cfg = _base(tmp_path, method="kstep")
    _fails(capsys, ["train", "--config", str(cfg), "method_params.period=0"], "method_params",
           "period must be >= 1, got 0")
    # the paper's name, an alias, is named as such
    _fails(capsys, ["train", "--config", str(cfg), "method_params.k=0"], "method_params",
           "period must be >= 1, got 0 (k is an alias of period)")


def test_bad_option_and_value(tmp_path, capsys):
    cfg = _base(tmp_path)
    _fails(capsys, ["train", "--config", str(cfg), "method_params.bucket_mb=-1"], "bucket_mb must be positive")
    _fails(capsys, ["train", "--config", str(cfg), "method_params.nosuch=1"], "unknown option(s) ['nosuch']")
    _fails(capsys, ["train", "--config", str(cfg), "train.lr=0"], "config key train.lr")
    _fails(capsys, ["train", "--config", str(cfg), "train.epochs=0"], "config key train.epochs")
    _fails(capsys, ["train", "--config", str(cfg), "trian.lr=0.1"], "trian")
    _fails(capsys, ["train", "--config", str(tmp_path / "nope.yaml")], "nope.yaml", "does not exist")


def test_bad_network_section(tmp_path, capsys):
    _fails(capsys, ["launch", "--config", str(_base(tmp_path, network={"bandwith_mbit": 100}))],
           "config key network", "'bandwith_mbit' was unexpected")
    cfg = _base(tmp_path)
    _fails(capsys, ["train", "--config", str(cfg), "network.bandwidth_mbit=-5"],
           "config key network.bandwidth_mbit", "-5")
    assert not (tmp_path / "run").exists()


def test_more_workers_than_samples_in_config(tmp_path, capsys):
    cfg = _base(tmp_path)
    _fails(capsys, ["train", "--config", str(cfg), "workers=16", "train.train_subset=256"],
           "train.train_subset", "256 samples cannot fill one step of 16 workers x batch 32")


def test_missing_data_source(tmp_path, capsys):
    nowhere = tmp_path / "nowhere"
    _fails(capsys, ["data", "prepare", "cifar10", "--source", str(nowhere), "--out", str(tmp_path / "prep")],
           "commlab data prepare:", str(nowhere), "holds no CIFAR-10 batches", "cifar-10-batches-py")
    assert not (tmp_path / "prep" / "cifar10").exists()


def test_unknown_benchmark_and_dataset_name_the_known_ones(tmp_path, capsys):
    _fails(capsys, ["bench", "nosuch"], "commlab bench:", "unknown benchmark 'nosuch'", "throughput")
    _fails(capsys, ["data", "prepare", "nosuch", "--out", str(tmp_path / "prep")],
           "commlab data prepare:", "unknown dataset 'nosuch'", "fashion_mnist")
    assert not (tmp_path / "prep").exists()


# ---- errors a worker sees: nothing recorded is lost ------------------------------------------
def _tiny_prepared(folder: Path) -> Path:
    """A small prepared Fashion-MNIST-format dataset (real format, random pixels)."""
    from commlab.data.base import write_prepared
    from commlab.data.fashion_mnist import CLASSES, SPEC

    g = torch.Generator().manual_seed(0)
    make = lambda n: (torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g),  # noqa: E731
                      torch.randint(0, 10, (n,), generator=g))
    write_prepared(folder / "fashion_mnist", SPEC, make(256), make(64), "test", CLASSES)
    return folder


def _train(cfg, uri, *overrides):
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.Popen([sys.executable, "-m", "commlab", "train", "--config", str(cfg), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
def test_worker_side_errors_keep_what_is_recorded(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _base(tmp_path)
    first = _train(cfg, uri)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    out = tmp_path / "run"
    sentinel = json.loads((out / "sentinel.json").read_text())
    before = _snapshot(out)

    data = _tiny_prepared(tmp_path / "prepared")
    corrupted = data / "fashion_mnist" / "train.pt"
    raw = bytearray(corrupted.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one byte inside the image tensor: the file still loads
    corrupted.write_bytes(bytes(raw))
    cases = {  # overrides -> what the message must say
        ("train.batch_size=5000", "train.train_subset=null"): [
            "4096 training samples of 'synthetic' cannot fill one step of 1 workers x batch 5000"],
        ("dataset=fashion_mnist", f"data_dir={tmp_path / 'empty'}"): [
            "dataset 'fashion_mnist' is not prepared", str(tmp_path / "empty" / "fashion_mnist" / "train.pt"),
            "python -m commlab data prepare fashion_mnist"],
        ("dataset=fashion_mnist", f"data_dir={data}", "verify_data=true"): [
            "dataset 'fashion_mnist'", "is corrupted: content hash", "differs from meta.json"],
        ("method=ddp",): ["belongs to another experiment", "method: checkpoint 'ssgd', config 'ddp'"],
    }
    procs = {key: _train(cfg, uri, *key) for key in cases}  # at once: each mostly imports torch
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (key, stderr[-2000:])
        lines = [line for line in stderr.splitlines() if line.startswith("commlab train:")]
        assert len(lines) == 1 and "Traceback" not in stderr, (key, stderr[-2000:])
        for part in cases[key]:
            assert part in lines[0], (key, lines[0])

    # Nothing recorded is lost or touched: the first run's files and its one MLflow run.
    assert _snapshot(out) == before
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("bad").experiment_id])
    assert [r.info.run_id for r in runs] == [sentinel["run_id"]]
    assert runs[0].info.status == "FINISHED" and runs[0].data.metrics["test_accuracy"] >= 0


# ---- the CLI documents every command ----------------------------------------------------------
def test_every_command_has_help(capsys):
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    assert {"list", "train", "launch", "data", "bench", "report", "grid", "mlflow-init"} <= set(commands)
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    top = capsys.readouterr().out
    for name in commands:
        assert name in top
        argv = ["data", "prepare", "--help"] if name == "data" else [name, "--help"]
        for args in ([name, "--help"], argv):
            with pytest.raises(SystemExit) as stop:
                main(args)
            assert stop.value.code == 0, args
            text = capsys.readouterr().out
            assert text.startswith(f"usage: commlab {name}") and len(text.splitlines()) >= 3, text


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback():
    """``commlab list | head -1``: the reader stops reading; the command ends quietly, exit 1. Here
    the reader has gone before the command writes at all, so its first write meets a closed pipe."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "commlab", "list"], stdout=write_end,
                              stderr=subprocess.PIPE, env=env, timeout=60)
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err and "BrokenPipeError" not in err, err
