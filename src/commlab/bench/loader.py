"""``commlab bench loader``: images/s of the streamed image-folder loader beside torchvision's
``ImageFolder`` + ``DataLoader`` (the pytorch/examples imagenet/main.py pipeline), same workers.

Both read the same folder in ImageNet's layout with the same number of worker processes, batch
size, prefetch and pinned memory, and the same training recipe (RandomResizedCrop to ``--size``
and a horizontal flip), and both end with a normalised float batch on the device:

* ``streamed``: commlab's loader (:class:`commlab.loop.batches.StreamedImages`): a manifest
  instead of a directory walk, keyed draws, uint8 crops from the workers, normalised on the device;
* ``torchvision``: ``ImageFolder(transform=RandomResizedCrop, RandomHorizontalFlip, ToTensor,
  Normalize)`` + ``DataLoader(shuffle=True)``, each batch copied to the device.

A repeat builds each loader afresh, skips ``--warmup`` batches (worker start-up, first reads) and
times ``--batches`` more; repeats alternate which loader goes first, so drift in the machine's load
hits both alike. The table shows the median images/s of each and ``ratio = streamed / torchvision``.

Without ``--folder`` it generates ``--images`` JPEGs (ImageNet's average size, about 500 x 375) in
a scratch folder first; with ``--folder DIR`` it reads DIR/train (ImageNet itself, say).

    commlab bench loader                                   # generated JPEGs, 2 workers
    commlab bench loader --folder /data/imagenet --workers 8 --batch 256 --batches 50
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from commlab.bench.common import add_output_arguments, md_table, write_report
from commlab.registry import BENCHMARKS


def generate_image_folder(root: Path, classes: int = 4, per_class: int = 6, val_per_class: int = 2,
                          sides: tuple[int, int] = (40, 90), seed: int = 0, quality: int = 90) -> Path:
    """A folder of JPEGs in ImageNet's layout (``train/<class>/*.JPEG``, ``val/<class>/*.JPEG``):
    smooth class-coloured images with noise, each side drawn from ``sides``. Returns ``root``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = rng.integers(40, 216, 3)
            for i in range(count):
                w, h = (int(v) for v in rng.integers(sides[0], sides[1] + 1, 2))
                ramp = np.linspace(-40, 40, w)[None, :, None] + np.linspace(-30, 30, h)[:, None, None]
                pixels = colour + ramp + rng.normal(0, 12, (h, w, 3))
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{split}_{c}_{i}.JPEG",
                                                                          quality=quality)
    return root


def _streamed(folder: Path, prepared: Path, args, device: torch.device):
    from commlab.data.base import shard_indices
    from commlab.data.image_folder import IMAGENET, load_folder, prepare_folder
    from commlab.loop.batches import StreamedImages

    if not (prepared / "meta.json").exists():
        prepare_folder(prepared, IMAGENET, str(folder))
    data = load_folder(prepared, IMAGENET, "", source=str(folder))
    config = {"task": {"image_size": args.size}, "loader": {"workers": args.workers, "prefetch_factor": 2,
                                                            "pin_memory": device.type == "cuda"}, "train": {}}
    source = StreamedImages(data, config, 0, device)

    def batches(repeat: int):
        rows = shard_indices(source.n_train, 1, 0, args.batch, repeat, 0)
        return source.train_batches(rows, repeat)

    return batches


def _torchvision(folder: Path, args, device: torch.device):
    from torchvision import datasets, transforms

    from commlab.data.image_folder import IMAGENET

    recipe = transforms.Compose([transforms.RandomResizedCrop(args.size), transforms.RandomHorizontalFlip(),
                                 transforms.ToTensor(), transforms.Normalize(IMAGENET.mean, IMAGENET.std)])
    dataset = datasets.ImageFolder(str(folder / "train"), recipe)

    def batches(repeat: int):
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                                             num_workers=args.workers, pin_memory=device.type == "cuda",
                                             prefetch_factor=2 if args.workers else None)
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    return batches


def _time(batches, warmup: int, count: int, device: torch.device) -> float:
    """Images per second over ``count`` batches after ``warmup``."""
    it = iter(batches)
    images = 0
    for _ in range(warmup):
        next(it)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(count):
        x, _ = next(it)
        images += len(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    it.close()  # the loader's workers stop
    return images / elapsed


@BENCHMARKS.register("loader")
def main(argv: list[str] | None = None, json_path: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commlab bench loader", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", help="an image folder in ImageNet's layout (default: generate one)")
    parser.add_argument("--images", type=int, default=1200, help="generated training images (default 1200)")
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes of both (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="images per batch (default 32)")
    parser.add_argument("--size", type=int, default=224, help="crop side (default 224)")
    parser.add_argument("--warmup", type=int, default=2, help="batches skipped per repeat (default 2)")
    parser.add_argument("--batches", type=int, default=12, help="batches timed per repeat (default 12)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each loader, alternating (default 3)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the reading process (default 1)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    torch.set_num_threads(args.threads)
    scratch = Path(tempfile.mkdtemp(prefix="commlab-loader-"))
    try:
        folder = Path(args.folder) if args.folder else generate_image_folder(
            scratch / "images", classes=10, per_class=max(1, args.images // 10), val_per_class=1, sides=(333, 500))
        need = (args.warmup + args.batches) * args.batch
        loaders = {"streamed": _streamed(folder, scratch / "prepared", args, device),
                   "torchvision": _torchvision(folder, args, device)}
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for r in range(args.repeats):
            for name in (list(loaders) if r % 2 == 0 else list(loaders)[::-1]):
                rates[name].append(_time(loaders[name](r), args.warmup, args.batches, device))
        rows = [{"loader": name, "images_per_s": statistics.median(v), "repeats": [round(x, 1) for x in v]}
                for name, v in rates.items()]
        ratio = rows[0]["images_per_s"] / rows[1]["images_per_s"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    md = (f"Images/s of a training epoch's batches ({args.batch} images, RandomResizedCrop {args.size} + flip, "
          f"{args.workers} workers, {'pinned, ' if device.type == 'cuda' else ''}normalised on {device}), median of "
          f"{args.repeats} alternating repeats of {args.batches} batches after {args.warmup}; "
          f"{'generated JPEGs' if not args.folder else args.folder} ({need} images read per repeat).\n\n"
          + md_table(rows, [("loader", "loader"), ("images_per_s", "images/s"), ("repeats", "each repeat")])
          + f"\n\nratio streamed / torchvision: **{ratio:.2f}**")
    payload = {"workers": args.workers, "batch": args.batch, "size": args.size, "device": str(device),
               "folder": args.folder or "generated", "results": rows, "ratio": ratio}
    write_report("loader", payload, md, args.json_path or json_path, args.out_dir)
    return 0
