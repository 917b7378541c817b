"""Threshold binary search selection (RedSync, Fang et al., arXiv 1808.04357, as released: layers above 4M elements).

RedSync avoids a full top-k on large layers by searching a magnitude threshold of the form::

    thr(r) = mean|v| + r * (max|v| - mean|v|)

and bisecting on ``r`` until the count of entries with ``|v| > thr`` lies in the band
``k/2 < count < 2k``. Each probe is one pass over the tensor (compare and count) instead of a
selection, which is what makes it faster than ``torch.topk`` on large layers.

Our reading, and where it departs from the release (feifeibear/89757, ``select_top_k_thdv3``):

* **Search interval.** ``r`` starts in ``[0, 1]`` (``thr`` between the mean and the maximum).
  When the mean itself already selects too few entries (``count(thr = mean) <= k/2``, e.g. a
  large ``k`` during density warm-up), the interval is extended below the mean down to threshold
  0, i.e. ``r`` down to ``-mean / (max - mean)``. The release stops after a fixed number of
  halvings and may return a count outside the band; we keep searching.
* **Termination.** The search stops when the count is in the band, when the threshold interval
  can no longer be split in the tensor's dtype (no representable threshold in between), or after
  ``max_iters`` probes. Each probe halves the interval, so the loop is bounded on any input,
  including adversarial ones (all equal, all zero, one huge outlier, negative only).
* **Unreachable band.** Counts of ``|v| > thr`` can only take the values ``#(|v| >= d)`` for the
  distinct magnitudes ``d``; with ties at the boundary (all entries equal, all zero, many equal
  outliers) no threshold gives a count in the band. Then (and when ``max_iters`` runs out) the
  selector returns **exactly k** indices: every entry above the upper bound of the final
  interval plus the largest of the rest, chosen by ``torch.topk`` on the entries above the lower
  bound (ties broken by ``torch.topk``). So the result always has ``k/2 < count < 2k`` (for
  ``k < n``; ``k >= n`` returns every index) and is always a *top set*: no unselected entry is
  larger in magnitude than a selected one.
* **Wide intervals.** While the interval spans more than a factor 64 (one huge outlier puts the
  maximum orders of magnitude above the rest), the next threshold is the geometric midpoint of
  the interval instead of the arithmetic one (``r = 1/2``), so such tensors take tens of probes,
  not hundreds. On ordinary gradients (max/mean about 6) every probe is the paper's.
* **Speed without changing the result.** The probe at the mean is made only when the search
  approaches ``r = 0`` (the band usually lies well above the mean). Once a probe leaves between
  2k and n/64 entries above its threshold, those entries are gathered once and later probes count
  only among them (every later threshold is higher), so most probes touch a few thousand values
  instead of the whole layer (gathering a larger set costs more than the full probes it saves).
  The |v| buffer and the comparison mask are reused between calls of one selector instance
  (fresh multi-megabyte allocations cost page faults on every call).
* **Threshold reuse** (``reuse_every = N``): the release can reuse the found ``r`` for the next
  steps (recomputing mean and max). We reuse it for ``N - 1`` calls but, if the reused threshold
  leaves the band, search afresh, so reuse only ever saves time and never breaks the band.

Usage::

    select = SELECTORS.get("binary_search")()          # or BinarySearchSelector(reuse_every=10)
    idx = select(v, k)                                  # int64 indices into v.view(-1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from commlab.registry import SELECTORS

COMPACT_FRACTION = 1 / 64  # gather the candidates once a probe leaves at most this fraction of n
NEAR_MEAN = 1 / 16  # probe the mean itself once the upper end of the search is this close to r=0
GEOMETRIC_SPAN = 64.0  # bisect geometrically while hi/lo exceeds this (a Gaussian's max/mean is ~6)


class Workspace:
    """Reusable |x| and mask buffers of one selector (a selector sees one layer's size)."""

    def __init__(self):
        self.magnitudes: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def abs(self, flat: torch.Tensor) -> torch.Tensor:
        if not flat.dtype.is_floating_point:
            return flat.abs().float()
        buf = self.magnitudes
        if buf is None or buf.numel() != flat.numel() or buf.dtype != flat.dtype or buf.device != flat.device:
            buf = self.magnitudes = torch.empty_like(flat)
        return torch.abs(flat, out=buf)

    def above(self, a: torch.Tensor, thr: float) -> torch.Tensor:
        """Boolean mask ``a > thr`` in a reused buffer (valid until the next call)."""
        buf = self.mask
        if buf is None or buf.numel() < a.numel() or buf.device != a.device:
            buf = self.mask = torch.empty(a.numel(), dtype=torch.bool, device=a.device)
        return torch.gt(a, thr, out=buf[:a.numel()])


@dataclass
class SearchResult:
    """What one selection did: the indices, the threshold and its ratio ``r`` that produced the
    band (``None`` when the band was unreachable and the exact-k fallback answered), the number of
    counting passes, and whether a reused ratio answered without a search."""

    indices: torch.Tensor
    ratio: float | None
    probes: int
    reused: bool = False
    threshold: float | None = None


def _representable(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (thresholds compare against tensor values of that dtype)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))  # host-side: rounds a Python float


