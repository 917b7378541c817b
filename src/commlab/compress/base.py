"""The selector contract shared by every sparse method and the selection benchmark.

A *selector* picks the indices of (about) the k largest-magnitude entries of a flat tensor::

    select = SELECTORS.get("exact_topk")()      # a fresh selector (it may keep state: thresholds)
    idx = select(x, k)                          # int64 indices into x.view(-1)

Registered selectors are found by name in :data:`commlab.registry.SELECTORS`; `commlab bench
selection` times every registered one against ``torch.topk`` and one read of the tensor. Indices
always live in integer tensors: :func:`index_dtype` gives the narrowest exact one for ``n``. A
selector class whose calls always return exactly ``min(k, n)`` indices says so with
``exact_count = True``: every rank then knows every rank's count, and a gather of them is saved
(RedSync, DGC). Threshold selectors are built from the passes of :mod:`commlab.compress.scan`.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from commlab.core.sparse import index_dtype  # noqa: F401 - the selectors' index type, defined in core


class Selector(Protocol):
    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (int64) of about ``k`` entries of ``x.view(-1)`` with the largest |x|."""


def k_for_density(n: int, density: float) -> int:
    """k = ceil(density * n), at least 1 (the papers' notation: density rho, k = ceil(rho * n))."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    # The epsilon keeps float noise (0.01 * 1000 = 10.000000000000002) from adding one.
    return min(n, max(1, math.ceil(density * n - 1e-9)))
