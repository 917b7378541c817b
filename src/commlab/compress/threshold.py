"""Threshold estimation: exact top-k every few steps, a reused and nudged threshold in between
(Li & Hoefler, PPoPP'22, section 4: Ok-Topk's local and global thresholds, as released in Shigangli/Ok-Topk).

Computing the exact k-th largest magnitude costs a top-k over the whole tensor. Gradients change
slowly, so Ok-Topk computes it only every ``recompute_every`` steps (tau = 32) and in between
selects with the previous threshold, corrected multiplicatively from the count it selected:
more than ``upper``·k selected -> multiply by ``up`` (1.012), fewer than ``lower``·k -> divide by
``down`` (1.012); the band is [3k/4, 5k/4]. Before selecting with a reused threshold, a guard
raises it by ``guard_scale`` (1.03), at most ``guard_loops`` (5) times, while more than
``guard_factor``·k (3k/2) entries would pass. The global threshold of Ok-Topk uses the same
machinery with up = 1.008, down = 1.01 and no guard.

With ``cap`` set (Ok-Topk's bounded control) no step selects more than ``cap``·k entries: when
more pass the reused threshold, the selection is the exact top-(cap·k), taken among those that
pass (they contain it, so this costs a top-k over about k entries, not over the tensor); when
fewer than ``lower``·k pass, the exact threshold is computed at that step. Either correction
(counted in ``recomputes``) keeps for the next steps the threshold that selects the middle of
[lower·k, cap·k], and ties at an exact threshold are trimmed to the cap.

Selection keeps the entries with |x| >= threshold and x != 0: at density 1 (threshold 0) that is
every non-zero entry, so a density-1 method equals a dense one exactly. When k reaches the number
of candidates the exact threshold is 0 (everything non-zero passes).

    select = SELECTORS.get("threshold_estimation")()   # stateful: first call exact, then reused
    idx = select(x, k)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

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
    cap: float = 0.0  # > 0: never select more than cap*k; recompute exactly when out of [lower*k, cap*k]

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
        if self.cap and not self.lower <= self.cap:
            raise ValueError(f"cap must be 0 (off) or >= lower ({self.lower}), got {self.cap}")


def kth_largest(magnitudes: torch.Tensor, k: int) -> float:
    """The k-th largest of ``magnitudes`` (>= 0), or 0.0 when k reaches the number of entries."""
    flat = magnitudes.reshape(-1)
    if k >= flat.numel():
        return 0.0
    return float(torch.topk(flat, k, sorted=False).values.min())


def passing(x: torch.Tensor, magnitudes: torch.Tensor, threshold: float) -> torch.Tensor:
    """Boolean mask of the entries selected by ``threshold`` (|x| >= threshold and x != 0)."""
    mask = magnitudes >= threshold
    if threshold <= 0:
        mask &= x != 0
    return mask


def magnitudes_into(x: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """|x| written into ``buffer`` when it fits (same shape, dtype, device), else a new tensor."""
    if buffer is None or buffer.shape != x.shape or buffer.dtype != x.dtype or buffer.device != x.device:
        return x.abs()
    return torch.abs(x, out=buffer)


def select_at(x: torch.Tensor, threshold: float, magnitudes: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted int64 indices of the entries of flat ``x`` selected by ``threshold``."""
    flat = x.reshape(-1)
    mags = flat.abs() if magnitudes is None else magnitudes
    return torch.nonzero(passing(flat, mags, threshold)).view(-1)


