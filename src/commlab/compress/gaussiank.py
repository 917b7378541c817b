"""Gaussian-k selection: a threshold from a normal fit of the tensor (Li & Hoefler, PPoPP'22: the
Gaussiank baseline of Ok-Topk, as released in Shigangli/Ok-Topk).

The entries are taken to be normal with the tensor's mean mu and standard deviation sigma; the
two-sided tail that holds a fraction rho = k/n lies beyond mu + z·sigma with
z = Phi^-1(1 - rho/2). Gradients have heavier tails than a normal, so the count is usually off;
the release only corrects too few: while fewer than ``lower``·k (3k/4) pass, the threshold is
divided by ``down`` (1.012), at most ``max_loops`` (50) times. One pass for the moments (read
on the host together), one mask and one compaction, which also counts; only when too few pass,
one more pass counts every corrected threshold at once and a second compaction takes the first
that lets enough through: the release's loop, without a pass and a host read per correction.

    select = SELECTORS.get("gaussiank")()
    idx = select(x, k)             # sorted int64 indices of |x| > threshold
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from commlab.compress.scan import Scratch, compact, counts_above, first_within, select_above
from commlab.registry import SELECTORS


@dataclass
class GaussianOptions:
    lower: float = 0.75  # lower the threshold while fewer than lower*k entries pass
    down: float = 1.012  # factor the threshold is divided by per correction
    max_loops: int = 50  # at most this many corrections

    def validate(self) -> None:
        if not 0 <= self.lower <= 1:
            raise ValueError(f"lower must be in [0, 1], got {self.lower}")
        if self.down < 1:
            raise ValueError(f"down must be >= 1, got {self.down}")
        if self.max_loops < 0:
            raise ValueError(f"max_loops must be >= 0, got {self.max_loops}")


def gaussian_threshold(x: torch.Tensor, k: int) -> float:
    """mu + Phi^-1(1 - rho/2)·sigma for rho = k/n: the normal fit's threshold for k entries."""
    flat = x.reshape(-1)
    n = flat.numel()
    if k >= n or n < 2:
        return 0.0
    rho = k / n
    z = NormalDist().inv_cdf(1.0 - rho / 2)
    std, mean = torch.std_mean(flat)
    mean, std = torch.stack([mean, std]).tolist()
    return mean + z * std


def lowered(threshold: float, down: float, loops: int) -> list[float]:
    """The thresholds the correction loop tries after ``threshold``: divided by ``down`` once,
    twice, ... ``loops`` times (the same float quotients as the loop)."""
    out = []
    for _ in range(loops):
        threshold /= down
        out.append(threshold)
    return out


def gaussian_select(x: torch.Tensor, k: int, options: GaussianOptions | None = None,
                    scratch: Scratch | None = None) -> tuple[torch.Tensor, float]:
    """Indices (sorted int64) selected by the corrected Gaussian threshold (|x| > threshold), and
    the threshold; ``scratch`` lends reusable mask buffers."""
    o = options or GaussianOptions()
    flat = x.reshape(-1)
    thr = gaussian_threshold(flat, k)
    if thr <= 0 or not math.isfinite(thr):
        return compact(flat != 0), 0.0
    idx = select_above(flat, thr, scratch)
    if idx.numel() < o.lower * k and o.max_loops:
        candidates = lowered(thr, o.down, o.max_loops)
        counts = counts_above(flat, candidates)
        thr = candidates[first_within(counts, lambda c: c >= o.lower * k)]
        idx = select_above(flat, thr, scratch)
    return idx, thr


@SELECTORS.register("gaussiank")
class GaussianSelector:
    """Stateless Gaussian-k selector (the last threshold is kept for inspection)."""

    def __init__(self, options: GaussianOptions | None = None):
        self.options = options or GaussianOptions()
        self.options.validate()
        self.threshold: float | None = None
        self.scratch = Scratch()  # mask buffers reused between calls

    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        idx, self.threshold = gaussian_select(x.reshape(-1), k, self.options, self.scratch)
        return idx
