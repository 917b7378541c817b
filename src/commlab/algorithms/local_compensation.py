"""Local update rules of SSD-SGD / OD-SGD (Xu et al., arXiv 2012.05396 and 2005.06728): how a worker
moves its local replica with its own gradient while the global (allreduce-averaged) update is in
flight.

Notation. ``w``: the local replica; ``g``: this worker's mean gradient, taken at ``w_grad`` (the
local replica when the batch was computed); ``w_now - w_grad``: the shift of the local replica
since then (non-zero only at a refresh, when the global replica overwrote it); ``eta_l``: the
local learning rate; ``wd``: the run's weight decay. A rule turns ``g`` into a *direction* ``d``;
the local optimizer the training loop steps (:class:`commlab.loop.optim.ScaledSGD`, declared by
``commlab.algorithms.delayed``) then applies, with local momentum 0 as in every released script::

    w <- w - eta_l * (d + wd * w)

A rule may instead write the local replica itself (``writes_replica``: GLU as released, below):
the loop's optimizer then skips the step (weight decay included).

Sources. The SSD-SGD paper's GLU formula was not found (only its abstract: "global gradient for
local update (GLU) ... to effectively compensate the delayed local weights"); the release is
main-520/SSD-SGD (SSD) and CynthiaProtector/OD-SGD (OD), modified MXNet. Paths and lines are theirs.

``sgd``: plain local SGD, ``d = g``.
    SSD and OD ``--optimizer-local sgd`` (MXNet SGD, ``--mom-local 0``): ``w <- (1 - eta_l wd) w
    - eta_l g``. The release's ``g`` is the worker's gradient over ``batch x workers`` (``rescale_grad
    = 1/(batch x N)``, SSD ``python/mxnet/module/module.py:511-530``): the mean gradient / N. The
    method's ``local_rescale: release`` reproduces that division (see commlab.algorithms.delayed).

``dcasgd``: DC-ASGD's delay compensation (Zheng et al., arXiv 1609.08326: DC-ASGD and its
adaptive variant DC-ASGD-a)::

    d = g + lam * g * g * (w_now - w_grad)
    lam = lambda_0 / sqrt(MS + 1e-7),   MS <- m * MS + (1 - m) * g * g   (adaptive; else lam = lambda_0)

    MS is updated at every local step. The releases build other rules under DC-ASGD's name, none of
    them this one: OD ``DCASGD`` (``python/mxnet/optimizer.py:609-632``, kernel
    ``src/operator/optimizer_op-inl.h:67-96`` launched with lambda and wd swapped) computes
    ``w <- w - eta_l (0.04 w + g + 1e-4 g*g*(w - prev))``; OD ``CADCASGD`` (``optimizer.py:743-773``)
    and SSD ``CPPADCASGD`` (SSD ``python/mxnet/optimizer/optimizer.py:1124-1157``,
    ``optimizer_op-inl.h:216-252``), their scalars also launched out of order, compute
    ``w <- w - eta_l (r w + g + (wd / sqrt(MS)) g*g*(w - prev))`` with ``MS = g*g + 1e-7``
    (``m = 0``) and ``r`` the gradient's rescale factor; SSD ``COSDCASGD`` (same file, lines
    1176-1209) computes ``w <- w - eta_l (2 g + wd w + ((1 - eta_l wd) prev - w) / 16)``. Their ``prev`` is the
    local copy before the previous call, so ``w - prev`` is the last local step plus, right after a
    pull, the jump to the global weights. They are not built here.

``glu``: global gradient for local update, two readings (option ``glu_reading``):

    * ``described`` (default): a hypothesis of ours, built from the paper's words; the mixing
      weight ``beta`` (``glu_weight``, default 0.5) and the global signal (``glu_source``) are our
      choices, not the paper's. A local step that uses the latest global gradient the worker holds
      (the one it received at the last refresh, or at the last warm-up step), ``g_global``::

          d = (1 - beta) * g + beta * g_global

      with ``glu_source: gradient`` (default): ``g_global`` = the latest allreduce-averaged
      gradient, the average of one step's gradients; with ``glu_source: update``: the global
      replica's latest step divided by its learning rate (momentum included; what a
      parameter-server worker sees from two successive pulls, the quantity of the
      weight-difference terms in the release's local optimizers). ``beta = 0`` is plain local SGD.
      ``g_global`` is the same for the k local steps of a period: one step old at a refresh, k
      steps old at the period's last step.
    * ``released``: what SSD's ``--optimizer-local GLU`` computes as its code runs. ``GLU.update``
      (``python/mxnet/optimizer/optimizer.py:1229-1249``) has its correction lines commented out
      and one live line, indented with a tab (line 1244)::

          dc_sgd_update(weight, grad, previous_weight_s, out = weight, lr = lr, wd = wd, lam = self.lamda)

      Python 3 refuses the file (TabError); under Python 2 (a tab is 8 columns) the line runs. Its
      kernel (``src/operator/optimizer_op-inl.h:110-121``, DCKernel) writes
      ``out = -lr * (wd' * w + g + (prev - w) * 0.5)``, its scalars declared (clip, lr, lam, wd,
      rescale_grad) but launched by DCUpdate (lines 137-141) as (clip, lr, wd, rescale_grad, lam):
      ``wd'`` is the call's ``rescale_grad``, which the call does not pass (DCParam's default 1.0,
      lines 82-84), and the call's wd and lambda land in slots the formula does not read. With
      ``out = weight`` the kernel's output *replaces* the weight, where the file's other user of
      the kernel writes it to ``inter`` and adds it (CPPDCASGD, lines 990-992)::

          w <- -eta_l * (w + g + 0.5 * (prev - w))

      ``g``: the gradient the local optimizer is given (``grad * rescale_grad``, line 1236: the
      mean gradient / N, ``local_rescale: release``); ``eta_l``: its learning rate; no weight
      decay, momentum or lambda enters. ``prev`` (``previous_weight_s``) is the weight when the
      parameter's state was created (``create_state``, lines 1221-1227, at its first call), then
      the weight just written whenever the call counter ``self.local_num`` is a multiple of 5
      (lines 1247-1249). That counter is the optimizer's, not the parameter's: it counts one call
      per parameter per iteration (``kvstore_dist.h:423-433`` inside each key's push, in the
      parameters' order, ``model.py:145-155``), so parameter j of P is snapshotted at its n-th
      local step when ``(n * P + j) % 5 == 0``. This is no compensation: each step replaces the
      replica by about ``-eta_l`` times the mean of it and its snapshot (the GLU scripts'
      ``--lr-local``: 1.6 and 3.2), so the workers compute on weights of flipped sign and another scale, never
      (after the warm-up) on the global weights themselves, since a refresh is followed by a local
      step. The paper's GLU cannot be recovered from it. Here: the same arithmetic per parameter,
      in the model's parameter order (the release's is the symbol's argument order: the order
      decides which parameters are snapshotted), ``eta_l`` the local learning rate
      (``local_lr_scale`` x the run's, or ``local_lr`` on its schedule), the gradient divided by
      the workers with ``local_rescale: release``, the method's clipping not applied (the
      release's GLU clips only with ``clip_gradient``, which no script sets).
"""

