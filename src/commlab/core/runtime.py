"""Process runtime: read torchrun's environment, pick the backend, seed, and build groups.

Every worker calls :func:`init_runtime` once. It works in three situations:

* under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, ... set): joins the process group;
* alone (no torchrun variables): becomes a world of one, still with a real process group so that
  every code path (the Communicator, the algorithms) runs unchanged;
* in processes spawned on one machine (:mod:`commlab.launch.ranks`), which set the variables;
* restarted by torchrun (``max_restarts``): keys of the new group never meet the old one's.

The backend is NCCL when CUDA is available and gloo otherwise, unless the config overrides it.
A collective timeout is always set so that a dead peer fails the job with an error instead of
hanging it forever (torch's default is 30 minutes for gloo, 10 for NCCL).
"""

from __future__ import annotations

import datetime as _dt
import os
import random
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Runtime:
    """What a worker knows about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    restart: int = 0  # how many times torchrun has restarted the workers (max_restarts)

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, writes sentinels and prints progress."""
        return self.rank == 0


def choose_backend(requested: str = "auto") -> str:
    """Return the backend to use: ``nccl`` with CUDA, ``gloo`` otherwise, unless requested."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, and no CUDA device is available here; use 'gloo'")
    return requested


def free_port() -> int:
    """A TCP port that is free on this machine right now (for single-process worlds and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_runtime(backend: str = "auto", timeout_s: float = 120.0) -> Runtime:
    """Join (or create) the process group described by torchrun's environment variables."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if "RANK" not in os.environ:
        # Alone: a world of one on a private port, so collectives still run for real.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    chosen = choose_backend(backend)
    if chosen == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = _dt.timedelta(seconds=timeout_s)
        dist.init_process_group(chosen, store=_attempt_store(rank, world_size, timeout, restart), rank=rank,
                                world_size=world_size, timeout=timeout)
    return Runtime(rank, world_size, local_rank, chosen, device, restart)


def _attempt_store(rank: int, world_size: int, timeout: _dt.timedelta, restart: int) -> dist.Store:
    """The env:// store init_process_group would make, its keys scoped to torchrun's restart count.

    torchrun restarts workers (``max_restarts``) on the same agent store: without a scope the
    restarted ranks read the dead ranks' gloo addresses, still under the same keys, and the new
    group fails to connect ("connectFullMesh failed ... Connection refused")."""
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"commlab/attempt_{restart}", store)


def shutdown_runtime() -> None:
    """Leave the process group (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed Python, NumPy and torch. Every rank gets the same seed for model initialisation;
    per-rank randomness (data order, stochastic rounding) derives its own generators from
    ``(seed, rank)`` explicitly, so results never depend on the order of calls across ranks."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    # CPU kernels are deterministic for a fixed thread count; on GPUs ask cuDNN for deterministic
    # kernels. (torch.use_deterministic_algorithms would cost ~2 s of imports per worker.)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def rank_generator(seed: int, rank: int, stream: int = 0) -> torch.Generator:
    """A torch generator private to one rank and one purpose (``stream``)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + rank * 7919 + stream * 104_729) % 2**63)
    return g


def node_groups(group_size: int, world_size: int) -> tuple[dist.ProcessGroup | None, int]:
    """Split the world into consecutive groups of ``group_size`` ranks (one per node by default).

    Returns this rank's group and its index. Every rank must call this (new_group is collective).
    """
    if group_size < 1 or world_size % group_size:
        raise ValueError(
            f"group size must divide the world size: group_size={group_size}, world_size={world_size}"
        )
    rank = dist.get_rank()
    mine, index = None, rank // group_size
    for start in range(0, world_size, group_size):
        group = dist.new_group(list(range(start, start + group_size)))
        if start // group_size == index:
            mine = group
    return mine, index
