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

A rule may also return no direction: the loop's optimizer then skips the step (weight decay
included) and the local replica stays where it is.

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

    * ``released``: what SSD's ``--optimizer-local GLU`` computes. ``GLU.update``
      (``python/mxnet/optimizer/optimizer.py:1212-1249``) only snapshots the weight every fifth
      call (its one computation, COSDCASGD's correction term over 32, is commented out), and
      ``src/operator/optimizer_op-inl.h:60-62`` holds an empty "glu-update" section: no local
      update at all. The local replica stays at the last
      refreshed global weights, so the workers compute on weights 1 to k global updates old,
      uncompensated: SSGD with delayed gradients. Here: no direction.
    * ``described``: our reading of the paper's words, a local step that uses the latest global
      gradient the worker holds (the one it received at the last refresh, or at the last warm-up
      step), ``g_global``::

          d = (1 - beta) * g + beta * g_global

      with ``glu_source: gradient``: ``g_global`` = the latest allreduce-averaged gradient; with
      ``glu_source: update``: the global replica's latest step divided by its learning rate
      (momentum included; what a parameter-server worker sees from two successive pulls, the
      quantity of the weight-difference terms in the release's local optimizers). ``beta = 0`` is
      plain local SGD; the defaults are ``beta = 0.5`` and the averaged gradient. ``g_global`` is
      the same for the k local steps of a period: one step old at a refresh, k steps old at the
      period's last step.
"""

from __future__ import annotations

import torch

from commlab.algorithms.tensors import restore_into

# glu_reading: the paper's words (a local step with the latest global gradient) or the release's code
# (no local step).
GLU_READINGS = ("described", "released")


class LocalRule:
    """Base class: turns the worker's own gradient into the local direction (flat tensors)."""

    needs_global_grad = False  # whether the caller must keep the latest global gradient

    def direction(self, grad: torch.Tensor, shift: torch.Tensor | None,
                  global_grad: torch.Tensor | None) -> torch.Tensor | None:
        """``grad``: this worker's gradient, computed at ``w_grad``; ``shift``: ``w_now - w_grad``
        (None when the local replica was not replaced since the gradient was computed);
        ``global_grad``: the latest global gradient this worker holds. None: no local step."""
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
    """GLU as described: mix the own gradient with the latest global gradient the worker holds."""

    needs_global_grad = True

    def __init__(self, options):
        self.beta = float(options.glu_weight)

    def direction(self, grad, shift, global_grad):
        if global_grad is None:
            return grad
        return torch.lerp(grad, global_grad, self.beta)


class NoLocalUpdate(LocalRule):
    """GLU as released: no local step; the local replica keeps the last refreshed global weights."""

    def __init__(self, options=None):
        pass

    def direction(self, grad, shift, global_grad):
        return None


def build_rule(options) -> LocalRule:
    """The local rule ``options.local_optimizer`` names (GLU in the reading ``options.glu_reading``)."""
    if options.local_optimizer == "glu" and options.glu_reading == "released":
        return NoLocalUpdate(options)
    return LOCAL_RULES[options.local_optimizer](options)


# Rule name -> class; the Options field ``local_optimizer`` picks one (build_rule applies glu_reading).
LOCAL_RULES: dict[str, type[LocalRule]] = {
    "sgd": PlainLocal,
    "dcasgd": DelayCompensated,
    "glu": GlobalGradientLocal,
}