from __future__ import annotations

import torch

from commlab.algorithms.tensors import restore_into

# glu_reading: our hypothesis from the paper's words (a local step with the latest global gradient)
# or the release's code (its kernel's output written over the local replica).
GLU_READINGS = ("described", "released")
SNAPSHOT_EVERY = 5  # GLU.update: previous_weight_s is retaken when the call counter % 5 == 0


class LocalRule:
    """Base class: turns the worker's own gradient into the local direction (flat tensors), or
    (``writes_replica``) writes the local replica itself."""

    needs_global_grad = False  # whether the caller must keep the latest global gradient
    writes_replica = False  # whether the caller must call write_replica instead of direction

    def direction(self, grad: torch.Tensor, shift: torch.Tensor | None,
                  global_grad: torch.Tensor | None) -> torch.Tensor:
        """``grad``: this worker's gradient, computed at ``w_grad``; ``shift``: ``w_now - w_grad``
        (None when the local replica was not replaced since the gradient was computed);
        ``global_grad``: the latest global gradient this worker holds."""
        raise NotImplementedError

    def write_replica(self, weights: list[torch.Tensor], grads: list[torch.Tensor], lr: float) -> None:
        """Overwrite ``weights`` (the local replica, one tensor per parameter in the model's order,
        in place) from ``grads`` (the gradients the local optimizer is given) and the local
        learning rate ``lr``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        """Restore :meth:`state_dict`'s tensors onto ``device`` (the replica's)."""


class PlainLocal(LocalRule):
    """Plain local SGD: the worker's own gradient, uncompensated."""

    def __init__(self, options=None):
        pass

    def direction(self, grad, shift, global_grad):
        return grad


