"""The loop's optimizers and learning-rate schedule, from the ``train`` section of a run config.

The loop owns the optimizer: :func:`optimizer_settings` reads the run's (typed
:class:`~commlab.algorithms.context.OptimizerSettings`), the method declares the one it needs
(``Algorithm.loop_optimizer``), and :func:`build_optimizer` builds it. Every step the loop sets
the learning rate of :func:`lr_at` with :func:`set_lr`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from commlab.algorithms.context import OptimizerSettings

OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("constant", "step", "cosine", "poly")


def optimizer_settings(train: dict) -> OptimizerSettings:
    """The run's optimizer, as the ``train`` section names it (missing keys: SGD without momentum)."""
    name = train.get("optimizer", "sgd")
    if name not in OPTIMIZERS:
        raise ValueError(f"train.optimizer must be one of {OPTIMIZERS}, got {name!r}")
    return OptimizerSettings(name=name, lr=float(train["lr"]), momentum=float(train.get("momentum", 0.0)),
                             nesterov=bool(train.get("nesterov", False)),
                             weight_decay=float(train.get("weight_decay", 0.0)),
                             betas=tuple(train.get("betas", (0.9, 0.999))))


def build_optimizer(params: Iterable[torch.nn.Parameter], s: OptimizerSettings) -> torch.optim.Optimizer:
    """SGD (optionally momentum/Nesterov, at ``lr_scale`` times the loop's lr) or Adam."""
    if s.name == "sgd":
        nesterov = s.nesterov and s.momentum > 0
        if s.lr_scale != 1.0:
            return ScaledSGD(params, lr=s.lr, lr_scale=s.lr_scale, momentum=s.momentum, nesterov=nesterov,
                             weight_decay=s.weight_decay)
        return torch.optim.SGD(params, lr=s.lr, momentum=s.momentum, nesterov=nesterov, weight_decay=s.weight_decay)
    if s.name == "adam":
        if s.lr_scale != 1.0:
            raise ValueError(f"an lr_scale ({s.lr_scale}) applies to sgd only, got optimizer 'adam'")
        return torch.optim.Adam(params, lr=s.lr, betas=tuple(s.betas), weight_decay=s.weight_decay)
    raise ValueError(f"train.optimizer must be one of {OPTIMIZERS}, got {s.name!r}")


class ScaledSGD(torch.optim.SGD):
    """torch SGD whose step size is the loop's learning rate times ``lr_scale``.

    The loop sets ``param_group["lr"]`` to the run's (scheduled) learning rate every step; this
    optimizer steps with a fixed multiple of it (SSD-SGD's local replica: ``local_lr_scale``), so
    the multiple lives in the param group and the schedule applies to both.

    Args:
        params: the parameters to optimise.
        lr: the loop's learning rate (the one the schedule sets).
        lr_scale: the multiple of ``lr`` each step uses (>= 0).
        momentum, nesterov, weight_decay: as torch.optim.SGD.

    Example::

        >>> opt = ScaledSGD([torch.nn.Parameter(torch.ones(2))], lr=0.05, lr_scale=4.0)   # steps with lr 0.2
        >>> opt.param_groups[0]["lr"], opt.param_groups[0]["lr_scale"]
        (0.05, 4.0)
    """

    def __init__(self, params, lr: float, lr_scale: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0):
        if lr_scale < 0:
            raise ValueError(f"lr_scale must be >= 0, got {lr_scale}")
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
        for group in self.param_groups:
            group["lr_scale"] = float(lr_scale)

    @torch.no_grad()
    def step(self, closure=None):
        saved = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = group["lr"] * group["lr_scale"]
        try:
            return super().step(closure)
        finally:
            for group, lr in zip(self.param_groups, saved, strict=True):
                group["lr"] = lr


def lr_at(step: int, steps_per_epoch: int, total_steps: int, train: dict) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up (``warmup_epochs``, from
    ``warmup_start`` x lr when given), then the schedule (constant, step, cosine or poly)."""
    base = float(train["lr"])
    warmup = int(round(float(train.get("warmup_epochs", 0)) * steps_per_epoch))
    if step < warmup:
        start = train.get("warmup_start")
        if start is None:  # Goyal et al.: lr x (step + 1) / warm-up steps
            return base * (step + 1) / warmup
        return base * (start + (1 - start) * step / warmup)  # from start x lr (Ok-Topk's release: lr / P)
    schedule = train.get("lr_schedule") or {"kind": "constant"}
    kind = schedule.get("kind", "constant")
    if kind == "constant":
        return base
    if kind == "step":
        epoch = step / steps_per_epoch
        drops = sum(1 for m in schedule.get("milestones", []) if epoch >= m)
        return base * float(schedule.get("gamma", 0.1)) ** drops
    if kind in ("cosine", "poly"):
        t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if kind == "poly":  # MXNet's PolyScheduler (SSD-SGD's "pow-2"): lr (1 - t)^power
            return base * (1 - t) ** float(schedule.get("power", 2))
        return base * 0.5 * (1 + math.cos(math.pi * t))
    raise ValueError(f"train.lr_schedule.kind must be one of {SCHEDULES}, got {kind!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
