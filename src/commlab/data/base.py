"""The prepared-data format, loading and per-rank sharding shared by every dataset.

Every dataset has a kind (how it is stored) and a task (what the loop does with it, docs/tasks.md):

* ``tensors`` (image classification): a folder with ``train.pt`` and ``test.pt`` (``{"x": uint8
  N x C x H x W, "y": int64 N}``) and ``meta.json`` (shapes, class names, SHA-256 content hash).
  Loading keeps everything in memory as tensors, on the run's device: these datasets are tens of
  megabytes, and augmenting them there in batches beats any loader process.
* ``image_folder`` (image classification, :mod:`commlab.data.image_folder`): a manifest of the
  image files in place, decoded by loader workers as the run streams them.
* ``text`` (language modelling, :mod:`commlab.data.text`): a word corpus as token ids.
* ``tokens`` (masked language modelling, :mod:`commlab.data.tokens`): token ids by path, or
  generated.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from commlab.data.checks import DamagedDataError, load_split, read_meta, rebuild_hint
from commlab.registry import DATASETS


@dataclass(frozen=True)
class DatasetSpec:
    """What a dataset is and how to prepare it. ``prepare(out_dir, source)`` writes the files."""

    name: str
    channels: int
    image_size: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    prepare: object = None  # callable(out_dir: Path, source: str | None) -> None
    generated: bool = False  # made on the fly (tests), nothing to prepare
    augment: bool = False  # random crop + flip during training (CIFAR)
    how_to_get: str = ""
    kind: str = "tensors"  # how it is stored: tensors, image_folder, text, tokens
    task: str = "image_classification"  # what the loop does with it (commlab.loop.tasks)
    # Kinds other than tensors: callable(folder: Path, spec, hint: str, verify: bool) -> the loaded data.
    load: object = None
    files: tuple[str, ...] = ("train.pt", "test.pt", "meta.json")  # what a prepared folder holds


@dataclass
class PreparedData:
    spec: DatasetSpec
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    meta: dict = field(default_factory=dict)


def content_hash(*tensors: torch.Tensor) -> str:
    """SHA-256 over the raw bytes of the tensors (shape and dtype included)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.contiguous()
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def write_prepared(out_dir: Path, spec: DatasetSpec, train: tuple, test: tuple, source: str,
                   classes: list[str]) -> dict:
    """Write the prepared format and return its metadata."""
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"x": train[0], "y": train[1]}, out_dir / "train.pt")
    torch.save({"x": test[0], "y": test[1]}, out_dir / "test.pt")
    meta = {
        "name": spec.name,
        "source": source,
        "train_shape": list(train[0].shape),
        "test_shape": list(test[0].shape),
        "classes": classes,
        "train_per_class": torch.bincount(train[1], minlength=spec.num_classes).tolist(),
        "content_hash": content_hash(train[0], train[1], test[0], test[1]),
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_dataset(name: str, data_dir: str | Path, seed: int = 0, verify: bool = False, source: str | None = None):
    """Load a prepared dataset (or generate a synthetic one). Errors say how to get missing data.

    Kinds that read their files in place (image folders, token corpora) look for them under
    ``source`` when it is given, else where they were prepared from.

    Every load runs the cheap checks of :mod:`commlab.data.checks` (readable files, dtypes,
    shapes, label range) and raises :class:`DamagedDataError` naming the file and the fix;
    ``verify`` also compares the content hash with meta.json (reads every byte once more)."""
    spec: DatasetSpec = DATASETS.get(name)
    if spec.generated:
        return spec.prepare()  # type: ignore[operator]  # same data for every run seed
    folder = Path(data_dir) / name
    missing = [f for f in spec.files if not (folder / f).exists()]
    if missing:
        raise FileNotFoundError(
            f"dataset {name!r} is not prepared: {', '.join(str(folder / f) for f in missing)} missing. "
            f"Prepare it with `python -m commlab data prepare {name}` (or `snakemake --cores 2 data`). "
            f"{spec.how_to_get}"
        )
    hint = rebuild_hint(name, data_dir)
    if spec.load is not None:
        return spec.load(folder, spec, hint, verify, source)  # type: ignore[operator]
    meta = read_meta(folder / "meta.json", hint)
    train = load_split(folder / "train.pt", spec, meta["train_shape"], hint)
    test = load_split(folder / "test.pt", spec, meta["test_shape"], hint)
    if verify:
        digest = content_hash(*train, *test)
        if digest != meta["content_hash"]:
            raise DamagedDataError(
                f"dataset {name!r} in {folder} is corrupted: content hash {digest[:12]} differs from "
                f"meta.json's {meta['content_hash'][:12]}; {hint}"
            )
    return PreparedData(spec, *train, *test, meta)


def shard_indices(n: int, world_size: int, rank: int, batch_size: int, epoch: int, seed: int,
                  shuffle: bool = True) -> torch.Tensor:
    """This rank's sample indices for one epoch, shaped ``(steps, batch_size)``.

    Step s uses the global batch ``perm[s*P*B : (s+1)*P*B]`` and rank r its r-th slice, so the
    samples seen per step do not depend on how they are split over ranks; the remainder that
    does not fill a global batch is dropped (every rank takes the same number of steps)."""
    if batch_size < 1:
        raise ValueError(f"train.batch_size must be at least 1, got {batch_size}")
    global_batch = world_size * batch_size
    steps = n // global_batch
    if steps == 0:
        raise ValueError(
            f"not enough training samples for one step: {n} samples < {world_size} workers x "
            f"batch {batch_size}; lower train.batch_size or workers, or raise train.train_subset"
        )
    if shuffle:
        g = torch.Generator().manual_seed(seed * 10_007 + epoch)
        perm = torch.randperm(n, generator=g)
    else:
        perm = torch.arange(n)
    perm = perm[: steps * global_batch].view(steps, world_size, batch_size)
    return perm[:, rank, :].contiguous()
