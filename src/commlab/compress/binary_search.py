"""Threshold binary search selection (RedSync, Fang et al., arXiv 1808.04357, as released: layers above 4M elements).

RedSync avoids a full top-k on large layers by searching a magnitude threshold of the form::

    thr(r) = mean|v| + r * (max|v| - mean|v|)

and bisecting on ``r`` until the count of entries with ``|v| > thr`` lies in the band
``k/2 < count < 2k``. Each probe is one pass over the tensor (compare and count) instead of a
selection, which is what makes it faster than ``torch.topk`` on large layers.

Our reading, and where it departs from the release (feifeibear/89757, ``select_top_k_thdv3``):

* **Many probes per pass.** A round counts ``PROBES`` thresholds spread over the current
  interval in one pass (:func:`commlab.compress.scan.counts_above`: one read of the layer and one
  host read of the counts), a bisection that halves the interval ``log2(PROBES + 1)`` times per
  pass. The band spans a factor 4 of counts, so on gradients the first round usually holds a
  threshold in it; that one (the count nearest k) is compacted once. A selection therefore costs
  the mean and maximum (one host read), a round or two, and one compaction: about four passes
  and three host syncs, against a host-driven probe loop before.
* **Search interval.** ``r`` starts in ``[0, 1]`` (``thr`` between the mean and the maximum; the
  mean is among the first round's probes). When the mean itself already selects too few entries
  (``count(thr = mean) <= k/2``, e.g. a large ``k`` during density warm-up), the interval is
  extended below the mean down to threshold 0, i.e. ``r`` down to ``-mean / (max - mean)``. The
  release stops after a fixed number of halvings and may return a count outside the band; we
  keep searching.
* **Termination.** The search stops when a count is in the band, when the threshold interval
  can no longer be split in the tensor's dtype (no representable threshold in between), or after
  ``max_iters`` rounds. Each round shrinks the interval, so the search is bounded on any input,
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
  maximum orders of magnitude above the rest, or the interval reaches down to 0), a round's
  probes are spread geometrically instead of evenly in ``r``, so such tensors take a few rounds,
  not hundreds of halvings.
* **Threshold reuse** (``reuse_every = N``): the release can reuse the found ``r`` for the next
  steps (recomputing mean and max). We reuse it for ``N - 1`` calls but, if the reused threshold
  leaves the band, search afresh, so reuse only ever saves time and never breaks the band. A
  reused ratio costs one mask and one compaction, which also counts it.

Usage::

    select = SELECTORS.get("binary_search")()          # or BinarySearchSelector(reuse_every=10)
    idx = select(v, k)                                  # int64 indices into v.view(-1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from commlab.compress.floatbits import in_dtype
from commlab.compress.scan import Scratch, counts_above, magnitude_stats, select_above
from commlab.registry import SELECTORS

PROBES = 15  # thresholds counted per pass (a round halves the interval 4 times)
GEOMETRIC_SPAN = 64.0  # spread probes geometrically while hi/lo exceeds this (a Gaussian's max/mean is ~6)


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
    return in_dtype(value, dtype)


def binary_search_select(x: torch.Tensor, k: int, max_iters: int = 32, r_hint: float | None = None,
                         scratch: Scratch | None = None) -> SearchResult:
    """A top set of ``x.view(-1)`` by magnitude with ``k/2 < count < 2k`` (see the module notes).

    ``r_hint`` tries that ratio first (one mask and compaction) and searches only if it misses
    the band; ``scratch`` lends reusable mask buffers."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if max_iters < 1:
        raise ValueError(f"max_iters must be at least 1, got {max_iters}")
    if k >= x.numel():
        return SearchResult(torch.arange(x.numel(), device=x.device), None, 0)
    flat, mean, top = magnitude_stats(x, "binary_search_select")
    span = top - mean
    if span <= 0:  # every magnitude equal (all zero included): only counts 0 and n exist
        return SearchResult(torch.topk(flat.abs(), k, sorted=False).indices, None, 0)
    search = _Search(flat, k, scratch)
    if r_hint is not None:
        thr = _representable(mean + r_hint * span, flat.dtype)
        idx = select_above(flat, thr, scratch)
        search.probes += 1
        if search.in_band(idx.numel()):
            return SearchResult(idx, r_hint, search.probes, reused=True, threshold=thr)
    return search.run(mean, span, top, max_iters)


