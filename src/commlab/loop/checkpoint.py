"""Checkpoints that survive a kill at any instant.

Every rank writes its own file (algorithm state such as residuals differs per rank) into
``<dir>/step_<N>/``; after a barrier rank 0 atomically replaces ``<dir>/latest.json``, which names
the complete step folder, and removes older ones. A kill before ``latest.json`` moves leaves the
previous checkpoint in force; a half-written file is never named by it. Files are fsync'ed
before they are renamed, so a node crash cannot leave ``latest.json`` naming data still in a page
cache. With several nodes, ``<dir>`` must be on a file system every node sees.

What goes into ``state`` is the loop's business (:meth:`commlab.loop.loop.Run.checkpoint`): model,
optimizer, algorithm state, communication counters, RNG states, data position, MLflow run id.

A checkpoint loads on the CPU (``map_location``) and the loop copies it into the live tensors of
the run (model, optimizer, algorithm state, each on the run's device): a GPU checkpoint resumes on
another GPU index or another device layout, and a CPU-only reader can open it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    _fsync(tmp)
    os.replace(tmp, path)


def save_checkpoint(folder: str | Path, step: int, rank: int, world_size: int, state: dict) -> None:
    """Collective: every rank saves ``state``; then ``latest.json`` points at this step."""
    folder = Path(folder)
    step_dir = folder / f"step_{step}"
    step_dir.mkdir(parents=True, exist_ok=True)
    _atomic_save(state, step_dir / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        tmp = folder / "latest.json.tmp"
        tmp.write_text(json.dumps({"step": step, "world_size": world_size, "dir": step_dir.name}))
        _fsync(tmp)
        os.replace(tmp, folder / "latest.json")
        for old in folder.glob("step_*"):
            if old != step_dir:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_checkpoint(folder: str | Path, rank: int, world_size: int, map_location="cpu") -> dict | None:
    """This rank's state from the latest complete checkpoint, or None when there is none; its
    tensors on ``map_location`` (the CPU: the loop copies them into the run's live tensors)."""
    folder = Path(folder)
    latest = folder / "latest.json"
    if not latest.exists():
        return None
    info = json.loads(latest.read_text())
    if info["world_size"] != world_size:
        raise ValueError(
            f"checkpoint in {folder} was written by {info['world_size']} workers but this run has "
            f"{world_size}; resume with the same number of workers or delete {folder}"
        )
    return torch.load(folder / info["dir"] / f"rank{rank}.pt", map_location=map_location, weights_only=False)
