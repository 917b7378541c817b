"""What the training loop needs to stop cleanly and resume exactly (docs/cluster.md, section 3).

* :class:`StopSignal` remembers a SIGTERM/SIGINT (what SLURM sends before preemption) until the
  loop's next control point, where all ranks agree to checkpoint and exit with
  :data:`EXIT_PREEMPTED`;
* :class:`Progress` is the loop's position and running sums, saved in every checkpoint so that a
  resumed run continues bit for bit (same batches, same loss windows, same logged points);
* :func:`rng_state` / :func:`set_rng_state` cover every global generator the loop may draw from;
* :func:`fingerprint` names what a checkpoint must agree with: resuming another method's or
  seed's checkpoint would silently mix two experiments, so it fails instead.
"""

from __future__ import annotations

import random
import signal
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

EXIT_PREEMPTED = 143  # 128 + SIGTERM: checkpointed, not finished; re-launching resumes


class Preempted(Exception):
    """All ranks agreed to stop after a SIGTERM/SIGINT; the checkpoint is written."""


class StopSignal:
    """Remembers a SIGTERM/SIGINT until the next control point, where all ranks agree to stop.

    The handler only sets a flag: stopping inside a collective or half-way through an optimizer
    step would leave replicas that disagree."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


@dataclass
class Progress:
    """The loop's position and running sums; one copy per rank in every checkpoint."""

    step: int = 0  # optimizer steps taken over the whole run
    epoch: int = 0  # epochs completed
    pos: int = 0  # batches of the current epoch already consumed
    window_loss: float = 0.0  # training loss summed since the last log point
    window_n: int = 0  # steps in that sum
    compute_s: float = 0.0  # seconds outside communication, over all attempts
    wall_s: float = 0.0  # wall seconds of earlier attempts
    run_id: str | None = None  # the MLflow run every attempt logs to
    final: dict = field(default_factory=dict)  # latest metrics (for the sentinel)
    golden: list = field(default_factory=list)  # the loss curve written to config `golden`
    done: bool = False  # training and final evaluation complete (a re-launch only rewrites outputs)

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> Progress:
        return cls(**state)


def rng_state(device: torch.device | None = None) -> dict:
    """The global generators' states: Python, NumPy, torch's CPU one and that of the run's GPU
    (``device``; only its own, so that the state resumes on whichever GPU the rank gets next)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device is not None and device.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda_device" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_device"].cpu(), device)


FINGERPRINT_KEYS = ("method", "method_params", "model", "model_options", "dataset", "seed", "train.batch_size",
                    "train.optimizer", "train.train_subset", "task")


def fingerprint(config: dict) -> dict:
    """The config values a checkpoint is bound to (epochs, lr schedule, logging may change)."""
    out = {}
    for key in FINGERPRINT_KEYS:
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def check_fingerprint(saved: dict | None, config: dict, where: str) -> None:
    """Raise ValueError naming every key in which ``config`` differs from the checkpoint's."""
    if saved is None:
        return
    ours = fingerprint(config)
    diff = [f"{k}: checkpoint {saved.get(k)!r}, config {ours[k]!r}" for k in ours if saved.get(k) != ours[k]]
    if diff:
        raise ValueError(f"the checkpoint in {where} belongs to another experiment ({'; '.join(diff)}); "
                         f"use another output_dir, or delete {where} to start over")
