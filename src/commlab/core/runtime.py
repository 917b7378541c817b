"""Process runtime: read torchrun's environment, pick the backend, seed, and build groups.

Every worker calls :func:`init_runtime` once. It works in three situations:

* under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, ... set): joins the process group;
* alone (no torchrun variables): becomes a world of one, still with a real process group so that
  every code path (the Communicator, the algorithms) runs unchanged;
* in processes spawned on one machine (:mod:`commlab.launch.ranks`), which set the variables;
* restarted by torchrun (``max_restarts``): keys of the new group never meet the old one's.

Backend and device (:func:`choose_backend`): ``backend: auto`` is NCCL only when the node has at
least as many visible GPUs as workers (NCCL needs a GPU of its own per rank), gloo otherwise, with
one line saying why; an explicit ``nccl`` that cannot work is refused before any worker starts
(:func:`check_backend`, called by the launcher). ``device: auto`` puts tensors on the rank's GPU
under NCCL and on the CPU under gloo; ``device: cuda`` with gloo runs several gloo ranks on shared
GPUs (rank r on GPU r mod count), which is how a one-GPU machine exercises the methods' multi-rank
code with CUDA tensors (docs/cluster.md, "GPUs").

A collective timeout is always set so that a dead peer fails the job with an error instead of
hanging it forever (torch's default is 30 minutes for gloo, 10 for NCCL). Under NCCL the timeout
is enforced by the watchdog thread, which aborts the process: :func:`nccl_environment` makes that
abort prompt and bounded by the same ``timeout_s``, and the launcher that survives the workers
marks the MLflow run FAILED naming the rank (``commlab.launch``).
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
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Runtime:
    """What a worker knows about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    restart: int = 0  # how many times torchrun has restarted the workers (max_restarts)
    note: str | None = None  # why ``backend: auto`` chose what it chose, when that needs saying

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, writes sentinels and prints progress."""
        return self.rank == 0


@dataclass(frozen=True)
class BackendChoice:
    """The backend and device type a node's workers use, and the reason when ``auto`` fell back."""

    backend: str  # gloo | nccl
    device_type: str  # cpu | cuda
    note: str | None = None


def visible_gpus() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES applies). Asked of NVML first, so that the
    launcher can count before forking workers without initialising CUDA in itself."""
    return torch.cuda.device_count()


def choose_backend(requested: str = "auto", workers_per_node: int = 1, gpus: int | None = None,
                   device: str = "auto") -> BackendChoice:
    """The backend and device for ``workers_per_node`` workers on a node with ``gpus`` visible GPUs.

    ``auto`` is NCCL only when every worker can have a GPU of its own (NCCL refuses two ranks on
    one GPU), gloo otherwise, with a note saying why. An explicit ``nccl`` that cannot work raises
    ValueError naming the GPU and worker counts; so do ``device: cuda`` without a GPU and NCCL on
    the CPU."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    gpus = visible_gpus() if gpus is None else gpus
    if device == "cuda" and gpus == 0:
        raise ValueError("device 'cuda' needs a CUDA device, and none is visible here; use device: cpu (or auto)")
    enough = gpus >= workers_per_node
    note = None
    if requested == "auto":
        if gpus and enough and device != "cpu":
            backend = "nccl"
        else:
            backend = "gloo"
            if device == "cpu":
                why = "device: cpu"
            elif gpus == 0:
                why = "no CUDA device is visible"
            else:
                why = (f"this node has {gpus} visible GPU(s) for {workers_per_node} workers "
                       "(NCCL needs one GPU per worker)")
            note = f"backend auto -> gloo: {why}"
    else:
        backend = requested
    if backend == "nccl":
        if device == "cpu":
            raise ValueError("backend 'nccl' runs on GPUs only; use device: cuda (or auto), or backend: gloo")
        if not enough or not gpus:
            fewer = f", or at most {gpus} worker(s) per node" if gpus else ""
            raise ValueError(f"backend 'nccl' needs one GPU per worker: this node has {gpus} visible GPU(s) and "
                             f"workers: {workers_per_node}; use backend: gloo (or auto){fewer}")
        return BackendChoice("nccl", "cuda", note)
    return BackendChoice("gloo", "cuda" if device == "cuda" else "cpu", note)


