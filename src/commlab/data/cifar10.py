"""CIFAR-10 (Krizhevsky 2009) for paper-scale runs: 50,000 + 10,000 32x32 colour images.

Sources: a folder given by the user holding ``cifar-10-batches-py`` (or the ``.tar.gz``), else
torchvision's download when a network exists.
"""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

import numpy as np
import torch

from commlab.data.base import DatasetSpec, write_prepared
from commlab.registry import DATASETS

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
HOW_TO_GET = (
    "Set `data.cifar10.source` in params.yaml to a folder holding cifar-10-batches-py (or "
    "cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html), or prepare on a "
    "machine with internet access."
)


def _batches_dir(folder: Path) -> Path | None:
    if (folder / "cifar-10-batches-py" / "data_batch_1").exists():
        return folder / "cifar-10-batches-py"
    if (folder / "data_batch_1").exists():
        return folder
    archive = folder / "cifar-10-python.tar.gz"
    if archive.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
        return folder / "cifar-10-batches-py"
    return None


def _read(files: list[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for f in files:
        with open(f, "rb") as fh:
            d = pickle.load(fh, encoding="latin1")
        xs.append(np.asarray(d["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(d["labels"], dtype=np.int64))
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def prepare(out_dir: Path, source: str | None = None, raw_dir: Path | None = None) -> dict:
    raw = raw_dir or out_dir.parent.parent / "raw" / "cifar10"
    folder = _batches_dir(Path(source)) if source else None
    if folder is None and source:
        raise FileNotFoundError(f"data source {source!r} holds no CIFAR-10 batches. {HOW_TO_GET}")
    if folder is None:
        try:
            from torchvision.datasets import CIFAR10

            CIFAR10(str(raw), train=True, download=True)
            folder = _batches_dir(raw)
        except Exception as err:  # noqa: BLE001 - any failure means: no source available
            raise FileNotFoundError(f"no CIFAR-10 source and the download failed ({err}). {HOW_TO_GET}") from None
    train = _read([folder / f"data_batch_{i}" for i in range(1, 6)])
    test = _read([folder / "test_batch"])
    return write_prepared(out_dir, SPEC, train, test, str(folder), CLASSES)


SPEC = DATASETS.register("cifar10")(DatasetSpec(
    name="cifar10", channels=3, image_size=32, num_classes=10,
    mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616), prepare=prepare, augment=True,
    how_to_get=HOW_TO_GET,
))