class DelayCompensated(LocalRule):
    """DC-ASGD: first-order Taylor correction of a gradient applied away from where it was taken."""

    def __init__(self, options):
        self.lam = float(options.dc_lambda)
        self.adaptive = bool(options.dc_adaptive)
        self.decay = float(options.dc_ms_decay)
        self.eps = 1e-7
        self.mean_square: torch.Tensor | None = None

    def direction(self, grad, shift, global_grad):
        if self.adaptive:
            # Running mean square of the gradient, updated every local step (DC-ASGD-a).
            if self.mean_square is None:
                self.mean_square = torch.zeros_like(grad)
            self.mean_square.mul_(self.decay).addcmul_(grad, grad, value=1.0 - self.decay)
        if shift is None:
            return grad
        lam = self.lam / torch.sqrt(self.mean_square + self.eps) if self.adaptive else self.lam
        return grad + lam * grad * grad * shift

    def state_dict(self) -> dict:
        return {"mean_square": self.mean_square}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        self.mean_square = restore_into(self.mean_square, state.get("mean_square"), device)


class GlobalGradientLocal(LocalRule):
    """GLU as we read the paper (a hypothesis): mix the own gradient with the latest global
    gradient the worker holds."""

    needs_global_grad = True

    def __init__(self, options):
        self.beta = float(options.glu_weight)

    def direction(self, grad, shift, global_grad):
        if global_grad is None:
            return grad
        return torch.lerp(grad, global_grad, self.beta)


class ReleasedGLU(LocalRule):
    """GLU as released: DCKernel's output, scalars as launched, written over the local replica;
    the snapshot ``prev`` retaken on every fifth call of the optimizer's one call counter."""

    writes_replica = True

    def __init__(self, options=None):
        self.previous: list[torch.Tensor] | None = None  # previous_weight_s, one per parameter
        self.calls = 0  # GLU.local_num: calls over all parameters

    def write_replica(self, weights, grads, lr):
        if self.previous is None:  # create_state at the first call: weight.copy()
            self.previous = [w.detach().clone() for w in weights]
        for w, g, prev in zip(weights, grads, self.previous, strict=True):
            # -lr * (param_wd * w + g + (prev - w) * 0.5), param_wd = the unset rescale_grad = 1
            w.copy_(-lr * (w + g + (prev - w) * 0.5))
            if self.calls % SNAPSHOT_EVERY == 0:
                prev.copy_(w)
            self.calls += 1

    def state_dict(self) -> dict:
        return {"previous": self.previous, "calls": self.calls}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        saved = state.get("previous")
        if saved is None or self.previous is None:
            self.previous = None if saved is None else [restore_into(None, s, device) for s in saved]
        else:
            self.previous = [restore_into(live, s) for live, s in zip(self.previous, saved, strict=True)]
        self.calls = int(state.get("calls", 0))


def build_rule(options) -> LocalRule:
    """The local rule ``options.local_optimizer`` names (GLU in the reading ``options.glu_reading``)."""
    if options.local_optimizer == "glu" and options.glu_reading == "released":
        return ReleasedGLU(options)
    return LOCAL_RULES[options.local_optimizer](options)


# Rule name -> class; the Options field ``local_optimizer`` picks one (build_rule applies glu_reading).
LOCAL_RULES: dict[str, type[LocalRule]] = {
    "sgd": PlainLocal,
    "dcasgd": DelayCompensated,
    "glu": GlobalGradientLocal,
}
