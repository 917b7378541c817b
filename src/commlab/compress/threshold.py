"""Threshold estimation: the exact k-th largest magnitude every few steps, a reused threshold in
between (Li & Hoefler, PPoPP'22, section 4: Ok-Topk's local and global thresholds, as released in
Shigangli/Ok-Topk).

What it computes. A selection keeps the entries with |x| >= threshold and x != 0. Every
``recompute_every`` steps (tau) the threshold is the exact k-th largest |x|; in between the
previous one is reused, so a step costs one mask and one compaction instead of a top-k. How the
reused threshold follows the data, by :class:`ThresholdOptions`:

* **nudged** (the release): more than ``upper``·k selected -> threshold x ``up``; fewer than
  ``lower``·k -> / ``down``. A guard first raises a reused threshold by ``guard_scale``, at most
  ``guard_loops`` times, while more than ``guard_factor``·k would pass. The count is only
  steered into the band [``lower``·k, ``upper``·k].
* **exact k** (``exact_k``, Ok-Topk's bounded control): exactly the top-k at every step. The
  reused threshold only narrows the candidates: while at least k pass, the top-k of those is
  the tensor's. Fewer than k passing -> the exact threshold; more than ``upper``·k -> re-aimed
  among those passing. The threshold kept aims at (1 + ``upper``)/2 · k entries.

Invariants: a selection's positions ascend and its values are x's there; ties at an exact
threshold are trimmed to k (exact k); at a threshold of 0 every non-zero
entry passes, so k >= the number of candidates selects all of them (density 1 equals dense);
NaN passes every threshold. ``exact_computations`` counts exact thresholds, ``recomputes`` the
corrections outside the tau steps.

How (docs/performance.md, "Selection passes"): an exact threshold with a previous one as the
guess counts the entries above 16 rungs around it in one pass and ranks only those above the
highest rung that k pass (:func:`top_candidates`), keeping the selection among them
(:func:`select_top`); order statistics come from an unsorted top-k and one partition or sort
(:func:`largest_at_ranks`). A reused step is one mask and one compaction
(:mod:`commlab.compress.scan`), the compaction's length being the count (one host read); the
guard's raised thresholds are counted among the selected entries as they are selected.

    select = SELECTORS.get("threshold_estimation")()   # stateful: first call exact, then reused
    idx = select(x, k)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from commlab.compress.scan import (
    Scratch,
    counts_at_least,
    keep_at_least,
    select_pairs_at_least,
    select_pairs_guarded,
)
from commlab.registry import SELECTORS


@dataclass
class ThresholdOptions:
    recompute_every: int = 32  # tau: steps between exact k-th-largest computations
    lower: float = 0.75  # band: below lower*k selected entries the threshold is lowered
    upper: float = 1.25  # band: above upper*k selected entries the threshold is raised
    up: float = 1.012  # factor the threshold is multiplied by above the band
    down: float = 1.012  # factor the threshold is divided by below the band
    guard_factor: float = 1.5  # guard: raise a reused threshold while more than this * k pass
    guard_scale: float = 1.03  # guard: factor of each raise
    guard_loops: int = 5  # guard: at most this many raises per step (0: no guard)
    exact_k: bool = False  # select exactly the top-k every step: the reused threshold only narrows the candidates

    def validate(self) -> None:
        if self.recompute_every < 1:
            raise ValueError(f"recompute_every must be >= 1, got {self.recompute_every}")
        if not 0 <= self.lower <= 1 <= self.upper:
            raise ValueError(f"need 0 <= lower <= 1 <= upper, got lower={self.lower}, upper={self.upper}")
        for name in ("up", "down", "guard_scale"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.guard_factor < 1:
            raise ValueError(f"guard_factor must be >= 1, got {self.guard_factor}")
        if self.guard_loops < 0:
            raise ValueError(f"guard_loops must be >= 0, got {self.guard_loops}")
        if self.exact_k and self.guard_loops:
            raise ValueError(f"exact_k replaces the guard: need guard_loops=0, got guard_loops={self.guard_loops}")


def kth_largest(magnitudes: torch.Tensor, k: int) -> float:
    """The k-th largest of ``magnitudes`` (>= 0), or 0.0 when k reaches the number of entries."""
    flat = magnitudes.reshape(-1)
    if k >= flat.numel():
        return 0.0
    return float(torch.topk(flat, k, sorted=False).values.min())


# Rungs around a guessed k-th largest magnitude: 3 octaves below it to one above, 19% apart (16:
# one counting pass of the CPU kernel, one bucketize on a GPU).
LADDER = tuple(2.0 ** (j / 4) for j in range(-12, 4))


def top_candidates(x: torch.Tensor, k: int, guess: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Pairs (positions, values) of flat ``x`` among which its k largest |x| lie (1 <= k <=
    x.numel()): with ``guess`` (a previous k-th largest) one pass counts the entries above each
    rung of :data:`LADDER` times it, and the entries above the highest rung that k of them pass
    are selected: a few k entries instead of the tensor, which hold the top-k and every entry tied
    with its k-th. None without a guess, or when even the lowest rung lets fewer than k pass: then
    the whole tensor is the candidates."""
    flat = x.reshape(-1)
    if guess is None or not 0 < guess < math.inf:
        return None
    rungs = [guess * r for r in LADDER]
    enough = [t for t, c in zip(rungs, counts_at_least(flat, rungs), strict=True) if c >= k]
    return select_pairs_at_least(flat, max(enough)) if enough else None


