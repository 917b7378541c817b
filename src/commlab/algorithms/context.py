"""What the training loop hands a method: once, at construction, a frozen :class:`MethodContext`;
at every hook, a :class:`StepInfo`; and the typed :class:`OptimizerSettings` in which a method
declares the optimizer the loop builds for it (``Algorithm.loop_optimizer``).

The socket is one-way: the loop builds the optimizer and the context and hands them over; a
method never builds the loop's optimizer, never writes anything back, and never reads the raw
config. The loop (:mod:`commlab.loop.method`) and the test kit's driver (``commlab.testing.drive``)
fill these the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from commlab.core.clock import DeviceClock
from commlab.core.control import ControlChannel
from commlab.core.runtime import Runtime


@dataclass(frozen=True)
class StepInfo:
    """Where the loop is: ``step`` counts optimizer steps from 0 over the whole run; ``lr`` is the
    step's learning rate (the schedule's, already set in the loop's optimizer)."""

    step: int
    epoch: int
    lr: float


@dataclass(frozen=True)
class OptimizerSettings:
    """An optimizer as the run's ``train`` section names it (``train.optimizer``, ``lr``, ...).

    Args:
        name: ``sgd`` or ``adam``.
        lr: the base learning rate; the loop sets each step's from the schedule.
        momentum, nesterov: SGD's (Nesterov only with momentum > 0).
        weight_decay: L2 penalty added to the gradient by the optimizer.
        betas: Adam's.
        lr_scale: SGD only: steps with ``lr_scale`` times the loop's learning rate (the schedule
            then applies to both).

    Example::

        >>> run = OptimizerSettings("sgd", lr=0.1, momentum=0.9)
        >>> plain = dataclasses.replace(run, momentum=0.0, weight_decay=0.0)   # plain SGD at the run's lr
        >>> plain.lr, plain.momentum
        (0.1, 0.0)
    """

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_scale: float = 1.0


#: Builds an optimizer over some parameters from settings (the loop's :func:`commlab.loop.optim.build_optimizer`).
OptimizerBuilder = Callable[[Iterable[torch.nn.Parameter], OptimizerSettings], torch.optim.Optimizer]


@dataclass(frozen=True)
class MethodContext:
    """Run-wide facts and services a method receives once, at construction (``self.ctx``).

    Args:
        runtime: this worker's place in the job (rank, world size, local rank, backend, device).
        seed: the run's seed (methods derive their own generators from it).
        steps_per_epoch: optimizer steps in one epoch.
        total_steps: optimizer steps in the whole run.
        batch_size: samples per worker and step.
        grad_clip: the norm the loop clips the synchronised gradient to after ``after_backward``
            (None: no clipping); a method that steps an optimizer of its own clips the same.
        workers_per_node: workers on one node (the default local group of hierarchical methods).
        run_optimizer: the run's optimizer settings (``train.*``), typed.
        optimizer: the optimizer the loop steps, built from ``loop_optimizer``'s declaration.
            Read its state (momentum buffers, Adam moments); the loop alone steps it.
        optimizer_builder: how the loop builds optimizers; :meth:`build_optimizer` uses it.
        clock: the run's device clock (:mod:`commlab.core.clock`), shared with the Communicator:
            ``with clock.timed(device, sink):`` times a piece of a step on the device that runs
            it (CUDA events, read at the next log point; host time on the CPU) into ``sink``.
        control: the uncounted side channel over the method's ranks, for traffic that is not the
            method's: probes, max-over-ranks metrics, evaluation averages (:mod:`commlab.core.control`).

    Example (a method that keeps an optimizer of its own for a second replica)::

        def setup(self):
            super().setup()
            self.replica = copy.deepcopy(self.model)
            self.replica_opt = self.ctx.build_optimizer(self.replica.parameters())  # the run's optimizer
            worst = self.ctx.control.all_reduce(
                torch.tensor([self.ctx.batch_size], device=self.ctx.control.device), op="max")
    """

    runtime: Runtime
    seed: int
    steps_per_epoch: int
    total_steps: int
    batch_size: int
    grad_clip: float | None
    workers_per_node: int
    run_optimizer: OptimizerSettings
    optimizer: torch.optim.Optimizer
    optimizer_builder: OptimizerBuilder
    clock: DeviceClock
    control: ControlChannel

    @property
    def device(self) -> torch.device:
        """The device every tensor of the run lives on."""
        return self.runtime.device

    def build_optimizer(self, params: Iterable[torch.nn.Parameter], **changes) -> torch.optim.Optimizer:
        """An optimizer over ``params`` from the run's settings, with ``changes`` to them (fields of
        :class:`OptimizerSettings`, e.g. ``lr_scale=4.0``), built as the loop builds its own."""
        return self.optimizer_builder(params, dataclasses.replace(self.run_optimizer, **changes))
