"""Model-averaging pieces shared by the periodic-averaging methods (Cong et al., ICPP'19 Workshops).

Cong, Yang and Zhou (ICPP'19 workshops) reduce *models*, not gradients: every worker takes local
optimizer steps and, on a schedule, the replicas are replaced by their average over a group (a
local reduction) or over the world (a global reduction). This module holds what such methods
share, on top of the two primitives of ``base.py`` (``average_tensors``, ``broadcast_model``):

* :func:`is_due`: the reduction schedule (which optimizer steps end a period);
* :func:`sync_tensors` / :func:`average_replicas`: which tensors a reduction averages (parameters
  always; BN buffers and optimizer state by explicit policy);
* :class:`ReductionMomentum`: block momentum on the global update (BMUF / SlowMo style), plain or
  Nesterov;
* :func:`averaged_copy`: the world-average model used for evaluation (instrumentation, not
  counted as the method's traffic: it goes through the control channel).

No public code exists for the paper; the reading implemented here (a reconstruction) is that of
BMUF (Chen & Huo, ICASSP 2016) with the block learning rate ``zeta`` as an option::

    d = mean(x_i) - anchor          # the world's displacement since the last global reduction
    v = mu * v + zeta * d           # block momentum
    anchor = anchor + v             # the new global model
    x_i = anchor                    # plain ("classical block momentum")
    x_i = anchor + mu * v           # Nesterov: workers restart from the look-ahead point

With ``mu = 0`` and ``zeta = 1`` this is exactly model averaging.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from commlab.algorithms.base import average_tensors
from commlab.algorithms.tensors import flatten, unflatten_into
from commlab.core.communicator import Communicator
from commlab.core.control import ControlChannel

PHASES = ("last", "first")
POLICIES = ("keep_local", "average")


def is_due(step: int, period: int, start: int = 0, phase: str = "last") -> bool:
    """Whether optimizer step ``step`` (0-based) ends a reduction period.

    Steps before ``start`` (the synchronous warm-up) never do. ``phase="last"`` reduces after the
    period's last local step (steps start+K-1, start+2K-1, ...: K local steps then a reduction,
    as K-AVG counts); ``phase="first"`` reduces after its first one (steps start, start+K, ...),
    the convention of torch's PeriodicModelAverager."""
    if step < start:
        return False
    t = step - start
    return (t + 1) % period == 0 if phase == "last" else t % period == 0


def sync_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None, buffers: str,
                 optimizer_state: str) -> list[torch.Tensor]:
    """The tensors one model reduction averages: every parameter, then (by policy) the floating
    point buffers (BN running statistics; integer counters stay local) and the optimizer's
    per-parameter state tensors (momentum buffer, Adam moments; not the step count)."""
    tensors = [p.data for p in model.parameters()]
    if buffers == "average":
        tensors += [b for b in model.buffers() if b.dtype.is_floating_point]
    if optimizer_state == "average" and optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for value in optimizer.state.get(p, {}).values():
                    if torch.is_tensor(value) and value.shape == p.shape and value.dtype.is_floating_point:
                        tensors.append(value)
    return tensors


def average_replicas(tensors: list[torch.Tensor], comm: Communicator) -> None:
    """Average ``tensors`` over ``comm``'s ranks: one allreduce per dtype (normally exactly one)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        average_tensors(group, comm)


def average_and_probe(tensors: list[torch.Tensor], comm: Communicator, probe_numel: int) -> float | None:
    """Average ``tensors`` over the ranks (:func:`average_replicas`); if ``probe_numel`` > 0 return
    the variance V = mean_i ||x_i - x_bar||^2 of their first ``probe_numel`` elements (one scalar
    allreduce: each rank's squared distance to the average, averaged). Call inside
    ``comm.reduction()``."""
    before = flatten(tensors)[:probe_numel] if probe_numel else None
    average_replicas(tensors, comm)
    if before is None:
        return None
    after = flatten(tensors)[:probe_numel]
    local = (before.double() - after.double()).pow(2).sum().reshape(1)
    comm.all_reduce(local, op="avg")
    return float(local.item())


class ReductionMomentum:
    """Block momentum applied to the global update (see the module docstring for the formulas).

    ``anchor`` is the global model after the previous global reduction; every rank holds the same
    anchor and velocity, so applying the update needs no communication beyond the average."""

    def __init__(self, params: list[torch.Tensor], mu: float, zeta: float = 1.0, nesterov: bool = False):
        self.params = params
        self.mu, self.zeta, self.nesterov = mu, zeta, nesterov
        self.anchor = [p.detach().clone() for p in params]
        self.velocity = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Take the current (identical on every rank) parameters as the global model."""
        for a, p in zip(self.anchor, self.params, strict=True):
            a.copy_(p)

    @torch.no_grad()
    def apply(self) -> None:
        """The parameters hold the world average; turn it into the momentum global step."""
        for p, a, v in zip(self.params, self.anchor, self.velocity, strict=True):
            v.mul_(self.mu).add_(p - a, alpha=self.zeta)
            a.add_(v)
            p.copy_(a)
            if self.nesterov:
                p.add_(v, alpha=self.mu)

    def state_dict(self) -> dict:
        return {"anchor": [a.clone() for a in self.anchor], "velocity": [v.clone() for v in self.velocity]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for a, s in zip(self.anchor, state["anchor"], strict=True):
            a.copy_(s)
        for v, s in zip(self.velocity, state["velocity"], strict=True):
            v.copy_(s)


@torch.no_grad()
def averaged_copy(model: nn.Module, control: ControlChannel) -> nn.Module:
    """A copy of ``model`` whose floating-point parameters and buffers are the average over the
    control channel's ranks: what one more global reduction would produce. Collective (every rank
    calls it). It serves evaluation, so it goes through the uncounted control channel: this
    traffic is not the method's."""
    if control.size == 1:
        return model
    clone = copy.deepcopy(model)
    tensors = [t for t in clone.state_dict().values() if t.dtype.is_floating_point]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group_tensors in by_dtype.values():
        flat = flatten(group_tensors)
        control.all_reduce(flat, op="avg")
        unflatten_into(flat, group_tensors)
    return clone