def binary_search_select(x: torch.Tensor, k: int, max_iters: int = 32, r_hint: float | None = None,
                         workspace: Workspace | None = None) -> SearchResult:
    """A top set of ``x.view(-1)`` by magnitude with ``k/2 < count < 2k`` (see the module notes).

    ``r_hint`` tries that ratio first (one probe) and searches only if it misses the band;
    ``workspace`` lends reusable buffers (a fresh one when not given).
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if max_iters < 1:
        raise ValueError(f"max_iters must be at least 1, got {max_iters}")
    flat = x.reshape(-1)
    n = flat.numel()
    if k >= n:
        return SearchResult(torch.arange(n, device=flat.device), None, 0)
    ws = workspace if workspace is not None else Workspace()
    a = ws.abs(flat)
    mean, top = float(a.mean()), float(a.max())
    if not (math.isfinite(mean) and math.isfinite(top)):
        raise ValueError("binary_search_select: the tensor holds NaN or infinite values")
    span = top - mean
    if span <= 0:  # every magnitude equal (all zero included): only counts 0 and n exist
        return SearchResult(torch.topk(a, k, sorted=False).indices, None, 0)
    search = _Search(a, k, ws)
    if r_hint is not None:
        thr = _representable(mean + r_hint * span, a.dtype)
        if search.in_band(search.count(thr)):
            return SearchResult(search.take(thr), r_hint, search.probes, reused=True, threshold=thr)
    return search.run(mean, span, top, max_iters)


def _midpoint(lo: float, hi: float, tiny: float) -> float:
    """The next threshold to probe: the arithmetic midpoint (the paper's bisection on r), or the
    geometric one while the interval spans more than GEOMETRIC_SPAN (a huge outlier, or the
    interval extended down to 0), so that a band many orders of magnitude below the maximum is
    reached in tens of probes rather than hundreds."""
    base = max(lo, tiny)
    if hi > GEOMETRIC_SPAN * base:
        return math.sqrt(base) * math.sqrt(hi)  # two roots: the product could overflow
    return 0.5 * (lo + hi)


class _Search:
    """The bisection over one tensor's magnitudes ``a`` (possibly narrowed to candidates)."""

    def __init__(self, a: torch.Tensor, k: int, ws: Workspace):
        self.a, self.k, self.ws = a, k, ws
        self.work = a  # the values probes look at: all of `a`, or the candidates above some lo
        self.work_idx: torch.Tensor | None = None  # positions of `work` in `a` (None: identity)
        self.probes = 0

    def in_band(self, count: int) -> bool:
        return self.k / 2 < count < 2 * self.k

    def count(self, thr: float) -> int:
        self.probes += 1
        return int(torch.count_nonzero(self.ws.above(self.work, thr)))

    def take(self, thr: float) -> torch.Tensor:
        sel = torch.nonzero(self.ws.above(self.work, thr)).view(-1)
        return sel if self.work_idx is None else self.work_idx[sel]

    def narrow(self, thr: float, count: int) -> None:
        """Keep only the entries above ``thr`` (every later threshold is higher)."""
        if count <= COMPACT_FRACTION * self.a.numel() and count < self.work.numel():
            self.work_idx = self.take(thr)
            self.work = self.a[self.work_idx]

    def run(self, mean: float, span: float, top: float, max_iters: int) -> SearchResult:
        dtype, k = self.a.dtype, self.k
        tiny = torch.finfo(dtype).tiny
        # Invariant: count(lo) >= 2k once lo_known (assumed for the mean until probed), and
        # count(hi) <= k/2 (nothing is above the maximum).
        lo_r, lo_thr, lo_known = 0.0, _representable(mean, dtype), False
        hi_r, hi_thr = 1.0, top
        for _ in range(max_iters):
            if not lo_known and hi_r <= NEAR_MEAN:
                count = self.count(lo_thr)
                if self.in_band(count):
                    return SearchResult(self.take(lo_thr), lo_r, self.probes, threshold=lo_thr)
                if count <= k / 2:
                    # The mean already selects too few: continue below it, down to threshold 0.
                    hi_r, hi_thr = lo_r, lo_thr
                    lo_r, lo_thr = -mean / span, 0.0
                    count = self.count(lo_thr)
                    if self.in_band(count):
                        return SearchResult(self.take(lo_thr), lo_r, self.probes, threshold=lo_thr)
                    if count <= k / 2:  # at most k/2 non-zero entries: no threshold reaches the band
                        return SearchResult(self._exact_k(None), None, self.probes)
                lo_known = True
                self.narrow(lo_thr, count)
                continue
            mid_thr = _representable(_midpoint(lo_thr, hi_thr, tiny), dtype)
            mid_r = (mid_thr - mean) / span
            if mid_thr <= lo_thr or mid_thr >= hi_thr:
                if lo_known:
                    break  # adjacent thresholds: a tie group straddles the band
                hi_r = 0.0  # nothing left to split above the mean: probe the mean next
                continue
            count = self.count(mid_thr)
            if self.in_band(count):
                return SearchResult(self.take(mid_thr), mid_r, self.probes, threshold=mid_thr)
            if count >= 2 * k:
                lo_r, lo_thr, lo_known = mid_r, mid_thr, True
                self.narrow(mid_thr, count)
            else:
                hi_r, hi_thr = mid_r, mid_thr
        return SearchResult(self._exact_k(lo_thr if lo_known else None), None, self.probes)

    def _exact_k(self, lower: float | None) -> torch.Tensor:
        """Exactly k indices of the largest magnitudes, among the entries above ``lower`` (known
        to hold at least 2k entries) or among all entries (``None``); ties broken by topk."""
        if lower is None:
            return torch.topk(self.a, self.k, sorted=False).indices
        cand = self.take(lower)
        best = torch.topk(self.a[cand], self.k, sorted=False).indices
        return cand[best]


@SELECTORS.register("binary_search")
class BinarySearchSelector:
    """RedSync's threshold binary search, with optional reuse of the found ratio ``r``.

    ``reuse_every = 1`` searches on every call; ``N > 1`` reuses the last good ``r`` for the next
    ``N - 1`` calls (searching again whenever the reused threshold leaves the band).
    """

    def __init__(self, reuse_every: int = 1, max_iters: int = 32):
        if reuse_every < 1:
            raise ValueError(f"reuse_every must be at least 1, got {reuse_every}")
        if max_iters < 1:
            raise ValueError(f"max_iters must be at least 1, got {max_iters}")
        self.reuse_every = reuse_every
        self.max_iters = max_iters
        self.ratio: float | None = None  # r of the last successful search
        self.calls_since_search = 0  # calls answered by the reused ratio since the last search
        self.last: SearchResult | None = None  # the last call's result (metrics, tests)
        self.workspace = Workspace()

    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        hint = None
        if self.ratio is not None and self.calls_since_search < self.reuse_every - 1:
            hint = self.ratio
        result = binary_search_select(x, k, self.max_iters, r_hint=hint, workspace=self.workspace)
        self.calls_since_search = self.calls_since_search + 1 if result.reused else 0
        self.ratio = result.ratio
        self.last = result
        return result.indices

    def state_dict(self) -> dict:
        return {"ratio": self.ratio, "calls_since_search": self.calls_since_search}

    def load_state_dict(self, state: dict) -> None:
        self.ratio = state["ratio"]
        self.calls_since_search = int(state["calls_since_search"])
