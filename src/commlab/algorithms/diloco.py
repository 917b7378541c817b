"""DiLoCo: local steps with an inner optimizer, then an outer optimizer on the pseudo-gradient
(Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv
2311.08105, Algorithm 1; reference implementation: torchft's ``torchft/local_sgd.py``).

Every worker i takes ``period`` (the paper's H) local steps with the loop's optimizer, the
*inner* optimizer (the run's ``train.optimizer``; the paper's is AdamW), from the global model
theta (the *anchor*, the model of the last outer step). Then one global reduction::

    delta = mean_i (theta - x_i)     # the pseudo-gradient: one float32 allreduce of (theta - x_i)
    theta = OuterOpt(theta, delta)   # a torch.optim optimizer over an anchor copy of the parameters,
                                     # delta as its gradient
    x_i = theta                      # every worker restarts from the new global model

The outer optimizer (``outer_optimizer``) is a real ``torch.optim`` optimizer over the anchor copy,
built as the loop builds its own: ``nesterov`` (SGD with Nesterov momentum, DiLoCo's: ``outer_lr``
0.7, ``outer_momentum`` 0.9), ``sgd`` (heavy ball; ``outer_momentum`` 0: plain) or ``adam``
(``outer_betas``). No weight decay and no schedule: the outer learning rate is constant, as in
the paper. ``outer_momentum`` is SGD's and ``outer_betas`` Adam's; each is unused by the other.

DiLoCo is a member of the periodic-averaging family (:mod:`commlab.algorithms.periodic`): a fixed
schedule (an outer step after every H-th local step, and one after the run's last step with
``final_average``), the family's logged schedule params, metrics and policies. It relates to
``kstep`` (:mod:`commlab.algorithms.kstep`, the same period, ``phase: last``) so:

* ``sgd`` with ``outer_lr`` 1 and ``outer_momentum`` 0 gives theta = theta - (theta - mean x) =
  mean x: K-step averaging, equal to float tolerance (the pseudo-gradient and the outer step are
  two roundings the plain average has not).
* ``sgd`` with lr eta and momentum mu (torch: buf = mu buf + delta; theta -= eta buf) is kstep's
  classical block momentum with ``block_lr`` zeta = eta and ``momentum`` mu: with v = -eta buf,
  v = mu v + eta (mean x - theta); theta += v (:mod:`commlab.algorithms.averaging`).
* ``nesterov`` is not kstep's Nesterov block momentum. torch folds the look-ahead into theta
  (theta -= eta (delta + mu buf)) and measures the next pseudo-gradient from that point; BMUF keeps
  the anchor without the look-ahead, restarts the workers from anchor + mu v and measures from the
  anchor. The first outer steps agree; later ones differ (tests/test_diloco.py shows by how much).

At an outer step (the family's policies, chosen so that the choice is explicit):

* ``buffers``: ``average`` (default) replaces the floating buffers (BatchNorm running statistics)
  by their plain average, in the same allreduce as the pseudo-gradient: they are statistics, not
  trained, so no outer optimizer acts on them; ``keep_local`` leaves each worker its own.
* ``optimizer_state``: ``keep_local`` (default, as DiLoCo: each worker keeps its inner AdamW
  moments across outer steps) or ``average`` (plainly averaged in the same allreduce).

Invariants: every rank holds the same anchor and outer-optimizer state (the same averaged
pseudo-gradient, a deterministic step); after an outer step every replica equals the anchor bit
for bit; an outer step is one global reduction, an allreduce of the parameters' size (plus the
averaged buffers and optimizer state, in the same message when they share its dtype). The anchor
and the outer optimizer's state are checkpointed, so a resumed run is bitwise the uninterrupted one.

``evaluate``: ``rank0`` (default) scores rank 0's replica; ``global`` the anchor (the model of the
last outer step, with rank 0's buffers: what the paper evaluates, no communication); ``average``
the replicas' world average (uncounted, as kstep).

Launch (4 CPU workers, AdamW-like inner steps, an outer step every 50)::

    torchrun --standalone --nproc-per-node 4 -m commlab train --config run.yaml method=diloco \\
        train.optimizer=adam train.lr=0.001 method_params.period=50
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.context import OptimizerSettings
from commlab.algorithms.periodic import AveragingPolicy, FamilyOptions, FixedSchedule, PeriodicAveraging
from commlab.algorithms.tensors import flatten
from commlab.core.communicator import Communicator, Pending
from commlab.options import Alias
from commlab.registry import ALGORITHMS

OUTER_OPTIMIZERS = ("nesterov", "sgd", "adam")
EVALUATE = ("rank0", "global", "average")


@dataclass
class Fragment:
    """A part of the model with outer steps of its own (DiLoCo: the whole model).

    ``params`` are the live replica's, ``anchors`` the outer optimizer's copies of them (the
    global model at the fragment's last outer step), ``buffers`` the floating buffers that go
    with these layers."""

    index: int
    params: list[nn.Parameter]
    anchors: list[nn.Parameter]
    buffers: list[torch.Tensor] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(param.numel() for param in self.params)


@dataclass
class Message:
    """One flat allreduce of an outer step: the pseudo-gradients first (``grad_numel`` elements;
    only in the first message), then the tensors ``targets`` averages, in that order."""

    flat: torch.Tensor
    grad_numel: int
    targets: list[torch.Tensor]
    pending: Pending | None = None  # None: complete (a blocking allreduce, or restored from a checkpoint)


@dataclass
class Exchange:
    """A fragment's outer step on its way: launched at one step, applied at ``apply_step``."""

    fragment: Fragment
    apply_step: int
    messages: list[Message]
    bytes_sent: int  # what this rank's Communicator counted for it


class OuterSync:
    """Launches and applies outer steps: the pseudo-gradient ``anchor - x`` (sent in
    ``wire_dtype``, summed over the ranks, divided by P in the anchors' dtype), the other tensors
    of the policy averaged, the outer optimizer stepped, the replica reset to the anchor and mixed
    with its local value by ``alpha``: x = (1 - alpha) * theta + alpha * x_local."""

    def __init__(self, comm: Communicator, outer: torch.optim.Optimizer, inner: torch.optim.Optimizer,
                 policy: AveragingPolicy, wire_dtype: torch.dtype = torch.float32):
        self.comm, self.outer, self.inner = comm, outer, inner
        self.policy, self.wire_dtype = policy, wire_dtype

    def averaged_state(self, fragment: Fragment) -> list[torch.Tensor]:
        """The live tensors the policy averages with ``fragment``'s outer step: its floating
        buffers, then the inner optimizer's per-parameter state (momentum buffer, Adam moments;
        not the step count). Read at launch: the inner state exists once the optimizer stepped."""
        tensors = list(fragment.buffers) if self.policy.buffers == "average" else []
        if self.policy.optimizer_state == "average":
            for param in fragment.params:
                tensors += [value for value in self.inner.state.get(param, {}).values()
                            if torch.is_tensor(value) and value.shape == param.shape and value.dtype.is_floating_point]
        return tensors

    def _by_dtype(self, fragment: Fragment) -> dict[torch.dtype, list[torch.Tensor]]:
        """:meth:`averaged_state`, grouped by dtype (one message per dtype)."""
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in self.averaged_state(fragment):
            groups.setdefault(tensor.dtype, []).append(tensor)
        return groups

    @torch.no_grad()
    def launch(self, fragment: Fragment, apply_step: int, blocking: bool) -> Exchange:
        """Start the fragment's allreduces (call inside ``comm.reduction()``): blocking, or
        asynchronous (``comm.all_reduce_async``, waited in :meth:`apply`)."""
        grads = torch.cat([(anchor - param).reshape(-1)
                           for anchor, param in zip(fragment.anchors, fragment.params, strict=True)])
        grads = grads.to(self.wire_dtype)
        by_dtype = self._by_dtype(fragment)
        # Tensors of the wire's dtype travel in the pseudo-gradient's message: one allreduce.
        first = by_dtype.pop(grads.dtype, [])
        messages = [Message(torch.cat([grads, flatten(first)]) if first else grads, grads.numel(), first)]
        messages += [Message(flatten(tensors), 0, tensors) for tensors in by_dtype.values()]
        before = self.comm.stats.counters["bytes_sent"]
        for message in messages:
            if blocking:
                self.comm.all_reduce(message.flat, op="sum")
            else:
                message.pending = self.comm.all_reduce_async(message.flat, op="sum")
        return Exchange(fragment, apply_step, messages, self.comm.stats.counters["bytes_sent"] - before)

    @staticmethod
    def complete(exchange: Exchange) -> None:
        """Wait for the exchange's allreduces (the Communicator records the blocked time)."""
        for message in exchange.messages:
            if message.pending is not None:
                message.pending.wait()
                message.pending = None

    @torch.no_grad()
    def apply(self, exchange: Exchange, alpha: float) -> None:
        """The outer step of the exchange's fragment with its averaged pseudo-gradient."""
        self.complete(exchange)
        fragment, size = exchange.fragment, self.comm.size
        first = exchange.messages[0]
        dtype = fragment.anchors[0].dtype
        delta = first.flat[:first.grad_numel].to(dtype).div_(size)
        local = [param.detach().clone() for param in fragment.params] if alpha else None
        offset = 0
        for anchor in fragment.anchors:
            anchor.grad = delta[offset:offset + anchor.numel()].view_as(anchor)
            offset += anchor.numel()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)  # the other fragments' anchors must stay without a gradient
        for i, (param, anchor) in enumerate(zip(fragment.params, fragment.anchors, strict=True)):
            param.copy_(anchor)
            if local is not None:
                param.lerp_(local[i], alpha)
        for message in exchange.messages:
            if not message.targets:
                continue
            averaged = message.flat[message.grad_numel:].to(message.targets[0].dtype).div_(size)
            offset = 0
            for target in message.targets:
                value = averaged[offset:offset + target.numel()].view_as(target)
                offset += target.numel()
                if alpha:
                    value.lerp_(target, alpha)
                target.copy_(value)

    @staticmethod
    def exchange_state(exchange: Exchange) -> dict:
        """A completed exchange as a checkpoint holds it: the summed messages and when it applies."""
        OuterSync.complete(exchange)
        return {"fragment": exchange.fragment.index, "apply_step": exchange.apply_step,
                "bytes_sent": exchange.bytes_sent,
                "messages": [(message.flat.clone(), message.grad_numel) for message in exchange.messages]}

    def restore_exchange(self, fragment: Fragment, state: dict) -> Exchange:
        """The exchange a checkpoint holds, its targets taken again from the live tensors (the
        loop loads the inner optimizer's state before the method's)."""
        by_dtype = self._by_dtype(fragment)
        saved = state["messages"]
        device = fragment.anchors[0].device
        first_flat, grad_numel = saved[0]
        messages = [Message(first_flat.to(device), grad_numel, by_dtype.pop(first_flat.dtype, []))]
        messages += [Message(flat.to(device), 0, by_dtype.pop(flat.dtype)) for flat, _ in saved[1:]]
        return Exchange(fragment, state["apply_step"], messages, state["bytes_sent"])