def ranked_magnitudes(values: torch.Tensor, k: int, ranks: list[int]) -> list[float]:
    """The r-th largest |values| for each r of ``ranks`` (1 <= r <= k <= values.numel()), read on
    the host at once: exactly ``torch.topk(values.abs(), k, sorted=True).values[r - 1]`` (NaN
    counts as the largest, as there). One unsorted top-k, then :func:`largest_at_ranks` of its k
    values."""
    top = torch.topk(values.reshape(-1).abs(), k, sorted=False).values
    return largest_at_ranks(top, ranks)


def largest_at_ranks(values: torch.Tensor, ranks: list[int]) -> list[float]:
    """The r-th largest of 1-D ``values`` for each r of ``ranks`` (1 <= r <= values.numel()), NaN
    the largest, read on the host at once (one host sync). On the CPU numpy's introselect (every
    rank in one call), elsewhere one sort, which uses the whole GPU. Not ``torch.kthvalue`` on
    either device: on the CPU its quickselect is quadratic on the order ``torch.topk(sorted=False)``
    leaves its values in; on CUDA it is a radix select in one thread block per slice
    (pytorch/pytorch#75599). ``commlab bench selection`` times the three ways side by side."""
    if values.device.type == "cpu":
        return largest_by_partition(values, ranks)
    return largest_by_sort(values, ranks)


def largest_by_partition(values: torch.Tensor, ranks: list[int]) -> list[float]:
    """:func:`largest_at_ranks` on the CPU: one ``np.partition`` at every rank."""
    at = [values.numel() - r for r in ranks]  # positions in ascending order; NaN sorts last
    # numpy has no bfloat16; widening it to float32 is exact. Every other dtype stays as it is:
    # a float64 threshold rounded to float32 would select a different set.
    host = values.detach()
    part = np.partition((host.float() if host.dtype == torch.bfloat16 else host).numpy(), at)
    return [float(part[i]) for i in at]


def largest_by_sort(values: torch.Tensor, ranks: list[int]) -> list[float]:
    """:func:`largest_at_ranks` on a GPU (correct anywhere): one descending sort, read at every rank."""
    ordered = torch.sort(values, descending=True).values  # NaN first: the largest
    return torch.stack([ordered[r - 1] for r in ranks]).tolist()  # views: no index copied to the device


