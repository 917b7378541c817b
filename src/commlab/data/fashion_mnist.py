"""Fashion-MNIST (Xiao et al. 2017): 60,000 + 10,000 28x28 grey images in 10 classes.

Sources, in order: a folder given by the user (``source``), Debian's ``dataset-fashion-mnist``
package (/usr/share/datasets/fashion-mnist), torchvision's download when a network exists.
Files are the original ``*-idx?-ubyte(.gz)`` files, read directly.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from commlab.data.base import DatasetSpec, write_prepared
from commlab.registry import DATASETS

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
           "Bag", "Ankle boot"]
FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
HOW_TO_GET = (
    "Get Fashion-MNIST with `sudo apt-get install dataset-fashion-mnist` (files in "
    f"{DEBIAN_DIR}), or set `data.fashion_mnist.source` in params.yaml to a folder holding the four "
    "*-ubyte(.gz) files, or prepare on a machine with internet access (torchvision downloads them)."
)


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into a numpy array."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[0:4], "big")
    ndim = magic & 0xFF
    if magic >> 8 != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (magic {magic:#x})")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        for candidate in (folder / name, folder / "FashionMNIST" / "raw" / name):
            if candidate.exists():
                return candidate
    return None


def locate_source(source: str | None, download_dir: Path) -> Path:
    """The first folder that holds all four files; downloads only as a last resort."""
    candidates = [Path(source)] if source else []
    candidates.append(DEBIAN_DIR)
    for folder in candidates:
        if all(_find(folder, stem) for stem in FILES.values()):
            return folder
    if source:
        raise FileNotFoundError(f"data source {source!r} does not hold the four Fashion-MNIST files "
                                f"({', '.join(FILES.values())}, optionally .gz). {HOW_TO_GET}")
    try:  # last resort: torchvision's download (needs a network)
        from torchvision.datasets import FashionMNIST

        FashionMNIST(str(download_dir), train=True, download=True)
        FashionMNIST(str(download_dir), train=False, download=True)
        return download_dir
    except Exception as err:  # noqa: BLE001 - any failure means: no source available
        raise FileNotFoundError(f"no Fashion-MNIST source found and the download failed ({err}). "
                                f"{HOW_TO_GET}") from None


def prepare(out_dir: Path, source: str | None = None, raw_dir: Path | None = None) -> dict:
    folder = locate_source(source, raw_dir or out_dir.parent.parent / "raw" / "fashion_mnist")
    arrays = {k: read_idx(_find(folder, stem)) for k, stem in FILES.items()}
    train_x = torch.from_numpy(arrays["train_x"].copy()).unsqueeze(1)
    test_x = torch.from_numpy(arrays["test_x"].copy()).unsqueeze(1)
    train_y = torch.from_numpy(arrays["train_y"].astype(np.int64))
    test_y = torch.from_numpy(arrays["test_y"].astype(np.int64))
    return write_prepared(out_dir, SPEC, (train_x, train_y), (test_x, test_y), str(folder), CLASSES)


SPEC = DATASETS.register("fashion_mnist")(DatasetSpec(
    name="fashion_mnist", channels=1, image_size=28, num_classes=10,
    mean=(0.2860,), std=(0.3530,), prepare=prepare, how_to_get=HOW_TO_GET,
))
