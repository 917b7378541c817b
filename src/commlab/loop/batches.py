"""Image batches of one rank, on the run's device: resident tensors, or files streamed from disk.

Both sources give the same thing: for a step, this rank's slice of the global batch
(:func:`commlab.data.shard_indices`: the samples of a step do not depend on the world size),
augmented with draws keyed by (seed, epoch, sample) (:mod:`commlab.data.keyed`: the same on any
rank and in any loader worker, and after a resume), normalised on the device.

* :class:`ResidentImages` (the ``tensors`` kind: Fashion-MNIST, CIFAR-10): the uint8 dataset is
  moved to the device once; a batch is one gather, the CIFAR crop-and-flip as one more gather
  (:func:`commlab.data.augment.pad_crop_flip`), then normalisation. No loader process, no copy
  per step.
* :class:`StreamedImages` (the ``image_folder`` kind: ImageNet): DataLoader workers decode the
  files and crop them (RandomResizedCrop + flip; resize + centre crop to evaluate) into uint8
  tensors, in pinned memory, ``prefetch_factor`` batches ahead per worker; the rank copies them
  to the device without blocking and normalises there. The batch sampler is the rows of
  ``shard_indices`` from the step a run resumes at, so a resumed epoch continues with the very
  batches an uninterrupted one would read, whatever the number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator

import torch

from commlab.data import shard_indices
from commlab.data.augment import pad_crop_flip
from commlab.data.image_folder import EvalImages, FolderData, TrainImages

Batch = tuple[torch.Tensor, torch.Tensor]


def normaliser(mean: tuple, std: tuple, device: torch.device):
    """uint8 images -> float, standardised per channel (on the images' device)."""
    m = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=device).view(1, -1, 1, 1)
    return lambda x: (x.float().div_(255.0) - m) / s


def subset_rows(n: int, subset: int | None) -> torch.Tensor | None:
    """``subset`` of ``n`` samples spread evenly over them (None: all): class-sorted files then
    keep every class."""
    if not subset or subset >= n:
        return None
    return torch.arange(subset, dtype=torch.int64) * n // subset  # host-side: row numbers, indexed on the host


class ResidentImages:
    """A ``tensors`` dataset on the device, with ``train.train_subset`` / ``test_subset`` (the first N)."""

    def __init__(self, data, train: dict, seed: int, device: torch.device):
        self.spec, self.meta, self.seed, self.device = data.spec, data.meta, seed, device
        n_train, n_test = train.get("train_subset"), train.get("test_subset")
        self.train_x, self.train_y = data.train_x[:n_train].to(device), data.train_y[:n_train].to(device)
        self.test_x, self.test_y = data.test_x[:n_test].to(device), data.test_y[:n_test].to(device)
        self.n_test = len(self.test_y)
        self.num_classes = data.spec.num_classes
        self.normalise = normaliser(data.spec.mean, data.spec.std, device)

    @property
    def n_train(self) -> int:
        return len(self.train_y)

    def train_batches(self, rows: torch.Tensor, epoch: int) -> Iterator[Batch]:
        for row in rows:
            idx = row.to(self.device)
            x = self.train_x[idx]
            if self.spec.augment:
                x = pad_crop_flip(x, self.seed, epoch, idx)
            yield self.normalise(x), self.train_y[idx]

    def eval_batches(self, rank: int, world_size: int, batch: int) -> Iterator[Batch]:
        part = torch.arange(rank, len(self.test_y), world_size, device=self.device)
        x, y = self.test_x[part], self.test_y[part]
        for i in range(0, len(y), batch):
            yield self.normalise(x[i:i + batch]), y[i:i + batch]


def loader_workers(requested: int | None) -> int:
    """``loader.workers``, or (null) this rank's share of the cores it may run on, at most 8."""
    if requested is not None:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, min(8, cores // ranks - 1))


class StreamedImages:
    """An ``image_folder`` dataset read by DataLoader workers; ``task.image_size`` (default the
    dataset's) is the side of the training and evaluation crops, ``task.eval_resize`` (default
    image_size * 256 / 224) the short side evaluation images are resized to first."""

    def __init__(self, data: FolderData, config: dict, seed: int, device: torch.device):
        task, loader, train = config["task"], config["loader"], config["train"]
        self.spec, self.meta, self.seed, self.device = data.spec, data.meta, seed, device
        self.size = task.get("image_size") or data.spec.image_size
        self.resize = task.get("eval_resize") or round(self.size * 256 / 224)
        self.num_classes = data.num_classes
        self.train, self.test = data.train, data.test
        self.train_rows = subset_rows(len(self.train), train.get("train_subset"))
        self.test_rows = subset_rows(len(self.test), train.get("test_subset"))
        self.n_test = self.test_rows.numel() if self.test_rows is not None else len(self.test)
        self.workers = loader_workers(loader.get("workers"))
        pin = loader.get("pin_memory")
        self.pin = device.type == "cuda" if pin is None else bool(pin)
        self.prefetch = loader.get("prefetch_factor", 2)
        self.normalise = normaliser(data.spec.mean, data.spec.std, device)
        # Imported here, once: the workers forked for every epoch inherit it instead of each
        # importing torchvision (seconds) anew; likewise PIL's format plugins, which its first
        # Image.open would otherwise import in every new worker (no imports in a forked child).
        import torchvision.transforms.functional  # noqa: F401
        from PIL import Image

        Image.preinit()

    @property
    def n_train(self) -> int:
        return len(self.train) if self.train_rows is None else len(self.train_rows)

    def _loader(self, dataset, batches: list[list]) -> torch.utils.data.DataLoader:
        # Workers forked from the rank: they start at once, with the manifest and torchvision
        # already in memory (a fork server or spawn, the default where the rank itself was so
        # started, pickles the dataset and imports anew: seconds per epoch). They never touch CUDA.
        context = "fork" if self.workers and "fork" in multiprocessing.get_all_start_methods() else None
        return torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=self.workers,
                                           pin_memory=self.pin, prefetch_factor=self.prefetch if self.workers else None,
                                           multiprocessing_context=context)

    def _to_device(self, loader) -> Iterator[Batch]:
        for x, y in loader:
            yield self.normalise(x.to(self.device, non_blocking=True)), y.to(self.device, non_blocking=True)

    def train_batches(self, rows: torch.Tensor, epoch: int) -> Iterator[Batch]:
        if self.train_rows is not None:
            rows = self.train_rows[rows]
        batches = [[(epoch, i) for i in row] for row in rows.tolist()]
        yield from self._to_device(self._loader(TrainImages(self.train, self.size, self.seed), batches))

    def eval_batches(self, rank: int, world_size: int, batch: int) -> Iterator[Batch]:
        # host-side: file numbers for the loader workers
        part = torch.arange(rank, self.test_rows.numel() if self.test_rows is not None else len(self.test), world_size)
        if self.test_rows is not None:
            part = self.test_rows[part]
        batches = [part[i:i + batch].tolist() for i in range(0, len(part), batch)]
        yield from self._to_device(self._loader(EvalImages(self.test, self.size, self.resize), batches))


def image_rows(source, epoch: int, rank: int, world_size: int, batch_size: int, seed: int, start: int) -> torch.Tensor:
    """This rank's sample indices of ``epoch`` from step ``start`` on, one row per step."""
    return shard_indices(source.n_train, world_size, rank, batch_size, epoch, seed)[start:]
