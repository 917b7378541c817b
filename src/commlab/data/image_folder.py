"""Folders of image files, streamed from disk: the ``image_folder`` kind, and ImageNet registered.

The layout is torchvision ImageFolder's, one sub-folder per class under ``train/`` and ``val/``
(ImageNet's validation images sorted into class folders, as pytorch/examples' imagenet/main.py
expects). Preparing one copies nothing: it writes, into ``<data_dir>/<name>/``, a manifest per
split (``train.tsv``, ``val.tsv``: relative path, label, size, modification time of every file)
and ``meta.json`` (where the files are, the classes, the counts, a SHA-256 hash of the
manifests). DVC versions those small files; the images stay where they are.

A run reads the manifest instead of listing a million files on every rank, and checks that the
folder is there; ``verify_data`` also compares every file's size and time with the manifest. The
files are decoded by DataLoader workers (:class:`TrainImages`, :class:`EvalImages`) into uint8
crops, normalised on the run's device (:mod:`commlab.loop.batches`). ``data_source`` in a run
config points a run at another copy with the same layout (a node-local stage of the data).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from commlab.data.augment import eval_image, train_image
from commlab.data.base import DatasetSpec
from commlab.data.checks import DamagedDataError, read_meta, source_folder
from commlab.registry import DATASETS

# torchvision.datasets.folder.IMG_EXTENSIONS, without importing torchvision to prepare.
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = {"train": "train", "test": "val"}  # our split -> ImageNet's folder
MANIFEST = {"train": "train.tsv", "test": "val.tsv"}


def scan(split_dir: Path, classes: list[str] | None = None) -> tuple[list[str], list[tuple[str, int, int, int]]]:
    """The classes (sorted sub-folders) and ``(path, label, size, mtime_ns)`` of every image, in
    torchvision ImageFolder's order (classes sorted, then the sorted walk of each)."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"{split_dir} is not a folder")
    found = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
    classes = classes if classes is not None else found
    if not classes:
        raise FileNotFoundError(f"{split_dir} has no class folders (expected {split_dir}/<class>/<image>)")
    if sorted(set(found) - set(classes)):
        raise ValueError(f"{split_dir} has class folders that train/ lacks: {sorted(set(found) - set(classes))[:5]}")
    root = split_dir.parent
    files = []
    for label, name in enumerate(classes):
        for dirpath, _, names in sorted(os.walk(split_dir / name, followlinks=True)):
            for fname in sorted(names):
                if fname.lower().endswith(EXTENSIONS):
                    st = os.stat(os.path.join(dirpath, fname))
                    files.append((os.path.relpath(os.path.join(dirpath, fname), root), label, st.st_size,
                                  st.st_mtime_ns))
    return classes, files


def manifest_hash(texts: list[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode())
    return h.hexdigest()


def prepare_folder(out_dir: Path, spec: DatasetSpec, source: str | None) -> dict:
    """Write the manifests and meta.json of the image folder ``source`` into ``out_dir``."""
    root = source_folder(spec, source, list(SPLITS.values()))
    classes, train = scan(root / SPLITS["train"])
    _, test = scan(root / SPLITS["test"], classes)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = []
    for split, rows in (("train", train), ("test", test)):
        if not rows:
            raise FileNotFoundError(f"{root / SPLITS[split]} holds no image files ({', '.join(EXTENSIONS)})")
        text = "".join(f"{p}\t{y}\t{size}\t{mtime}\n" for p, y, size, mtime in rows)
        (out_dir / MANIFEST[split]).write_text(text)
        texts.append(text)
    meta = {
        "name": spec.name, "kind": "image_folder", "source": str(root), "classes": classes,
        "train_shape": [len(train)], "test_shape": [len(test)],
        "train_per_class": np.bincount([y for _, y, _, _ in train], minlength=len(classes)).tolist(),
        "content_hash": manifest_hash(texts),
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


@dataclass
class FolderSplit:
    """One split's files (paths relative to ``root``, as a numpy bytes array: loader workers forked
    from the rank then share it instead of copying a million Python strings) and labels."""

    root: str
    paths: np.ndarray
    labels: torch.Tensor
    sizes: np.ndarray
    mtimes: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i].decode())


@dataclass
class FolderData:
    """A prepared image folder: its spec, meta.json and the two splits."""

    spec: DatasetSpec
    meta: dict
    train: FolderSplit
    test: FolderSplit

    @property
    def num_classes(self) -> int:
        return len(self.meta["classes"])


