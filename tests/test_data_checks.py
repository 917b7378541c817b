"""Damaged prepared data stops a run at load time with one message naming the file and the fix.

The cheap checks (commlab.data.checks) run on every load: a truncated train.pt, labels outside
the dataset's classes, wrong dtypes or shapes, and shapes that disagree with meta.json.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commlab.data import DamagedDataError, load_dataset
from commlab.data.base import write_prepared
from commlab.data.fashion_mnist import CLASSES, SPEC
from commlab.testing.jobs import write_config

N_TRAIN, N_TEST = 256, 64
AGENT_LOG = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/")


@pytest.fixture
def prepared(tmp_path) -> Path:
    """A small prepared Fashion-MNIST-format dataset (the real format, random pixels)."""
    g = torch.Generator().manual_seed(0)

    def make(n):
        return (torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g),
                torch.randint(0, 10, (n,), generator=g))

    folder = tmp_path / "data" / "prepared"
    write_prepared(folder / "fashion_mnist", SPEC, make(N_TRAIN), make(N_TEST), "test", CLASSES)
    return folder


def _damaged_message(data_dir: Path) -> str:
    with pytest.raises(DamagedDataError) as err:
        load_dataset("fashion_mnist", data_dir)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def _rewrite(path: Path, **tensors) -> None:
    data = torch.load(path, weights_only=True)
    data.update(tensors)
    torch.save(data, path)


def test_intact_data_loads(prepared):
    data = load_dataset("fashion_mnist", prepared, verify=True)
    assert data.train_x.shape == (N_TRAIN, 1, 28, 28) and data.test_y.shape == (N_TEST,)


def test_truncated_train_file(prepared):
    path = prepared / "fashion_mnist" / "train.pt"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    message = _damaged_message(prepared)
    assert message.startswith(f"{path} is damaged (cannot be read: ")
    assert f"`python -m commlab data prepare fashion_mnist --out {prepared}`" in message


def test_label_out_of_range(prepared):
    path = prepared / "fashion_mnist" / "train.pt"
    y = torch.load(path, weights_only=True)["y"]
    y[7] = 99
    _rewrite(path, y=y)
    message = _damaged_message(prepared)
    assert message.startswith(f"{path} is damaged (1 label(s) out of range, e.g. 99; fashion_mnist has 10 classes")
    assert "python -m commlab data prepare fashion_mnist" in message


@pytest.mark.parametrize("split, change, what", [
    ("test", {"y": -torch.ones(N_TEST, dtype=torch.int64)}, f"{N_TEST} label(s) out of range, e.g. -1"),
    ("train", {"x": torch.zeros(N_TRAIN, 1, 28, 28)}, "x is torch.float32 [256, 1, 28, 28], expected torch.uint8"),
    ("train", {"x": torch.zeros(N_TRAIN, 3, 32, 32, dtype=torch.uint8)},
     "x is torch.uint8 [256, 3, 32, 32], expected torch.uint8 [N, 1, 28, 28]"),
    ("train", {"y": torch.zeros(N_TRAIN - 1, dtype=torch.int64)}, "y is torch.int64 [255], expected torch.int64 [256]"),
    ("train", {"x": torch.zeros(N_TRAIN - 6, 1, 28, 28, dtype=torch.uint8),
               "y": torch.zeros(N_TRAIN - 6, dtype=torch.int64)},
     "x has shape [250, 1, 28, 28] but meta.json says [256, 1, 28, 28]"),
])
def test_wrong_format(prepared, split, change, what):
    path = prepared / "fashion_mnist" / f"{split}.pt"
    _rewrite(path, **change)
    assert _damaged_message(prepared).startswith(f"{path} is damaged ({what}")


def test_damaged_meta(prepared):
    path = prepared / "fashion_mnist" / "meta.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in meta.items() if k != "train_shape"}))
    assert _damaged_message(prepared).startswith(f"{path} is damaged (no train_shape)")
    path.write_text("{ not json")
    assert _damaged_message(prepared).startswith(f"{path} is damaged (cannot be read: ")


def test_hash_check_stays_behind_verify(prepared):
    path = prepared / "fashion_mnist" / "train.pt"
    x = torch.load(path, weights_only=True)["x"]
    x[0, 0, 0, 0] ^= 0xFF  # a changed pixel passes the cheap checks
    _rewrite(path, x=x)
    load_dataset("fashion_mnist", prepared)
    with pytest.raises(DamagedDataError, match="is corrupted: content hash"):
        load_dataset("fashion_mnist", prepared, verify=True)


def test_project_folder_names_the_dvc_stage(prepared, monkeypatch):
    """In the project's data/prepared (DVC's stage output) the fix names the DVC stage too."""
    monkeypatch.chdir(prepared.parent.parent)
    path = Path("data/prepared/fashion_mnist/train.pt")
    path.write_bytes(path.read_bytes()[:100])
    assert _damaged_message(Path("data/prepared")).endswith(
        "rebuild it with `dvc repro -f fashion_mnist` or "
        "`python -m commlab data prepare fashion_mnist --out data/prepared`")


@pytest.mark.slow
def test_launch_with_two_workers_says_it_once(prepared, tmp_path):
    """`commlab launch` with 2 workers on a truncated train.pt: it fails, and the reason is said
    once, on one line, without a traceback from each rank."""
    path = prepared / "fashion_mnist" / "train.pt"
    path.write_bytes(path.read_bytes()[:1000])
    config = write_config(tmp_path / "run.yaml", paper="damaged", method="ssgd", seed=0, workers=2, model="mlp",
                          dataset="fashion_mnist", data_dir=str(prepared), backend="gloo", timeout_s=60,
                          output_dir=str(tmp_path / "run"), tracking={"enabled": False},
                          train={"epochs": 1, "batch_size": 16})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "commlab", "launch", "--config", str(config)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # No traceback and no failure table from the elastic agent: the workers' line, then the launcher's.
    assert "Traceback" not in proc.stderr and "Root Cause" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith("[commlab launch] the run stopped before training (exit 2): see the "
                                         "message above"), proc.stderr[-3000:]
    workers = [line for line in proc.stderr.splitlines() if not AGENT_LOG.match(line)]
    lines = [line for line in workers if "is damaged" in line]
    assert lines == [f"commlab train: {path} is damaged (cannot be read: PytorchStreamReader failed reading zip "
                     f"archive: failed finding central directory); rebuild it with "
                     f"`python -m commlab data prepare fashion_mnist --out {prepared}`"], proc.stderr[-3000:]