def check_backend(config: dict) -> BackendChoice:
    """Validate a run config's ``backend``/``device`` against this node before any worker starts
    (the launcher's check); returns the choice every worker of this node will make."""
    return choose_backend(config.get("backend", "auto"), int(config.get("workers", 1)),
                          device=config.get("device", "auto"))


def nccl_environment(timeout_s: float) -> dict[str, str]:
    """NCCL's error handling tied to the run's collective timeout, as environment defaults.

    The watchdog enforces ``timeout_s`` on every NCCL collective and, with asynchronous error
    handling on, aborts the process when one fails or hangs (Python's ``except`` never runs: the
    surviving launcher records the failure). The heartbeat monitor, which kills a watchdog that
    is itself stuck, waits a little longer than the timeout. A value set by the user wins."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # abort the process on error, skip comm clean-up
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(timeout_s) + 60),
            "TORCH_NCCL_ENABLE_MONITORING": "1"}


def free_port() -> int:
    """A TCP port that is free on this machine right now (for single-process worlds and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_runtime(backend: str = "auto", timeout_s: float = 120.0, device: str = "auto") -> Runtime:
    """Join (or create) the process group described by torchrun's environment variables."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if "RANK" not in os.environ:
        # Alone: a world of one on a private port, so collectives still run for real.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    choice = choose_backend(backend, local_world, device=device)
    if choice.device_type == "cuda":
        # NCCL: one GPU per local rank (checked); gloo on GPUs: ranks share them round-robin.
        index = local_rank % visible_gpus()
        torch.cuda.set_device(index)
        where = torch.device("cuda", index)
    else:
        where = torch.device("cpu")
    if not dist.is_initialized():
        timeout = _dt.timedelta(seconds=timeout_s)
        extra = {}
        if choice.backend == "nccl":
            for key, value in nccl_environment(timeout_s).items():
                os.environ.setdefault(key, value)
            extra["device_id"] = where  # eager communicator, bound to this rank's GPU
        dist.init_process_group(choice.backend, store=_attempt_store(rank, world_size, timeout, restart), rank=rank,
                                world_size=world_size, timeout=timeout, **extra)
    return Runtime(rank, world_size, local_rank, choice.backend, where, restart, choice.note)


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
    """Seed Python, NumPy and torch with the run's seed, the same on every rank, so that every
    replica initialises the same model. Once the model is built the loop calls
    :func:`seed_per_rank`; per-rank randomness with a purpose of its own (data order, augmentation,
    stochastic rounding) draws from :func:`rank_generator` streams, so results never depend on the
    order of calls across ranks."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    # CPU kernels are deterministic for a fixed thread count; on GPUs ask cuDNN for deterministic
    # kernels. (torch.use_deterministic_algorithms would add a large import to every worker.)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def rank_seed(seed: int, rank: int, stream: int = 0) -> int:
    """The seed of one rank's random stream ``stream`` (streams: 0 the default generators after
    model initialisation, 41 QSGD's rounding; the loop's augmentation and data order have their own)."""
    return (seed * 1_000_003 + rank * 7919 + stream * 104_729) % 2**63


def seed_per_rank(seed: int, rank: int) -> None:
    """Re-seed torch's default generators (CPU and every GPU) from ``(seed, rank)``: called after the
    model is built from the shared seed, so that what training draws from them (dropout masks)
    differs between ranks as it would on separate machines, and is still reproducible."""
    torch.manual_seed(rank_seed(seed, rank, 0))


def rank_generator(seed: int, rank: int, stream: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator private to one rank and one purpose (``stream``), on ``device``: draws
    for CUDA tensors come from a CUDA generator (no host-to-device copy per step), whose stream
    differs from the CPU one's for the same seed."""
    g = torch.Generator(device=device)
    g.manual_seed(rank_seed(seed, rank, stream))
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