def _ranked_among_candidates(flat: torch.Tensor, k: int, ranks: list[int], guess: float | None
                             ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[float]]:
    """:func:`top_candidates` of ``flat`` and :func:`ranked_magnitudes` among them (among the
    whole tensor when there are none)."""
    candidates = top_candidates(flat, k, guess)
    return candidates, ranked_magnitudes(flat if candidates is None else candidates[1], k, ranks)


def top_magnitudes(x: torch.Tensor, k: int, ranks: list[int], guess: float | None = None) -> list[float]:
    """The r-th largest |x| of flat ``x`` for each r of ``ranks`` (1 <= r <= k <= x.numel()):
    :func:`ranked_magnitudes` among :func:`top_candidates` (the tensor without a usable guess)."""
    return _ranked_among_candidates(x.reshape(-1), k, ranks, guess)[1]


def kth_magnitude(x: torch.Tensor, k: int, guess: float | None = None) -> float:
    """The k-th largest |x| (0.0 when k reaches the number of entries), by :func:`top_magnitudes`."""
    if k >= x.numel():
        return 0.0
    return top_magnitudes(x, k, [k], guess)[0]


def select_top(x: torch.Tensor, k: int, guess: float | None = None, also: tuple[int, ...] = (),
               scratch: Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """The pairs of flat ``x`` with |x| >= t, its k-th largest magnitude (1 <= k < x.numel()),
    and [the r-th largest |x| for each r of ``also`` (each <= k)..., t]. The pairs are kept among
    :func:`top_candidates`, which hold every entry with |x| >= t: no second pass over ``x``."""
    flat = x.reshape(-1)
    candidates, ranked = _ranked_among_candidates(flat, k, [*also, k], guess)
    if candidates is None:
        idx, vals = select_pairs_at_least(flat, ranked[-1], scratch)
    else:
        idx, vals = keep_at_least(*candidates, ranked[-1])
        if scratch is not None:
            scratch.selected = idx.numel()  # the next selection's room on a GPU, as a selection sets it
    return idx, vals, ranked


def raised(threshold: float, scale: float, loops: int) -> list[float]:
    """The thresholds a guard loop tries after ``threshold``: multiplied by ``scale`` once, twice,
    ... ``loops`` times (the same float products as the loop)."""
    out = []
    for _ in range(loops):
        threshold *= scale
        out.append(threshold)
    return out


class ThresholdEstimator:
    """One reused threshold: exact when due, guarded on reuse, nudged from every observed count.

    A reused step selects with one mask and one compaction (:mod:`commlab.compress.scan`), which
    also gives the count and, among the selected entries, the counts of the guard's raised
    thresholds; when the count is too high the guard keeps the entries that pass a raise."""

    def __init__(self, options: ThresholdOptions | None = None):
        self.options = options or ThresholdOptions()
        self.options.validate()
        self.value: float | None = None
        self.exact_computations = 0
        self.recomputes = 0  # corrections outside the tau steps (exact k: too few passing, or a re-aim)
        self.scratch = Scratch()  # mask buffers reused from step to step

    def due(self, step: int) -> bool:
        """Whether ``step`` (counted from 0) recomputes the exact threshold."""
        return self.value is None or step % self.options.recompute_every == 0

    def set_exact(self, value: float) -> float:
        self.value = float(value)
        self.exact_computations += 1
        return self.value

    def select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        """Sorted int64 indices of flat ``x`` selected at ``step`` (exact or guarded threshold,
        |x| >= threshold), then nudged."""
        return self.select_pairs(x, k, step)[0]

    def select_pairs(self, x: torch.Tensor, k: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`select`'s indices and the values of ``x`` there (kept as the selection reads
        them: the guard works on these, and a caller need not gather them again)."""
        if self.options.exact_k:
            return self._select_exact_k(x, k, step)
        if self.due(step):
            idx, vals, _ = self._exact(x, k)
        else:
            o = self.options
            raises = raised(self.value, o.guard_scale, o.guard_loops) if o.guard_loops and self.value > 0 else []
            # the guard: when more than guard_factor*k pass, the first raise that lets at most
            # that many pass (else the last), counted among the selected entries by the same
            # kernel that selects them (every raise keeps fewer): no second pass over x
            idx, vals, j = select_pairs_guarded(x, self.value, raises, o.guard_factor * k, self.scratch)
            if j is not None:
                self.value = raises[j]
        self.observe(idx.numel(), k)
        return idx, vals

    def _select_exact_k(self, x: torch.Tensor, k: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exactly the k largest |x| (ties trimmed; every non-zero entry when fewer are non-zero).
        The threshold kept between steps lets about ``aim`` = (1 + upper)/2 · k entries pass, so
        that the top-k lies among those passing while the magnitudes drift: then the selection is
        the top-k of that small set. When fewer than k pass, the exact threshold is computed
        again (aimed anew); when more than upper·k pass, it is re-aimed among those passing."""
        o = self.options
        if k >= x.numel():
            return select_pairs_at_least(x, self.set_exact(0.0), self.scratch)
        aim = min(x.numel() - 1, math.ceil((1 + o.upper) / 2 * k))
        if self.due(step):
            idx, vals, _ = self._exact(x, aim)
        else:
            idx, vals = select_pairs_at_least(x, self.value, self.scratch)
            if idx.numel() < k and self.value > 0:  # a threshold 0 already passes every non-zero entry
                self.recomputes += 1
                idx, vals, _ = self._exact(x, aim)
            elif idx.numel() > o.upper * k:
                self.recomputes += 1
                self.value = ranked_magnitudes(vals, aim, [aim])[0]
        if idx.numel() > k:
            # unsorted: the same entries as a sorted top-k; idx ascends, so do the kept positions
            keep = torch.sort(torch.topk(vals.abs(), k, sorted=False).indices).values
            idx, vals = idx[keep], vals[keep]
        return idx, vals

    def _exact(self, x: torch.Tensor, k: int, also: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """Select at the exact k-th largest |x|, the previous threshold as the guess
        (:func:`select_top`); it becomes the threshold. Returns the pairs and the r-th largest
        |x| for each r of ``also`` and k (with ``also`` empty, k may reach x.numel(): threshold 0)."""
        if k >= x.numel() and not also:
            return (*select_pairs_at_least(x, self.set_exact(0.0), self.scratch), [0.0])
        idx, vals, ranked = select_top(x, k, self.value, also, self.scratch)
        self.set_exact(ranked[-1])
        return idx, vals, ranked

    def observe(self, count: int, k: int) -> None:
        """Nudge the threshold for the next step from the number of entries it selected."""
        o = self.options
        if self.value is None:
            return
        if count < o.lower * k:
            self.value /= o.down
        elif count > o.upper * k:
            self.value *= o.up

    def state_dict(self) -> dict:
        return {"value": self.value, "exact_computations": self.exact_computations,
                "recomputes": self.recomputes, "options": asdict(self.options)}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
        self.exact_computations = int(state.get("exact_computations", 0))
        self.recomputes = int(state.get("recomputes", 0))


@SELECTORS.register("threshold_estimation")
class ThresholdSelector:
    """Stateful selector: exact top-k threshold every ``recompute_every`` calls, reused between.

    Usable fresh (``SELECTORS.get("threshold_estimation")()``): its first call is exact."""

    def __init__(self, options: ThresholdOptions | None = None):
        self.estimator = ThresholdEstimator(options)
        self.calls = 0

    @property
    def recompute_every(self) -> int:
        return self.estimator.options.recompute_every

    @property
    def threshold(self) -> float | None:
        return self.estimator.value

    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        idx = self.estimator.select(x.reshape(-1), k, self.calls)
        self.calls += 1
        return idx

    def state_dict(self) -> dict:
        return {"estimator": self.estimator.state_dict(), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self.calls = int(state["calls"])
