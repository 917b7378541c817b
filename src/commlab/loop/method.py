"""A method as every run builds it and takes a step with it: the one place both happen.

The loop (:mod:`commlab.loop.loop`) and the test kit's driver (``commlab.testing.drive``) go
through these functions, so a test drives a method's hooks exactly as a run does:

* :func:`build_method`: the loop's optimizer from the method's declaration
  (``Algorithm.loop_optimizer``), the frozen :class:`~commlab.algorithms.context.MethodContext`,
  the method, its ``setup()``;
* :func:`take_step`: one optimizer step (lr, zero_grad, gradients, ``after_backward``, clipping,
  ``optimizer.step``, ``after_step``);
* :func:`backward`: the gradients of a classification batch (cross-entropy through the method's
  ``forward_model``).

Example (on every rank of a process group)::

    algo = build_method("ssgd", model, Communicator(), None, runtime=rt, train={"lr": 0.1},
                        seed=0, steps_per_epoch=10, total_steps=10, workers_per_node=2)
    loss = take_step(algo, StepInfo(0, 0, 0.1), lambda: backward(algo, x, y))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from commlab.algorithms.base import Algorithm, MethodContext, StepInfo
from commlab.core.clock import DeviceClock
from commlab.core.communicator import Communicator
from commlab.core.control import ControlChannel
from commlab.core.runtime import Runtime
from commlab.loop.optim import build_optimizer, optimizer_settings, set_lr
from commlab.options import parse_options
from commlab.registry import ALGORITHMS


def build_method(method: str | type[Algorithm], model: torch.nn.Module, comm: Communicator, options: Any, *,
                 runtime: Runtime, train: dict, seed: int, steps_per_epoch: int, total_steps: int,
                 workers_per_node: int, clock: DeviceClock | None = None,
                 control: ControlChannel | None = None) -> Algorithm:
    """The method ``method`` (a registered name or a class) over ``model``, set up.

    ``options`` are its parsed Options, or a ``method_params`` mapping (None: the defaults);
    ``train`` the run's ``train`` section. The loop's optimizer is built from what the method
    declares; ``clock`` defaults to ``comm``'s (one clock times the collectives and the
    method's pieces), ``control`` to a control channel over ``comm``'s ranks."""
    cls = ALGORITHMS.get(method) if isinstance(method, str) else method
    if options is None or isinstance(options, dict):
        options = parse_options(cls.Options, options)
    run = optimizer_settings(train)
    optimizer = build_optimizer(model.parameters(), cls.loop_optimizer(options, run))
    ctx = MethodContext(
        runtime=runtime, seed=seed, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        batch_size=int(train["batch_size"]), grad_clip=float(train["grad_clip"]) if train.get("grad_clip") else None,
        workers_per_node=workers_per_node, run_optimizer=run, optimizer=optimizer,
        optimizer_builder=build_optimizer, clock=clock or comm.clock,
        control=control or ControlChannel(comm.group))
    algo = cls(model, comm, options, ctx)
    algo.setup()
    return algo


def take_step(algo: Algorithm, info: StepInfo, gradients: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
    """One optimizer step of ``algo`` at ``info`` (its lr set in the loop's optimizer first);
    ``gradients()`` fills ``p.grad`` (forward and backward) and returns the loss, if any."""
    optimizer = algo.optimizer
    set_lr(optimizer, info.lr)
    optimizer.zero_grad(set_to_none=False)
    loss = gradients()
    algo.after_backward(info)
    if algo.ctx.grad_clip:
        torch.nn.utils.clip_grad_norm_(algo.model.parameters(), algo.ctx.grad_clip)
    optimizer.step()
    algo.after_step(info)
    return loss


def backward(algo: Algorithm, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``algo.forward_model`` on the batch ``(x, y)``, backpropagated."""
    loss = F.cross_entropy(algo.forward_model(x), y)
    loss.backward()
    return loss