def _probes(lo: float, hi: float, tiny: float, dtype: torch.dtype) -> list[float]:
    """Up to PROBES thresholds strictly between ``lo`` and ``hi``, representable in ``dtype``:
    evenly spaced (the paper's bisection on r, several levels at once), or geometrically while
    the interval spans more than GEOMETRIC_SPAN."""
    base = max(lo, tiny)
    steps = [i / (PROBES + 1) for i in range(1, PROBES + 1)]
    if hi > GEOMETRIC_SPAN * base:  # two roots: the product could overflow
        raw = [math.exp(math.log(base) + f * (math.log(hi) - math.log(base))) for f in steps]
    else:
        raw = [lo + f * (hi - lo) for f in steps]
    return sorted({t for t in (_representable(v, dtype) for v in raw) if lo < t < hi})


class _Search:
    """The search over one tensor's magnitudes."""

    def __init__(self, flat: torch.Tensor, k: int, scratch: Scratch | None):
        self.flat, self.k, self.scratch = flat, k, scratch
        self.probes = 0

    def in_band(self, count: int) -> bool:
        return self.k / 2 < count < 2 * self.k

    def answer(self, thr: float, ratio: float) -> SearchResult:
        """The entries above ``thr``, compacted once."""
        return SearchResult(select_above(self.flat, thr, self.scratch), ratio, self.probes, threshold=thr)

    def counts(self, thresholds: list[float]) -> list[int]:
        self.probes += 1
        return counts_above(self.flat, thresholds)

    def run(self, mean: float, span: float, top: float, max_iters: int) -> SearchResult:
        dtype, k = self.flat.dtype, self.k
        tiny = torch.finfo(dtype).tiny
        ratio = lambda thr: (thr - mean) / span  # noqa: E731
        # Invariant: count(lo) >= 2k once lo_known (the mean is probed in the first round), and
        # count(hi) <= k/2 (nothing is above the maximum).
        lo, lo_known, hi = _representable(mean, dtype), False, top
        for _ in range(max_iters):
            probes = _probes(lo, hi, tiny, dtype)
            if not lo_known:
                probes = [lo, *probes]
            elif not probes:
                break  # adjacent thresholds: a tie group straddles the band
            counts = self.counts(probes)
            fits = [j for j, c in enumerate(counts) if self.in_band(c)]
            if fits:  # the count nearest k (in ratio): compacted once
                best = min(fits, key=lambda j: abs(math.log(counts[j] / k)))
                return self.answer(probes[best], ratio(probes[best]))
            if not lo_known and counts[0] <= k / 2:
                # The mean already selects too few: continue below it, down to threshold 0.
                hi = lo
                nonzero = self.counts([0.0])[0]
                if self.in_band(nonzero):
                    return self.answer(0.0, ratio(0.0))
                if nonzero <= k / 2:  # at most k/2 non-zero entries: no threshold reaches the band
                    return SearchResult(self._exact_k(None), None, self.probes)
                lo, lo_known = 0.0, True
                continue
            lo_known = True
            # counts fall with the threshold and none is in the band: the last >= 2k and the
            # first <= k/2 enclose it
            above = [j for j, c in enumerate(counts) if c >= 2 * k]
            if above:
                lo = probes[above[-1]]
            below = [j for j, c in enumerate(counts) if c <= k / 2]
            if below:
                hi = probes[below[0]]
        return SearchResult(self._exact_k(lo if lo_known else None), None, self.probes)

    def _exact_k(self, lower: float | None) -> torch.Tensor:
        """Exactly k indices of the largest magnitudes, among the entries above ``lower`` (known
        to hold at least 2k entries) or among all entries (``None``); ties broken by topk."""
        if lower is None:
            return torch.topk(self.flat.abs(), self.k, sorted=False).indices
        cand = select_above(self.flat, lower, self.scratch)
        best = torch.topk(self.flat[cand].abs(), self.k, sorted=False).indices
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
        self.scratch = Scratch()  # mask buffers reused between calls

    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        hint = None
        if self.ratio is not None and self.calls_since_search < self.reuse_every - 1:
            hint = self.ratio
        result = binary_search_select(x, k, self.max_iters, r_hint=hint, scratch=self.scratch)
        self.calls_since_search = self.calls_since_search + 1 if result.reused else 0
        self.ratio = result.ratio
        self.last = result
        return result.indices

    def state_dict(self) -> dict:
        return {"ratio": self.ratio, "calls_since_search": self.calls_since_search}

    def load_state_dict(self, state: dict) -> None:
        self.ratio = state["ratio"]
        self.calls_since_search = int(state["calls_since_search"])
