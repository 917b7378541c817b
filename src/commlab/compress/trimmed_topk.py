"""Trimmed top-k selection (RedSync, Fang et al., arXiv 1808.04357, as released: layers of 1M-4M elements).

An exact top-k over a whole large layer is slow; RedSync first *trims* the layer to the few
entries above a coarse threshold and runs the exact top-k on those survivors only::

    thr(r) = mean|v| + r * (max|v| - mean|v|),   r = 0.9, 0.8, ..., 0.0

lowering ``r`` until at least ``k`` entries survive (``|v| > thr``), then ``torch.topk`` on the
survivors. The result is **exactly** the top-k (up to ties, which ``torch.topk`` breaks): the
survivors are a top set holding at least k entries, so their k largest are the tensor's k largest.
We find the release's ``r`` (the first of the ten with enough survivors) by counting all ten
thresholds in one pass (:func:`commlab.compress.scan.counts_above`: one read of the layer and one
host read of ten counts) instead of scanning them pass by pass, then compact the survivors of
that ``r`` once: three passes over the layer (the mean and maximum, the counts, the mask) and
three host syncs, whatever ``r``.

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

import torch

from commlab.compress.scan import Scratch, counts_above, magnitude_stats, select_above
from commlab.registry import SELECTORS

RATIOS = tuple(i / 10 for i in range(9, -1, -1))  # 0.9, 0.8, ..., 0.0 as in the release


def trimmed_topk(x: torch.Tensor, k: int, ratios: tuple[float, ...] = RATIOS,
                 scratch: Scratch | None = None) -> torch.Tensor:
    """Indices (int64) of the ``k`` entries of ``x.view(-1)`` with the largest |x|.

    ``ratios`` must decrease; ``scratch`` lends reusable mask buffers."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if k >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    flat, mean, top = magnitude_stats(x, "trimmed_topk")
    if top > mean:
        # The release scans r = 0.9, 0.8, ... and stops at the first r leaving >= k survivors
        # (|v| > thr): all ten counted in one pass, the first that has enough is the release's r.
        thresholds = [mean + r * (top - mean) for r in ratios]
        counts = counts_above(flat, thresholds)
        first = next((i for i, c in enumerate(counts) if c >= k), None)
        if first is not None:
            survivors = select_above(flat, thresholds[first], scratch)
            best = torch.topk(flat[survivors].abs(), k, sorted=False).indices
            return survivors[best]
    # Fewer than k entries above the mean (or all magnitudes equal): select on the whole tensor.
    return torch.topk(flat.abs(), k, sorted=False).indices


@SELECTORS.register("trimmed_topk")
class TrimmedTopk:
    """:func:`trimmed_topk` with mask buffers reused between calls (no other state)."""

    exact_count = True  # returns exactly min(k, n) indices (the count every rank can know)

    def __init__(self):
        self.scratch = Scratch()

    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return trimmed_topk(x, k, scratch=self.scratch)
