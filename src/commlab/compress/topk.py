"""Exact top-k by magnitude: the reference every estimated selector is tested against."""

from __future__ import annotations

import torch

from commlab.registry import SELECTORS


def exact_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64) of the ``k`` entries of ``x.view(-1)`` with the largest |x|."""
    flat = x.reshape(-1)
    k = min(k, flat.numel())
    return torch.topk(flat.abs(), k, sorted=False).indices


@SELECTORS.register("exact_topk")
class ExactTopk:
    """Stateless wrapper of :func:`exact_topk`."""

    exact_count = True  # returns exactly min(k, n) indices (the count every rank can know)

    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return exact_topk(x, k)
