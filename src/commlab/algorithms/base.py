"""The algorithm interface every method implements (docs: README, "Architecture").

The training loop owns the model, the optimizer and the data. It builds a method once, then calls
it at two points of every step::

    optimizer.zero_grad(); loss.backward()
    algo.after_backward(info)    # gradients ready: SSGD, Ok-Topk, RedSync, QSGD replace p.grad here
    clip_grad_norm_(model, train.grad_clip)
    optimizer.step()
    algo.after_step(info)        # K-step, hierarchical, ADPSGD, SSD/OD-SGD average or refresh here

The socket is one-way, as in torchtitan's train spec (the trainer builds the optimizer through
what the spec supplies):

* a method *declares* the optimizer the loop builds for it, :meth:`Algorithm.loop_optimizer`
  (the run's by default; RedSync: plain SGD, its momentum lives in the compressor; SSD-SGD:
  SGD at a multiple of the run's learning rate), and never builds or assigns it;
* it receives, once, a frozen :class:`~commlab.algorithms.context.MethodContext`: rank and world,
  seed, step counts, batch size, clipping, workers per node, the device and its clock, the run's
  optimizer settings and the loop's optimizer (to read its state), an optimizer builder for
  optimizers of its own (SSD-SGD's global replica), and the uncounted control channel;
* all its traffic goes through ``self.comm`` (a :class:`~commlab.core.Communicator`), so bytes
  and reductions are measured; what is not the method's traffic (probes, max-over-ranks metrics,
  evaluation averages) goes through ``self.ctx.control``. No method imports torch.distributed.

State that must survive a restart (residuals, thresholds, periods, replicas) goes through
:meth:`state_dict` / :meth:`load_state_dict`; every rank saves its own.

A method is one module in this package with a class like::

    @ALGORITHMS.register("mymethod")
    class MyMethod(Algorithm):
        @dataclass
        class Options:
            period: int = 4   # steps between averages
        def after_step(self, info):
            if (info.step + 1) % self.options.period == 0:
                with self.comm.reduction():
                    average_tensors(list(self.model.parameters()), self.comm)

and runs in a test exactly as the loop runs it (on every rank of a gloo world)::

    from commlab.testing import drive, run_distributed

    def body(rank, world):
        model = torch.nn.Linear(4, 2)
        driven = drive("mymethod", {"period": 2}, model=model, steps=4,
                       batches=lambda step: (torch.randn(8, 4), torch.randint(0, 2, (8,))))
        return driven.comm.stats.totals()["reductions_global"]     # 2

    run_distributed(body, world_size=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from commlab.algorithms.context import MethodContext, OptimizerSettings, StepInfo
from commlab.algorithms.tensors import flatten, unflatten_into
from commlab.core.communicator import Communicator
from commlab.options import parse_options

__all__ = ["Algorithm", "MethodContext", "NoOptions", "OptimizerSettings", "StepInfo", "average_tensors",
           "broadcast_model", "parse_options"]


@dataclass
class NoOptions:
    """This method has no options."""


class Algorithm:
    """Base class: synchronises nothing. Subclasses override the hooks they need.

    Args:
        model: the module the loop trains (this rank's replica).
        comm: the Communicator over the method's ranks; every counted collective goes through it.
        options: the method's parsed ``Options`` (``method_params``).
        ctx: the run's :class:`~commlab.algorithms.context.MethodContext`, handed over once.

    The loop builds a method with :func:`commlab.loop.method.build_method` (the loop's optimizer
    from :meth:`loop_optimizer`, then the context, then :meth:`setup`), never by hand.
    """

    Options: type = NoOptions
    #: The communication pattern whose formula the cost model applies to this method's measured
    #: volume: a key of :data:`commlab.bench.costmodel.PATTERNS` ("ring_allreduce", "allgather", ...).
    comm_pattern: str | None = None

    def __init__(self, model: nn.Module, comm: Communicator, options: Any, ctx: MethodContext):
        self.model = model
        self.comm = comm
        self.options = options
        self.ctx = ctx

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def loop_optimizer(cls, options: Any, run: OptimizerSettings) -> OptimizerSettings:
        """The optimizer the loop builds over the model's parameters and steps for this method,
        given the method's options and the run's settings (``train.*``). The run's by default;
        a method that needs another one returns it here (``dataclasses.replace(run, ...)``) and
        raises a ValueError naming the ``train`` key it cannot work with."""
        return run

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the loop steps (``ctx.optimizer``): read its state, never step it."""
        return self.ctx.optimizer

    def setup(self) -> None:
        """Called once before training: start every replica from rank 0's parameters."""
        broadcast_model(self.model, self.comm)

    @property
    def forward_model(self) -> nn.Module:
        """The module the loop calls for forward/backward (DDP returns its wrapper)."""
        return self.model

    @property
    def eval_model(self) -> nn.Module:
        """The module evaluated on the test set (delayed-update methods: the global replica)."""
        return self.model

    # ---- the two hooks ----------------------------------------------------------------------
    def after_backward(self, info: StepInfo) -> None:
        """Gradients are in ``p.grad``; synchronise them here if this method does."""

    def after_step(self, info: StepInfo) -> None:
        """The optimizer has stepped; synchronise the model here if this method does."""

    def finish(self) -> None:
        """End of training: complete anything in flight so every replica is final."""

    def metrics(self) -> dict[str, float]:
        """Method-specific per-step metrics (period, variance, threshold, ...)."""
        return {}

    def sync_events(self) -> list[tuple[int, dict[str, float]]]:
        """Decisions taken since the last call, each with the step it belongs to (ADPSGD's period
        at each synchronisation): the loop logs them as ``algo_sync_<name>`` at those steps, so a
        decision between two log points keeps its own step. Every rank calls it at every log point;
        what it returns must increase in step per name."""
        return []

    def run_params(self) -> dict[str, Any]:
        """Settings the method derives from its options, logged as MLflow params of the run
        beside the config and the options, under fixed dotted names (the periodic family's
        ``schedule.period``, ...). Called once, after :meth:`setup`."""
        return {}

    #: Where :meth:`replicated_tensors` live in a rank's checkpoint (``"model"``: the loop's model
    #: parameters; ``"algorithm.global_model"``: SSD/OD-SGD's global replica).
    replica_key: str = "model"

    def replicated_tensors(self) -> list[torch.Tensor]:
        """The tensors this method keeps bitwise equal on every rank: after every step for the
        gradient-synchronising methods, after :meth:`finish` for those that average on a schedule
        (with their final average). Default: the model's parameters. Replicas stay equal only if
        every rank computes the same update from the same gathered data in the same order, so
        reductions that ranks compute on their own are deterministic (``core.sparse.reduce_pairs``)."""
        return list(self.model.parameters())

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


# ---- helpers shared by methods ------------------------------------------------------------------
def broadcast_model(model: nn.Module, comm: Communicator, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (one flat broadcast)."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.dtype.is_floating_point]
    if comm.size == 1 or not tensors:
        return
    flat = flatten(tensors)
    comm.broadcast(flat, src=src)
    unflatten_into(flat, tensors)


def average_tensors(tensors: list[torch.Tensor], comm: Communicator) -> None:
    """Replace each tensor by its mean over the communicator's ranks, in one allreduce."""
    if comm.size == 1 or not tensors:
        return
    flat = flatten(tensors)
    comm.all_reduce(flat, op="avg")
    unflatten_into(flat, tensors)