@dataclass
class DiLoCoOptions(FamilyOptions):
    """DiLoCo's options (after the family's ``buffers``, ``optimizer_state`` and
    ``final_average``); ``sync_every`` (torchft's name) is an alias of ``period``."""

    ALIASES: ClassVar[dict[str, Alias]] = {**FamilyOptions.ALIASES, "sync_every": Alias("period")}

    period: int = 500  # inner steps between outer steps, the paper's H
    outer_optimizer: str = "nesterov"  # nesterov | sgd (heavy ball) | adam, over the pseudo-gradient
    outer_lr: float = 0.7  # the outer learning rate (constant)
    outer_momentum: float = 0.9  # nesterov, sgd: the momentum (sgd: 0 = plain)
    outer_betas: list = field(default_factory=lambda: [0.9, 0.999])  # adam: its betas
    evaluate: str = "rank0"  # rank0 | global (the anchor) | average (the replicas' world average, uncounted)

    def validate(self) -> None:
        super().validate()
        if self.period < 1:
            raise ValueError(f"period must be >= 1, got {self.period}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer_optimizer must be one of {OUTER_OPTIMIZERS}, got {self.outer_optimizer!r}")
        if not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise ValueError(f"outer_lr must be a finite number > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.outer_optimizer == "nesterov" and self.outer_momentum == 0:
            raise ValueError("outer_optimizer nesterov needs outer_momentum > 0, got 0")
        betas = self.outer_betas
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2
                and all(isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 <= beta < 1
                        for beta in betas)):
            raise ValueError(f"outer_betas must be two numbers in [0, 1), got {betas!r}")
        if self.evaluate not in EVALUATE:
            raise ValueError(f"evaluate must be one of {EVALUATE}, got {self.evaluate!r}")

    def outer_settings(self) -> OptimizerSettings:
        """The outer optimizer as the loop's builder takes it (no weight decay)."""
        if self.outer_optimizer == "adam":
            return OptimizerSettings("adam", lr=self.outer_lr, betas=(float(self.outer_betas[0]),
                                                                      float(self.outer_betas[1])))
        return OptimizerSettings("sgd", lr=self.outer_lr, momentum=self.outer_momentum,
                                 nesterov=self.outer_optimizer == "nesterov")


