"""The outer step that DiLoCo and Streaming DiLoCo share (Douillard et al., arXiv 2311.08105,
Algorithm 1; arXiv 2501.18512): the anchor (the global model), the outer optimizer over it, the
averaged pseudo-gradient, and the options of both methods.

The two methods are :mod:`commlab.algorithms.diloco` (one outer step of the whole model every H
steps) and :mod:`commlab.algorithms.streaming_diloco` (an outer step of one fragment of the model at
a time, started early, mixed with the local model). What they share lives here:

* :class:`OuterOptions`: the period H, the outer optimizer (``nesterov`` | ``sgd`` | ``adam``,
  ``outer_lr``, ``outer_momentum``, ``outer_betas``), ``evaluate``, and the periodic family's
  policies (:class:`~commlab.algorithms.periodic.FamilyOptions`);
* :class:`Fragment`: a set of parameters with outer steps of their own, with their anchors and
  the floating buffers that go with them (DiLoCo: one fragment, the whole model);
* :class:`OuterSync`: one outer step of a fragment, in two halves. :meth:`OuterSync.launch`
  sends ``anchor - x`` (in the wire dtype, summed over the ranks) with the tensors the policy
  averages, blocking or asynchronously; :meth:`OuterSync.apply` divides the sum by P, steps the
  outer optimizer with it as the anchors' gradient, resets the replica to the anchor and mixes it
  with its local value by ``alpha``: x = (1 - alpha) * theta + alpha * x_local (alpha 0: theta);
* :class:`OuterStepAveraging`: the periodic-averaging method both are, with the anchor copy and
  the outer optimizer built at setup, evaluation of the anchor, and their checkpoint.

Invariants: every rank holds the same anchors and outer-optimizer state (the same summed
pseudo-gradient, a deterministic step); after an outer step with alpha 0 every replica equals
the anchor of the fragment bit for bit; an outer step of a fragment is one allreduce per dtype
(the pseudo-gradient and the averaged tensors of the wire's dtype in one message).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from commlab.algorithms.context import OptimizerSettings
from commlab.algorithms.periodic import AveragingPolicy, FamilyOptions, FixedSchedule, PeriodicAveraging
from commlab.algorithms.tensors import flatten
from commlab.core.communicator import Communicator, Pending
from commlab.options import Alias

OUTER_OPTIMIZERS = ("nesterov", "sgd", "adam")
EVALUATE = ("rank0", "global", "average")


@dataclass
class OuterOptions(FamilyOptions):
    """DiLoCo's options (after the family's ``buffers``, ``optimizer_state`` and
    ``final_average``), which Streaming DiLoCo extends; ``sync_every`` (torchft's name) is an
    alias of ``period``."""

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
    """A fragment's outer step between :meth:`OuterSync.launch` and :meth:`OuterSync.apply`."""

    fragment: Fragment
    messages: list[Message]
    bytes_sent: int  # what this rank's Communicator counted for it


class OuterSync:
    """Launches and applies outer steps (the module docstring): the pseudo-gradient ``anchor - x``
    sent in ``wire_dtype``, summed over the ranks and divided by P in the anchors' dtype; the
    other tensors of the policy averaged in their own dtype."""

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

    def averaged_by_dtype(self, fragment: Fragment) -> dict[torch.dtype, list[torch.Tensor]]:
        """:meth:`averaged_state`, grouped by dtype (one message per dtype)."""
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in self.averaged_state(fragment):
            groups.setdefault(tensor.dtype, []).append(tensor)
        return groups

    @torch.no_grad()
    def launch(self, fragment: Fragment, blocking: bool = True) -> Exchange:
        """Start the fragment's allreduces (call inside ``comm.reduction()``): blocking, or
        asynchronous (``comm.all_reduce_async``, waited in :meth:`apply`)."""
        grads = torch.cat([(anchor - param).reshape(-1)
                           for anchor, param in zip(fragment.anchors, fragment.params, strict=True)])
        grads = grads.to(self.wire_dtype)
        by_dtype = self.averaged_by_dtype(fragment)
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
        return Exchange(fragment, messages, self.comm.stats.counters["bytes_sent"] - before)

    @staticmethod
    def complete(exchange: Exchange) -> None:
        """Wait for the exchange's allreduces (the Communicator records the blocked time)."""
        for message in exchange.messages:
            if message.pending is not None:
                message.pending.wait()
                message.pending = None

    @torch.no_grad()
    def apply(self, exchange: Exchange, alpha: float = 0.0) -> None:
        """The outer step of the exchange's fragment with its averaged pseudo-gradient, the
        replica then mixed by ``alpha`` with its value now (0: the anchor)."""
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


class OuterStepAveraging(PeriodicAveraging):
    """A periodic-averaging method whose global reduction is an outer optimizer step on the
    pseudo-gradient (the module docstring): at setup the anchor copy of the model (``global_model``,
    its parameters ``anchors``), the outer optimizer over it and the :class:`OuterSync` (``sync``).
    The schedule is fixed (after every H-th step, and after the last with ``final_average``); its
    counts are the family's ``syncs``. A subclass says when outer steps happen."""

    Options = OuterOptions

    def make_schedule(self) -> FixedSchedule:
        options = self.options
        return FixedSchedule(options.period, options.period, self.ctx.total_steps, 0, "last", options.final_average)

    def policy(self) -> AveragingPolicy:
        options = self.options
        return AveragingPolicy(buffers=options.buffers, optimizer_state=options.optimizer_state,
                               evaluate="average" if options.evaluate == "average" else "rank0")

    def wire_dtype(self) -> torch.dtype:
        """The dtype the pseudo-gradients are sent in."""
        return torch.float32

    def setup(self) -> None:
        super().setup()  # every replica starts from rank 0's model; the schedule
        # The anchor copy: the global model, whose parameters the outer optimizer steps.
        self.global_model = copy.deepcopy(self.model)
        self.anchors = list(self.global_model.parameters())
        self.outer_optimizer = self.ctx.optimizer_builder(self.anchors, self.options.outer_settings())
        self.sync = OuterSync(self.comm, self.outer_optimizer, self.optimizer, self.policy(), self.wire_dtype())

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
