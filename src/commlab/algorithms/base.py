"""The algorithm interface every method implements (DESIGN.md, "The algorithm interface").

The training loop owns the model, the optimizer and the data; it calls the algorithm at two
points of every step:

* :meth:`Algorithm.after_backward`: gradients are ready; gradient-synchronising methods (SSGD,
  Ok-Topk, RedSync, QSGD) replace ``p.grad`` by the synchronised gradient here;
* :meth:`Algorithm.after_step`: the optimizer has stepped; model-synchronising methods (K-step,
  hierarchical, ADPSGD, SSD/OD-SGD) average or refresh the parameters here.

All communication goes through ``self.comm`` (a :class:`~commlab.core.Communicator`), so bytes and
reductions are measured. State that must survive a restart (residuals, thresholds, periods,
replicas) goes through :meth:`state_dict` / :meth:`load_state_dict`; every rank saves its own.

A method is one module in this package with a class like::

    @ALGORITHMS.register("mymethod")
    class MyMethod(Algorithm):
        @dataclass
        class Options:
            period: int = 4   # steps between averages
        def after_step(self, info):
            if (info.step + 1) % self.options.period == 0:
                average_model(self.model, self.comm)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from commlab.algorithms.tensors import flatten, unflatten_into
from commlab.core.communicator import Communicator
from commlab.core.runtime import Runtime
from commlab.optim import build_optimizer
from commlab.options import parse_options  # noqa: F401 - methods and tests build their Options with it


@dataclass
class StepInfo:
    """Where the loop is: ``step`` counts optimizer steps from 0 over the whole run."""

    step: int
    epoch: int
    lr: float


@dataclass
class AlgoContext:
    """Run-wide facts an algorithm may need."""

    runtime: Runtime
    train: dict
    seed: int
    steps_per_epoch: int
    total_steps: int
    extras: dict = field(default_factory=dict)


@dataclass
class NoOptions:
    """This method has no options."""


class Algorithm:
    """Base class: synchronises nothing. Subclasses override the hooks they need."""

    Options: type = NoOptions
    #: The communication pattern whose formula the cost model applies to this method's measured
    #: volume: a key of :data:`commlab.bench.costmodel.PATTERNS` ("ring_allreduce", "allgather", ...).
    comm_pattern: str | None = None

    def __init__(self, model: nn.Module, comm: Communicator, options: Any, ctx: AlgoContext):
        self.model = model
        self.comm = comm
        self.options = options
        self.ctx = ctx
        self.optimizer: torch.optim.Optimizer | None = None

    # ---- construction -----------------------------------------------------------------------
    def build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the loop steps. Methods that move momentum into their compressor
        (RedSync) override this to return plain SGD."""
        return build_optimizer(self.model.parameters(), self.ctx.train)

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