def _read_manifest(path: Path, root: str, hint: str) -> FolderSplit:
    try:
        rows = [line.split("\t") for line in path.read_text().splitlines()]
        paths = np.array([r[0].encode() for r in rows], dtype=np.bytes_)
        labels = torch.tensor([int(r[1]) for r in rows], dtype=torch.int64)
        sizes = np.array([int(r[2]) for r in rows], dtype=np.int64)
        mtimes = np.array([int(r[3]) for r in rows], dtype=np.int64)
    except (OSError, ValueError, IndexError) as err:
        raise DamagedDataError(f"{path} is damaged ({type(err).__name__}: {err}); {hint}") from None
    return FolderSplit(root, paths, labels, sizes, mtimes)


def load_folder(folder: Path, spec: DatasetSpec, hint: str, verify: bool = False,
                source: str | None = None) -> FolderData:
    """The prepared manifests of ``folder``; the images are looked for under ``source`` (default:
    the folder meta.json names). ``verify`` stats every file against the manifest."""
    meta = read_meta(folder / "meta.json", hint)
    root = source or meta.get("source", "")
    train = _read_manifest(folder / MANIFEST["train"], root, hint)
    test = _read_manifest(folder / MANIFEST["test"], root, hint)
    texts = [(folder / MANIFEST[s]).read_text() for s in ("train", "test")]
    if manifest_hash(texts) != meta["content_hash"]:
        raise DamagedDataError(f"the manifests in {folder} do not match meta.json's content hash; {hint}")
    first = train.path(0) if len(train) else root
    if not os.path.exists(first):
        raise FileNotFoundError(f"the images of {spec.name!r} are not at {root!r} ({first} is missing); "
                                f"mount them there, set `data_source` in the run config to their copy, or "
                                f"prepare again with `data.{spec.name}.source` in params.yaml. {spec.how_to_get}")
    if verify:
        for split in (train, test):
            for i in range(len(split)):
                path = split.path(i)
                st = os.stat(path) if os.path.exists(path) else None
                if st is None or st.st_size != split.sizes[i] or st.st_mtime_ns != split.mtimes[i]:
                    raise DamagedDataError(f"{path} differs from the manifest in {folder} "
                                           f"({'missing' if st is None else 'size or time changed'}); {hint}")
    return FolderData(spec, meta, train, test)


def _open_rgb(path: str):
    from PIL import Image

    with open(path, "rb") as f:  # torchvision's pil_loader: the file closed once decoded
        return Image.open(f).convert("RGB")


class TrainImages(torch.utils.data.Dataset):
    """Training samples keyed ``(epoch, index)``: the decoded file, RandomResizedCrop + flip with
    draws keyed by (seed, epoch, index), as uint8 C x size x size, and the label."""

    def __init__(self, split: FolderSplit, size: int, seed: int):
        self.split, self.size, self.seed = split, size, seed

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = key
        img = train_image(_open_rgb(self.split.path(i)), self.size, self.seed, epoch, i)
        return img, self.split.labels[i]


class EvalImages(torch.utils.data.Dataset):
    """Evaluation samples by index: resize + centre crop as uint8, and the label."""

    def __init__(self, split: FolderSplit, size: int, resize: int):
        self.split, self.size, self.resize = split, size, resize

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return eval_image(_open_rgb(self.split.path(i)), self.size, self.resize), self.split.labels[i]


def folder_dataset(name: str, num_classes: int, image_size: int, mean: tuple, std: tuple,
                   how_to_get: str) -> DatasetSpec:
    """Register an ``image_folder`` dataset under ``name``."""
    spec: DatasetSpec

    def prepare(out_dir: Path, source: str | None = None, raw_dir: Path | None = None) -> dict:
        return prepare_folder(out_dir, spec, source)

    spec = DatasetSpec(name=name, channels=3, image_size=image_size, num_classes=num_classes, mean=mean, std=std,
                       prepare=prepare, augment=True, how_to_get=how_to_get, kind="image_folder",
                       load=load_folder, files=("meta.json", MANIFEST["train"], MANIFEST["test"]))
    return DATASETS.register(name)(spec)


IMAGENET = folder_dataset(
    "imagenet", num_classes=1000, image_size=224, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
    how_to_get=("ImageNet-1k (ILSVRC 2012) cannot be downloaded here: set `data.imagenet.source` in params.yaml "
                "to a folder holding train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (the validation images sorted "
                "into class folders), then `dvc repro imagenet`."),
)
