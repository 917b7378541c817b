"""Cheap checks of a prepared dataset, run every time it is loaded.

A truncated ``train.pt`` otherwise surfaces as a zip-reader traceback from every rank, and a label
out of range as an ``IndexError`` deep inside the loss. These checks read nothing beyond what
loading reads anyway and cost well under a millisecond on the loaded tensors (one min/max per
label vector): the file can be read, ``x``/``y`` have the prepared format's dtypes and shapes, the
shapes agree with ``meta.json`` and the dataset's spec, every label names one of its classes.
Bit flips inside the images pass them; the content hash against ``meta.json`` catches those, and
stays behind the ``verify_data`` option because it hashes every byte.

Each failure is one :class:`DamagedDataError` naming the file, what is wrong and how to rebuild it.
Before preparing, :func:`source_folder` checks that a dataset read by path (an image folder, a
token corpus) names a folder holding what it needs, and says what is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

META_KEYS = ("train_shape", "test_shape", "content_hash")


class DamagedDataError(ValueError):
    """A prepared-data file that cannot be used as it is; the message names the file and the fix."""


def source_folder(spec, source: str | None, entries: list[str], kind: str = "dir") -> Path:
    """The resolved folder ``source`` of a dataset read by path, checked to hold ``entries``
    (folders, or files with ``kind="file"``); a clear error naming what is missing and how to get it."""
    if not source:
        raise FileNotFoundError(f"no folder given for {spec.name}. {spec.how_to_get}")
    root = Path(source).resolve()
    present = Path.is_dir if kind == "dir" else Path.is_file
    missing = [e + ("/" if kind == "dir" else "") for e in entries if not present(root / e)]
    if missing:
        raise FileNotFoundError(f"{root} lacks {', '.join(missing)}. {spec.how_to_get}")
    return root


def rebuild_hint(name: str, data_dir: str | Path) -> str:
    """How to make ``<data_dir>/<name>`` again: DVC's stage for the project's folder, else the CLI."""
    prepare = f"`python -m commlab data prepare {name} --out {data_dir}`"
    if Path(data_dir).resolve() == (Path.cwd() / "data" / "prepared").resolve():
        return f"rebuild it with `dvc repro -f {name}` or {prepare}"
    return f"rebuild it with {prepare}"


def read_meta(path: Path, hint: str) -> dict:
    """``meta.json``, which must be a JSON object with the shapes and the content hash."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedDataError(f"{path} is damaged (cannot be read: {err}); {hint}") from None
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise DamagedDataError(f"{path} is damaged (no {', '.join(missing)}); {hint}")
    return meta


def load_split(path: Path, spec, expected_shape, hint: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of one split file, checked against the spec and meta.json's ``expected_shape``."""
    try:
        data = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - zip, pickle or I/O errors: all mean an unreadable file
        # The first sentence: torch's zip reader appends a paragraph about checkpoints.
        reason = (str(err).splitlines() or [type(err).__name__])[0].split(". ")[0].rstrip(".")
        raise DamagedDataError(f"{path} is damaged (cannot be read: {reason}); {hint}") from None

    def damaged(what: str) -> DamagedDataError:
        return DamagedDataError(f"{path} is damaged ({what}); {hint}")

    if not isinstance(data, dict) or not all(isinstance(data.get(k), torch.Tensor) for k in ("x", "y")):
        raise damaged("not a dict of tensors 'x' and 'y'")
    x, y = data["x"], data["y"]
    image = (spec.channels, spec.image_size, spec.image_size)
    if x.dtype != torch.uint8 or x.dim() != 4 or tuple(x.shape[1:]) != image:
        raise damaged(f"x is {x.dtype} {list(x.shape)}, expected torch.uint8 [N, {', '.join(map(str, image))}]")
    if y.dtype != torch.int64 or y.dim() != 1 or len(y) != len(x):
        raise damaged(f"y is {y.dtype} {list(y.shape)}, expected torch.int64 [{len(x)}] (one label per image)")
    if list(x.shape) != list(expected_shape):
        raise damaged(f"x has shape {list(x.shape)} but meta.json says {list(expected_shape)}")
    if len(y):
        lo, hi = (v.item() for v in torch.aminmax(y))
        if lo < 0 or hi >= spec.num_classes:
            bad = y[(y < 0) | (y >= spec.num_classes)]
            raise damaged(f"{len(bad)} label(s) out of range, e.g. {bad[0].item()}; {spec.name} has "
                          f"{spec.num_classes} classes, labels 0..{spec.num_classes - 1}")
    return x, y
