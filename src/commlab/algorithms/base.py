"""The algorithm interface every method implements (docs/architecture.md, "The loop and its methods").

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

A method is one module in this package, named after it, with a class like::

    @ALGORITHMS.register("mymethod")
    class MyMethod(Algorithm):
        comm_pattern = "ring_allreduce"
        family = "periodic"
        host_sync_budget = SyncBudget({"local": 0})
        quick_run = QuickRun({"period": 2})
        resume = ResumeState("")

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

Every trait that code outside the method's file needs is declared on the method's own class
(:class:`Algorithm` lists them), never in a table elsewhere: the cost model's pattern
(``comm_pattern``), the method's family (``family``, one of :data:`FAMILIES`), the host-sync
budget (:class:`SyncBudget`), the options of a short run (:class:`QuickRun`) and what a
checkpoint holds (:class:`ResumeState`). Each defaults to None, "not declared", which
tests/test_method_traits.py fails for every registered method, as it fails a trait inherited
instead of declared: a method without a budget gives the reason, one without state says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from commlab.algorithms.context import MethodContext, OptimizerSettings, StepInfo
from commlab.algorithms.tensors import flatten, unflatten_into
from commlab.core.communicator import Communicator
from commlab.options import parse_options

__all__ = ["FAMILIES", "Algorithm", "MethodContext", "NoOptions", "OptimizerSettings", "QuickRun", "ResumeState",
           "StepInfo", "SyncBudget", "average_tensors", "broadcast_model", "parse_options"]


@dataclass
class NoOptions:
    """This method has no options."""


# ---- the traits a method declares ----------------------------------------------------------------
#: How a method saves communication, its ``family``: ``dense`` (every gradient, every step),
#: ``quantised`` (fewer bits per element), ``low_rank`` (factors of each gradient matrix),
#: ``sparse`` (a selection of the elements), ``periodic`` (model averages on a schedule),
#: ``delayed`` (the global update runs behind local steps), ``asynchronous`` (a parameter server,
#: no barrier). Tests pick one method of each family per model.
FAMILIES = ("dense", "quantised", "low_rank", "sparse", "periodic", "delayed", "asynchronous")


@dataclass(frozen=True)
class SyncBudget:
    """The most host syncs (calls that make the host wait for a CUDA device) one training step of
    a method may make outside log points, per step kind, or why the method has no budget.
    ``commlab bench syncs`` counts them and judges every method by its budget
    (docs/performance.md, "Host-sync budget"); tests/test_syncs.py runs it on every method.

    Args:
        limits: step kind -> most syncs. The kinds are the benchmark's
            (:data:`commlab.bench.syncs.STEP_KINDS`): ``step`` (a method that synchronises every
            step), ``local`` / ``reduction`` (steps without and with a reduction), ``recompute``
            (Ok-Topk's threshold recomputes).
        unbudgeted: with no limits, why there are none; the method's rows are then reported as
            measured, without a verdict.

    Example::

        host_sync_budget = SyncBudget({"step": 8, "recompute": 16})
        host_sync_budget = SyncBudget.none("why no count would mean anything")
    """

    limits: Mapping[str, int] = field(default_factory=dict)
    unbudgeted: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "limits", MappingProxyType(dict(self.limits)))  # shared by the class
        bad = {kind: most for kind, most in self.limits.items()
               if not isinstance(kind, str) or isinstance(most, bool) or not isinstance(most, int) or most < 0}
        if bad:
            raise ValueError(f"a sync budget maps step kinds to counts >= 0, got {bad}")
        if bool(self.limits) == bool(self.unbudgeted.strip()):
            raise ValueError("a sync budget gives limits per step kind, or (alone) the reason it has none")

    @classmethod
    def none(cls, reason: str) -> SyncBudget:
        """No budget, for ``reason``."""
        return cls({}, reason)


@dataclass(frozen=True)
class QuickRun:
    """Options for a short run that still takes the method's main branch (sparse, compressed,
    delayed, averaging) many times: 32 steps on generated data, where the papers' warm-ups and
    periods would leave only the warm-up (:mod:`commlab.testing.quick`). The GPU suite, the
    replica, precision and resume tests run every method with them.

    Args:
        params: method options over the defaults (``method_params``); empty when the defaults serve.
        wide_model: the method reaches every branch only on large layers (``wide_mlp``), e.g. a
            selector chosen by layer size.
        by_workers: options that depend on the number of workers (a group size that must divide it).

    Example::

        quick_run = QuickRun({"warmup_steps": 4, "density": 0.02})
        quick_run = QuickRun({"period": 4}, by_workers=lambda workers: {"group_size": 2 if workers % 2 == 0 else 1})
    """

    params: Mapping[str, Any] = field(default_factory=dict)
    wide_model: bool = False
    by_workers: Callable[[int], dict] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))  # shared by the class

    def options(self, workers: int = 1) -> dict:
        """The method's options for a short run on ``workers`` workers (a new dict)."""
        return {**self.params, **(self.by_workers(workers) if self.by_workers else {})}


@dataclass(frozen=True)
class ResumeState:
    """What a method's own checkpoint holds (:meth:`Algorithm.state_dict`) and whether a run
    resumed from it ends bit for bit as the uninterrupted run. tests/test_method_checkpoint.py
    saves and restores every method that holds state and resumes exactly, mid-run;
    tests/test_resume.py kills and resumes real jobs of a few; tests/test_method_traits.py checks
    that what a method says it holds matches what it saves.

    Args:
        state: the method's state, in words; "" when the model and the loop's optimizer are all.
        inexact: why a resumed run cannot end bit for bit as the uninterrupted one ("": it does).

    Example::

        resume = ResumeState("")                                  # nothing of its own
        resume = ResumeState("the residuals and the thresholds")
    """

    state: str
    inexact: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.state, str) or not isinstance(self.inexact, str):
            raise ValueError(f"ResumeState takes words: got state={self.state!r}, inexact={self.inexact!r}")


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

    # ---- declared traits: each registered class sets every one in its own body (None: not declared)
    #: The communication pattern whose formula the cost model applies to this method's measured
    #: volume: a key of :data:`commlab.bench.costmodel.PATTERNS` ("ring_allreduce", "allgather", ...).
    comm_pattern: str | None = None
    #: How the method saves communication: one of :data:`FAMILIES`.
    family: str | None = None
    #: The most host syncs per training step, by step kind, or why there is no budget.
    host_sync_budget: SyncBudget | None = None
    #: The options of a short run that reaches the method's main branch.
    quick_run: QuickRun | None = None
    #: What the method's checkpoint holds, and whether a resumed run is exact.
    resume: ResumeState | None = None

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
