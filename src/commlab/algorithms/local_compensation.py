"""Local update rules of SSD-SGD / OD-SGD (Xu et al., arXiv 2012.05396, 2005.06728): how a worker moves its local
replica with its own gradient while the global (allreduce-averaged) update is still in flight.

Every rule turns the worker's own gradient ``g`` into a *local direction* ``d``; the local
optimizer (the optimizer the training loop steps, which SSD-SGD declares as SGD at
``local_lr_scale`` times the run's learning rate: :class:`commlab.loop.optim.ScaledSGD`) then applies
``w <- w - lr * lr_scale * (d + weight_decay * w)`` (plus optional local momentum).

=========  ===========================================================================
rule       direction
=========  ===========================================================================
sgd        ``d = g`` (plain local SGD, no compensation)
dcasgd     ``d = g + lam * g * g * (w_now - w_grad)``: the delay compensation of DC-ASGD
           (Zheng et al. 2017) for a gradient computed at ``w_grad`` and applied at
           ``w_now``; with ``adaptive`` (DC-ASGD-a) ``lam = lambda / sqrt(MS + eps)``,
           ``MS = m * MS + (1 - m) * g * g``
glu        ``d = (1 - beta) * g + beta * g_global``: global gradient for local update
=========  ===========================================================================

GLU is a reconstruction (the released kernel is broken and the paper's full text was not at
hand): "use the latest global gradient to correct the delayed local weights". We read it as
mixing the worker's own gradient with the latest global signal the worker holds: by default the
latest allreduce-averaged gradient (``glu_source: gradient``: the gradient of P workers, a
lower-variance estimate of the step the local replica is missing), or the global replica's latest
update divided by its learning rate (``glu_source: update``: momentum included, what a
parameter-server worker sees from two successive pulls, as the weight-difference term of the
released code's local optimizers). ``beta`` is configurable; ``beta = 0`` is plain local SGD.

``w_now`` differs from ``w_grad`` only on the steps where the local replica was just overwritten
by the global one (every k steps), so ``dcasgd`` compensates exactly there.
"""

from __future__ import annotations

import torch

from commlab.algorithms.tensors import restore_into


class LocalRule:
    """Base class: turns the worker's own gradient into the local direction (flat tensors)."""

    needs_global_grad = False  # whether the caller must keep the latest averaged gradient

    def direction(self, grad: torch.Tensor, shift: torch.Tensor | None,
                  global_grad: torch.Tensor | None) -> torch.Tensor:
        """``grad``: this worker's gradient, computed at ``w_grad``; ``shift``: ``w_now - w_grad``
        (None when the local replica was not replaced since the gradient was computed);
        ``global_grad``: the latest allreduce-averaged gradient held by this worker."""
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
    """GLU (reconstruction): mix the own gradient with the latest averaged global gradient."""

    needs_global_grad = True

    def __init__(self, options):
        self.beta = float(options.glu_weight)

    def direction(self, grad, shift, global_grad):
        if global_grad is None:
            return grad
        return torch.lerp(grad, global_grad, self.beta)


# Rule name -> class; the Options field ``local_optimizer`` picks one.
LOCAL_RULES: dict[str, type[LocalRule]] = {
    "sgd": PlainLocal,
    "dcasgd": DelayCompensated,
    "glu": GlobalGradientLocal,
}
