"""Optimizers and learning-rate schedules built from the ``train`` section of a run config."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("constant", "step", "cosine")


def build_optimizer(params: Iterable[torch.nn.Parameter], train: dict) -> torch.optim.Optimizer:
    """SGD (optionally momentum/Nesterov) or Adam, with the run's lr and weight decay."""
    name = train.get("optimizer", "sgd")
    lr, wd = float(train["lr"]), float(train.get("weight_decay", 0.0))
    if name == "sgd":
        momentum = float(train.get("momentum", 0.0))
        nesterov = bool(train.get("nesterov", False)) and momentum > 0
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    if name == "adam":
        betas = tuple(train.get("betas", (0.9, 0.999)))
        return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=wd)
    raise ValueError(f"train.optimizer must be one of {OPTIMIZERS}, got {name!r}")


def lr_at(step: int, steps_per_epoch: int, total_steps: int, train: dict) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then the schedule."""
    base = float(train["lr"])
    warmup = int(round(float(train.get("warmup_epochs", 0)) * steps_per_epoch))
    if step < warmup:
        return base * (step + 1) / warmup
    schedule = train.get("lr_schedule") or {"kind": "constant"}
    kind = schedule.get("kind", "constant")
    if kind == "constant":
        return base
    if kind == "step":
        epoch = step / steps_per_epoch
        drops = sum(1 for m in schedule.get("milestones", []) if epoch >= m)
        return base * float(schedule.get("gamma", 0.1)) ** drops
    if kind == "cosine":
        t = (step - warmup) / max(1, total_steps - warmup)
        return base * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    raise ValueError(f"train.lr_schedule.kind must be one of {SCHEDULES}, got {kind!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