@ALGORITHMS.register("diloco")
class DiLoCo(PeriodicAveraging):
    """H local steps with the inner optimizer, then an outer optimizer step on the averaged
    pseudo-gradient (formulas, policies and invariants: the module docstring).

    Example (on every rank of a gloo world)::

        driven = drive("diloco", {"period": 4, "outer_lr": 0.7}, model=model, steps=8,
                       train={"optimizer": "adam", "lr": 1e-3}, batches=batches)
        driven.comm.stats.totals()["reductions_global"]     # after steps 3 and 7: 2
    """

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "periodic"
    host_sync_budget = SyncBudget({"local": 0, "reduction": 0})
    quick_run = QuickRun({"period": 4})
    resume = ResumeState("the anchor (the global model), the outer optimizer's state and the schedule's counts")

    Options = DiLoCoOptions

    def make_schedule(self) -> FixedSchedule:
        options = self.options
        return FixedSchedule(options.period, options.period, self.ctx.total_steps, 0, "last", options.final_average)

    def policy(self) -> AveragingPolicy:
        options = self.options
        return AveragingPolicy(buffers=options.buffers, optimizer_state=options.optimizer_state,
                               evaluate="average" if options.evaluate == "average" else "rank0")

    def setup(self) -> None:
        super().setup()  # every replica starts from rank 0's model; the schedule
        # The anchor copy: the global model, whose parameters the outer optimizer steps.
        self.global_model = copy.deepcopy(self.model)
        self.anchors = list(self.global_model.parameters())
        self.outer_optimizer = self.ctx.optimizer_builder(self.anchors, self.options.outer_settings())
        self.sync = OuterSync(self.comm, self.outer_optimizer, self.optimizer, self.policy(), self.wire_dtype())
        self.fragments = self.make_fragments()

    def wire_dtype(self) -> torch.dtype:
        """The dtype the pseudo-gradients are sent in."""
        return torch.float32

    def make_fragments(self) -> list[Fragment]:
        """DiLoCo: one fragment, the whole model."""
        buffers = [buffer for buffer in self.model.buffers() if buffer.dtype.is_floating_point]
        return [Fragment(0, list(self.model.parameters()), self.anchors, buffers)]

    def global_reduction(self) -> None:
        """The family's global reduction, here an outer step (the schedule calls it); the
        family's variance V is not measured."""
        with self.comm.reduction():
            exchange = self.sync.launch(self.fragments[0], self._steps - 1, blocking=True)
        self.sync.apply(exchange, alpha=0.0)

    @property
    def eval_model(self) -> nn.Module:
        if self.options.evaluate == "global":
            with torch.no_grad():  # the anchor with this rank's buffers
                for mine, local in zip(self.global_model.buffers(), self.model.buffers(), strict=True):
                    mine.copy_(local)
            return self.global_model
        return super().eval_model

    def state_dict(self) -> dict:
        return {**super().state_dict(), "anchors": [anchor.detach().clone() for anchor in self.anchors],
                "outer_optimizer": copy.deepcopy(self.outer_optimizer.state_dict())}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "anchors" in state:
            for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
                anchor.copy_(saved)
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
