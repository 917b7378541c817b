"""Trimmed top-k selection (RedSync, Fang et al., arXiv 1808.04357, as released: layers of 1M-4M elements).

An exact top-k over a whole large layer is slow; RedSync first *trims* the layer to the few
entries above a coarse threshold and runs the exact top-k on those survivors only::

    thr(r) = mean|v| + r * (max|v| - mean|v|),   r = 0.9, 0.8, ..., 0.0

lowering ``r`` until at least ``k`` entries survive (``|v| > thr``), then ``torch.topk`` on the
survivors. The result is **exactly** the top-k (up to ties, which ``torch.topk`` breaks): the
survivors are a top set holding at least k entries, so their k largest are the tensor's k largest.
We find the release's ``r`` (the first of the ten with enough survivors) by bisection over the ten
ratios instead of scanning them in order: about four counting passes, the later ones over the
survivors of an earlier probe rather than the whole layer.

Where we depart from the release (feifeibear/89757, ``select_trim_topk``): the release keeps
lowering ``r`` below 0 in steps of 0.1 until enough survive, which takes arbitrarily many passes
when the maximum is close to the mean (nearly equal magnitudes). We stop at ``r = 0`` and, if
fewer than k entries exceed the mean, run the exact top-k on the whole tensor: a bounded number
of passes on any input.

Usage::

    select = SELECTORS.get("trimmed_topk")()
    idx = select(v, k)                       # int64 indices of exactly min(k, n) entries
"""

from __future__ import annotations

import math

import torch

from commlab.compress.binary_search import COMPACT_FRACTION, Workspace
from commlab.registry import SELECTORS

RATIOS = tuple(i / 10 for i in range(9, -1, -1))  # 0.9, 0.8, ..., 0.0 as in the release


def trimmed_topk(x: torch.Tensor, k: int, ratios: tuple[float, ...] = RATIOS,
                 workspace: Workspace | None = None) -> torch.Tensor:
    """Indices (int64) of the ``k`` entries of ``x.view(-1)`` with the largest |x|.

    ``ratios`` must decrease; ``workspace`` lends reusable |x| and mask buffers."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    flat = x.reshape(-1)
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    ws = workspace if workspace is not None else Workspace()
    a = ws.abs(flat)
    mean, top = float(a.mean()), float(a.max())
    if not (math.isfinite(mean) and math.isfinite(top)):
        raise ValueError("trimmed_topk: the tensor holds NaN or infinite values")
    if top > mean:
        # The release scans r = 0.9, 0.8, ... and stops at the first r leaving >= k survivors. The
        # count only grows as r falls, so a bisection over the ten ratios finds the same r in about
        # four probes. Once a probe leaves few enough survivors (COMPACT_FRACTION of n), they are
        # gathered and the later, higher thresholds are counted among them only.
        work, work_idx = a, None  # candidates: all of `a`, or the survivors of an earlier probe
        lo, hi = 0, len(ratios)  # the answer is the first index i in [lo, hi] with >= k survivors
        while lo < hi:
            mid = (lo + hi) // 2
            mask = ws.above(work, mean + ratios[mid] * (top - mean))
            count = int(torch.count_nonzero(mask))
            if count >= k:
                hi = mid
                if count <= COMPACT_FRACTION * n:
                    sel = torch.nonzero(mask).view(-1)
                    work_idx = sel if work_idx is None else work_idx[sel]
                    work = a[work_idx]
            else:
                lo = mid + 1
        if lo < len(ratios):
            sel = torch.nonzero(ws.above(work, mean + ratios[lo] * (top - mean))).view(-1)
            survivors = sel if work_idx is None else work_idx[sel]
            best = torch.topk(a[survivors], k, sorted=False).indices
            return survivors[best]
    # Fewer than k entries above the mean (or all magnitudes equal): select on the whole tensor.
    return torch.topk(a, k, sorted=False).indices


@SELECTORS.register("trimmed_topk")
class TrimmedTopk:
    """:func:`trimmed_topk` with buffers reused between calls (no other state)."""

    def __init__(self):
        self.workspace = Workspace()

    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return trimmed_topk(x, k, workspace=self.workspace)
