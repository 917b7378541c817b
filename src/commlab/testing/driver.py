"""Drive a method's hooks exactly as the training loop does, on batches or gradients a test chooses.

:func:`drive` builds the method as every run does (:func:`commlab.loop.method.build_method`: the
loop's optimizer from the method's declaration, the frozen context, ``setup()``) and takes its
steps with the loop's own step (:func:`commlab.loop.method.take_step`): lr from the run's
schedule, ``zero_grad``, the gradients (cross-entropy backward of a batch, or given), the
method's ``after_backward``, clipping, ``optimizer.step``, ``after_step``. A test then asserts
on the model, the gradients, the method's state and ``comm.stats``, and can go on stepping.

Every rank of a gloo world calls it (inside :func:`commlab.testing.run_distributed`)::

    from commlab.testing import drive, run_distributed

    def body(rank, world):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        gen = torch.Generator().manual_seed(rank)
        batch = lambda step: (torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        driven = drive("kstep", {"period": 2}, model=model, steps=6, train={"lr": 0.1}, batches=batch)
        return driven.comm.stats.totals()["reductions_global"]    # after steps 1, 3 and 5: 3

    assert run_distributed(body, world_size=2) == [3, 3]

Observation points inside a step (``watch(point, driven, info)``): ``"gradients"`` (the
gradients are in ``p.grad``, before ``after_backward``), ``"synchronised"`` (before the
optimizer step: after ``after_backward`` and clipping), ``"stepped"`` (after the optimizer
step, before ``after_step``), ``"done"`` (after ``after_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commlab.algorithms.base import Algorithm, StepInfo
from commlab.config import DEFAULTS
from commlab.core.communicator import Communicator
from commlab.core.runtime import Runtime
from commlab.core.stats import CommStats
from commlab.loop.method import backward, build_method, take_step
from commlab.loop.optim import lr_at

Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
Grads = Callable[[int], "list[torch.Tensor] | torch.Tensor"]
Watch = Callable[[str, "Driven", StepInfo], None]


@dataclass
class Driven:
    """A method built as the loop builds it, and where its run is: ``next_step`` is the step
    :meth:`run` takes next. ``lr(step)`` gives each step's learning rate."""

    algo: Algorithm
    gradients: Callable[[int], torch.Tensor | None]
    lr: Callable[[int], float]
    steps_per_epoch: int
    watch: Watch | None = None
    next_step: int = 0
    info: StepInfo | None = None  # the step being taken (or last taken)

    @property
    def model(self) -> torch.nn.Module:
        return self.algo.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.algo.optimizer

    @property
    def comm(self) -> Communicator:
        return self.algo.comm

    def run(self, steps: int) -> Driven:
        """Take ``steps`` more steps, from ``next_step``."""
        for _ in range(steps):
            t = self.next_step
            self.info = StepInfo(t, t // self.steps_per_epoch, self.lr(t))
            take_step(self.algo, self.info, lambda t=t: self._gradients(t))
            self._see("done")
            self.next_step += 1
        return self

    def finish(self) -> Driven:
        """The end of the run, as the loop ends it (``algo.finish()``)."""
        self.algo.finish()
        return self

    def _gradients(self, step: int) -> torch.Tensor | None:
        loss = self.gradients(step)
        self._see("gradients")
        return loss

    def _see(self, point: str) -> None:
        if self.watch is not None:
            self.watch(point, self, self.info)


def drive(method: str | type[Algorithm], options: dict | object | None = None, *, model: torch.nn.Module,
          steps: int = 0, batches: Batches | None = None, grads: Grads | None = None, train: dict | None = None,
          comm: Communicator | None = None, seed: int = 0, total_steps: int | None = None,
          steps_per_epoch: int | None = None, workers_per_node: int | None = None,
          lr: Callable[[int], float] | None = None, watch: Watch | None = None) -> Driven:
    """Build ``method`` over ``model`` as a run does and take its first ``steps`` steps.

    Args:
        method: a registered name or an Algorithm class.
        options: its Options, or a ``method_params`` mapping (aliases accepted; None: defaults).
        model: this rank's replica (setup broadcasts rank 0's, as in a run).
        steps: steps to take now (:meth:`Driven.run` takes more).
        batches: ``batches(step) -> (x, y)``: the gradients are cross-entropy's, as in a run.
        grads: ``grads(step)``: the gradients themselves, one tensor per parameter (in
            ``model.parameters()`` order) or one flat tensor; exactly one of ``batches``/``grads``.
        train: the run's ``train`` section; the run defaults fill what it leaves out.
        comm: the method's world (default: a new Communicator over all ranks); the runtime and
            the control channel cover the same ranks.
        seed: the run's seed. total_steps: the run's length (default ``steps``);
            steps_per_epoch: default ``total_steps``; workers_per_node: default the world.
        lr: ``lr(step)`` instead of the run's schedule (``train.lr``, warm-up, decay).
        watch: ``watch(point, driven, info)`` at the points the module docstring lists.
    """
    if (batches is None) == (grads is None):
        raise ValueError("give exactly one of batches= or grads=")
    train = {**DEFAULTS["train"], **(train or {})}
    comm = comm if comm is not None else Communicator(stats=CommStats())
    total_steps = steps if total_steps is None else total_steps
    steps_per_epoch = steps_per_epoch or max(1, total_steps)
    runtime = Runtime(comm.rank, comm.size, comm.rank, dist.get_backend(comm.group), comm.device)
    algo = build_method(method, model, comm, options, runtime=runtime, train=train, seed=seed,
                        steps_per_epoch=steps_per_epoch, total_steps=total_steps,
                        workers_per_node=workers_per_node or comm.size)
    if batches is not None:
        def gradients(step: int) -> torch.Tensor:
            return backward(algo, *batches(step))
    else:
        def gradients(step: int) -> None:
            set_grads(model, grads(step))
    driven = Driven(algo, gradients, lr or (lambda step: lr_at(step, steps_per_epoch, total_steps, train)),
                    steps_per_epoch, watch)
    if watch is not None:
        algo.optimizer.register_step_pre_hook(lambda *_: driven._see("synchronised"))
        algo.optimizer.register_step_post_hook(lambda *_: driven._see("stepped"))
    return driven.run(steps)


def set_grads(model: torch.nn.Module, grads: list[torch.Tensor] | torch.Tensor) -> None:
    """Put ``grads`` (one tensor per parameter, or one flat tensor) into the parameters' ``.grad``."""
    params = list(model.parameters())
    if torch.is_tensor(grads):
        grads = list(torch.split(grads.reshape(-1), [p.numel() for p in params]))
    for p, g in zip(params, grads, strict=True):
        g = g.detach().reshape(p.shape)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