class ThresholdEstimator:
    """One reused threshold: exact when due, guarded on reuse, nudged from every observed count."""

    def __init__(self, options: ThresholdOptions | None = None):
        self.options = options or ThresholdOptions()
        self.options.validate()
        self.value: float | None = None
        self.exact_computations = 0
        self.recomputes = 0  # exact thresholds forced by the cap (count out of [lower*k, cap*k])

    def due(self, step: int) -> bool:
        """Whether ``step`` (counted from 0) recomputes the exact threshold."""
        return self.value is None or step % self.options.recompute_every == 0

    def set_exact(self, value: float) -> float:
        self.value = float(value)
        self.exact_computations += 1
        return self.value

    def guarded(self, magnitudes: torch.Tensor, k: int) -> float:
        """The reused threshold, raised while more than guard_factor*k entries would pass."""
        thr = self.value
        for _ in range(self.options.guard_loops):
            if thr <= 0 or int(torch.count_nonzero(magnitudes >= thr)) <= self.options.guard_factor * k:
                break
            thr *= self.options.guard_scale
        self.value = thr
        return thr

    def threshold(self, magnitudes: torch.Tensor, k: int, step: int) -> float:
        """The threshold to select with at ``step``: exact k-th largest when due, else guarded."""
        if self.due(step):
            return self.set_exact(kth_largest(magnitudes, k))
        return self.guarded(magnitudes, k)

    def select(self, x: torch.Tensor, magnitudes: torch.Tensor, k: int, step: int) -> torch.Tensor:
        """Sorted int64 indices selected at ``step`` (exact or guarded threshold), then nudged.

        Same result as :meth:`threshold` + :func:`select_at`, but the guard counts the mask it
        selects with, so a step without a guard raise reads the magnitudes once."""
        o = self.options
        if o.cap:
            return self._select_capped(x, magnitudes, k, step)
        if self.due(step):
            mask = passing(x, magnitudes, self.set_exact(kth_largest(magnitudes, k)))
        else:
            thr = self.value
            mask = passing(x, magnitudes, thr)
            for _ in range(o.guard_loops):
                if thr <= 0 or int(torch.count_nonzero(mask)) <= o.guard_factor * k:
                    break
                thr *= o.guard_scale
                mask = passing(x, magnitudes, thr)
            self.value = thr
        idx = torch.nonzero(mask).view(-1)
        self.observe(idx.numel(), k)
        return idx

    def _select_capped(self, x: torch.Tensor, magnitudes: torch.Tensor, k: int, step: int) -> torch.Tensor:
        """At most cap*k entries: more pass the reused threshold -> the exact top-(cap*k) of those
        that pass (they hold all of them: cheap, no pass over the whole tensor); fewer than
        lower*k -> the exact threshold. After either, the threshold kept for the next steps
        selects the middle of the band ((lower + cap)/2 · k), so that a count drifting up stays
        in the band for a while instead of forcing a correction every step."""
        o = self.options
        cap = int(o.cap * k)
        aim = max(1, math.ceil((o.lower + o.cap) / 2 * k))
        due = self.due(step)
        if due:
            mask = passing(x, magnitudes, self.set_exact(kth_largest(magnitudes, k)))
        else:
            mask = passing(x, magnitudes, self.value)
            if int(torch.count_nonzero(mask)) < o.lower * k and k < magnitudes.numel():
                self.recomputes += 1
                self.exact_computations += 1
                top = torch.topk(magnitudes.reshape(-1), k, sorted=True).values
                self.value = float(top[aim - 1])
                mask = passing(x, magnitudes, float(top[-1]))
        idx = torch.nonzero(mask).view(-1)
        if idx.numel() > cap:   # ties at an exact threshold, or a reused one fallen behind
            top = torch.topk(magnitudes.reshape(-1)[idx], cap, sorted=True)
            idx = torch.sort(idx[top.indices]).values
            if not due:
                self.recomputes += 1
                self.value = float(top.values[min(aim, cap) - 1])
        return idx

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
        self._mags: torch.Tensor | None = None  # |x| buffer reused between calls (no page faults)

    @property
    def recompute_every(self) -> int:
        return self.estimator.options.recompute_every

    @property
    def threshold(self) -> float | None:
        return self.estimator.value

    def __call__(self, x: torch.Tensor, k: int) -> torch.Tensor:
        flat = x.reshape(-1)
        self._mags = magnitudes_into(flat, self._mags)
        idx = self.estimator.select(flat, self._mags, k, self.calls)
        self.calls += 1
        return idx

    def state_dict(self) -> dict:
        return {"estimator": self.estimator.state_dict(), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self.calls = int(state["calls"])
