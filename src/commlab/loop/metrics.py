"""What the loop measures at a log point: the control allreduce and the metric record.

The control allreduce is instrumentation, not the method's traffic, so it goes through the
uncounted control channel (:mod:`commlab.core.control`), not the Communicator: one tiny tensor
that averages the loss window over the ranks, spreads a SIGTERM seen by any rank (all checkpoint
at the same step) and counts ranks with a non-finite loss.
"""

from __future__ import annotations

import math

import torch

from commlab.core.control import ControlChannel


class NonFiniteLoss(RuntimeError):
    """A rank's training loss became inf or NaN."""


def control(window_loss: float, window_n: int, stop_requested: bool,
            channel: ControlChannel) -> tuple[float, bool, int]:
    """One tiny allreduce: global mean loss, whether any rank was asked to stop, non-finite count."""
    finite = math.isfinite(window_loss)
    t = torch.tensor([window_loss if finite else 0.0, window_n, float(stop_requested), float(not finite)],
                     dtype=torch.float64, device=channel.device)
    channel.all_reduce(t)
    return t[0].item() / max(1.0, t[1].item()), t[2].item() > 0, int(t[3].item())


def step_metrics(totals: dict, extra: dict, loss: float, lr: float, step: int, epoch: int,
                 samples: int, compute_s: float, wall_s: float) -> dict:
    """One log point: the loop's own figures, the Communicator's totals, the method's ``algo_*``."""
    metrics = {"train_loss": loss, "lr": lr, "epoch": epoch, "samples": samples,
               "compute_seconds": compute_s, "wall_seconds": wall_s}
    metrics.update(totals)
    metrics.update({f"algo_{k}": v for k, v in extra.items()})
    return metrics
