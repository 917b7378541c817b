"""The shared rules that turn a claim's measurement into a verdict (README, "How a verdict is reached").

A paper's claims are declared as data (:mod:`commlab.report.claims`; one ``claims_<paper>.py``
per paper): what a claim measures is paper-specific, how the measurement is judged is one of the
rules below, each named by what it decides and unit-tested on small hand-made tables
(tests/test_report_rules.py). A rule is a small frozen dataclass; its fields are the names of the
values it reads from the measurement (a dict) and its thresholds; ``judge(values)`` returns an
:class:`Outcome`, the verdict and the rule's own words (``why``), which a declaration may put into
its ``ours`` or ``note`` text as ``{why}``.

    Within("gap", bound="allowed", partly=2)    gap <= allowed; partly within twice the bound
    Reaches("saving", 0.62, floor=0)            at least the paper's number; partly above the floor
    Below("volumes", 6, min_points=3)           every value strictly under a bound (a volume bound)
    AccuracyMatch("ours", "dense", margin=1)    a gap of means judged with its standard error (any task's metric)
    SpeedTrend("ratios", paper=(1.46, 1.95))    faster on emulated links, more so as they slow
    Share("flags")                              all cases hold; partly some
    Consistency("holds")                        a check of our own accounting, not a reproduction

A measured value that is NaN passes no comparison. Bounds and thresholds are numbers, or names
of values of the measurement (``bound="allowed"``: a bound computed from the runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from commlab.report.bench import link_mbit
from commlab.report.claims import (
    CONSISTENT,
    INCONSISTENT,
    NOT_MEASURED,
    NOT_REPRODUCED,
    PARTLY,
    REPRODUCED,
)
from commlab.report.metrics import ACCURACY, TASK_METRICS

#: A speed-up within this of 1 is "no faster" (one benchmark cell, or one seed's wall time).
FASTER = 1.05


@dataclass(frozen=True)
class Outcome:
    """A rule's decision: the verdict and the rule's reason in words (``{why}`` in a declaration)."""

    verdict: str
    why: str | tuple[str, ...] = ""


def _number(values: dict, ref) -> float:
    """A threshold: a number as given, or the measurement's value of that name."""
    value = values[ref] if isinstance(ref, str) else ref
    return float("nan") if value is None else float(value)


def _series(values: dict, key: str) -> pd.Series:
    """The measurement's values of that name as numbers, NaN dropped."""
    return pd.Series(values[key], dtype=float).dropna()


def _num(x: float) -> str:
    """A number in a rule's words: '102,000', '0.62', '1.05'."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _passes(value: float, target: float, strict: bool) -> bool:
    return value > target if strict else value >= target  # NaN passes neither


# ---- functions, usable on their own --------------------------------------------------------------

def accuracy_match(ours, reference, margin: float = 1.0, at_least: bool = False, unit: str = "points",
                   higher_is_better: bool = True) -> tuple[str, str]:
    """(text, verdict) for "our accuracy is within ``margin`` points of the reference's", or with
    ``at_least`` for "no more than ``margin`` points below it" (a claim of similar or better accuracy).
    Any task's metric (:mod:`commlab.report.metrics`) in its ``unit``; with ``higher_is_better``
    false (perplexity) "below" becomes "above": a shortfall is a higher value.

    The gap of the means is judged together with its standard error over seeds,
    se = sqrt(sd_ours^2 / n_ours + sd_ref^2 / n_ref), so that neither a noisy comparison nor a gap
    at the edge passes for a match: reproduced when the shortfall (|gap|, or -gap with ``at_least``)
    stays within the margin by one standard error, shortfall + se <= margin; not reproduced when
    even shortfall - 2 se > margin (outside the margin beyond the noise); partly reproduced
    otherwise (the gap is near the margin, or the seeds are too noisy to tell: the text says which)."""
    a, b = pd.Series(ours, dtype=float).dropna(), pd.Series(reference, dtype=float).dropna()
    if a.empty or b.empty:
        return "no runs", NOT_MEASURED
    gap = a.mean() - b.mean()
    var = (a.var(ddof=1) / len(a) if len(a) > 1 else 0.0) + (b.var(ddof=1) / len(b) if len(b) > 1 else 0.0)
    se = float(var) ** 0.5
    worse = -gap if higher_is_better else gap
    shortfall = worse if at_least else abs(gap)
    bound = f"at most {margin:.3g} {'below' if higher_is_better else 'above'}" if at_least else f"margin {margin:.3g}"
    text = f"gap {gap:+.2f} {unit}, standard error {se:.2f} ({bound})"
    if shortfall + se <= margin:
        return text, REPRODUCED
    if shortfall - 2 * se > margin:
        return text, NOT_REPRODUCED
    why = "too noisy over these seeds to tell" if se > margin else "the gap is within a standard error of the margin"
    return f"{text}; {why}", PARTLY


def faster_on_slow_links(ratios: pd.Series, paper: tuple[float, float] | None = None) -> tuple[str, str]:
    """(text, verdict) for "faster than the reference, more so as bandwidth falls".

    ``ratios``: the method's throughput over the reference's per network (fastest link first).
    The trend is judged on every link: the gain must not fall as the bandwidth falls (within
    ``FASTER - 1`` of noise between neighbours). ``paper``: the paper's range of speed-ups on its
    slowest setting; when given, the magnitude on our slowest link is set beside it.

    Reproduced: faster on every emulated link, the gain grows as bandwidth falls, and (with
    ``paper``) the slowest link's gain reaches the paper's lower bound. Partly: faster on the
    slowest link but the trend or the magnitude falls short. Not reproduced otherwise."""
    ratios = ratios.dropna()
    if ratios.empty:
        return "no measurement", NOT_MEASURED
    text = ", ".join(f"{net}: {r:.2f}x" for net, r in ratios.items())
    emulated = ratios[[link_mbit(n) < float("inf") for n in ratios.index]]
    if emulated.empty:
        return text, NOT_MEASURED
    slowest = emulated.iloc[-1]
    ordered = ratios.sort_index(key=lambda idx: [-link_mbit(n) for n in idx]).to_numpy()
    grows = bool((ordered[1:] >= ordered[:-1] - (FASTER - 1)).all()) and slowest >= ratios.max() - 1e-12
    magnitude = paper is None or slowest >= paper[0]
    if paper is not None:
        text += (f"; paper {paper[0]:g}-{paper[1]:g}x: our slowest link's gain is "
                 + ("below" if slowest < paper[0] else "within" if slowest <= paper[1] else "above") + " it")
    if (emulated > FASTER).all() and grows and magnitude:
        return text, REPRODUCED
    if slowest > FASTER:
        return text, PARTLY
    return text, NOT_REPRODUCED


# ---- rules ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Within:
    """A measured distance within a tolerance: ``value <= bound`` reproduced; with ``partly`` (a
    factor), ``value <= partly * bound`` partly reproduced; otherwise not reproduced."""

    value: str
    bound: str | float
    partly: float | None = None

    def judge(self, values: dict) -> Outcome:
        value, bound = _number(values, self.value), _number(values, self.bound)
        if value <= bound:
            return Outcome(REPRODUCED, f"{value:.4g} <= {bound:.4g}")
        if self.partly is not None and value <= self.partly * bound:
            return Outcome(PARTLY, f"{value:.4g} <= {self.partly:g} x {bound:.4g}")
        return Outcome(NOT_REPRODUCED, f"{value:.4g} > {(self.partly or 1):g} x {bound:.4g}")


@dataclass(frozen=True)
class Reaches:
    """A number reaching the paper's (a saving, a speed-up, a correlation): ``value >= target``
    (``> target`` with ``strict``, for "more than") reproduced; partly when the value is above
    ``floor`` or when ``near`` (the same number under a looser condition, e.g. at any accuracy)
    reaches the target; otherwise not reproduced."""

    value: str
    target: str | float
    strict: bool = False
    floor: float | None = None
    near: str | None = None

    def judge(self, values: dict) -> Outcome:
        value, target = _number(values, self.value), _number(values, self.target)
        word = "more than" if self.strict else "at least"
        if _passes(value, target, self.strict):
            return Outcome(REPRODUCED, f"{_num(value)}: {word} {_num(target)}")
        if self.floor is not None and value > self.floor:
            return Outcome(PARTLY, f"{_num(value)}: above {self.floor:g}, short of {_num(target)}")
        if self.near is not None and _passes(near := _number(values, self.near), target, self.strict):
            return Outcome(PARTLY, f"{_num(value)} short of {_num(target)}; {_num(near)} under the looser condition")
        return Outcome(NOT_REPRODUCED, f"{_num(value)}: not {word} {_num(target)}")


@dataclass(frozen=True)
class Below:
    """A bound such as a volume per worker: every value strictly below ``bound``; reproduced with at
    least ``min_points`` values (e.g. worker counts), partly with fewer; not reproduced when one
    value reaches the bound. No values: not measured."""

    values: str
    bound: float
    min_points: int = 1

    def judge(self, values: dict) -> Outcome:
        points = _series(values, self.values)
        if points.empty:
            return Outcome(NOT_MEASURED, "no values")
        worst = float(points.max())
        if worst >= self.bound:
            return Outcome(NOT_REPRODUCED, f"largest {worst:.4g} >= {self.bound:g}")
        if len(points) < self.min_points:
            return Outcome(PARTLY, f"below {self.bound:g} at {len(points)} points, fewer than {self.min_points}")
        return Outcome(REPRODUCED, f"largest {worst:.4g} < {self.bound:g} at {len(points)} points")


@dataclass(frozen=True)
class AccuracyMatch:
    """:func:`accuracy_match` on two series of final accuracies (one per seed). ``margin`` is a
    number or the name of a value; ``metric``, when given, names the value that holds the task's
    metric (``"test_perplexity"``, :data:`commlab.report.metrics.TASK_METRICS`): the gap is then
    in that metric, lower being better for perplexity."""

    ours: str
    reference: str
    margin: float | str = 1.0
    at_least: bool = False
    metric: str | None = None

    def judge(self, values: dict) -> Outcome:
        task = TASK_METRICS[values[self.metric]] if self.metric else ACCURACY
        text, verdict = accuracy_match(values[self.ours], values[self.reference], _number(values, self.margin),
                                       self.at_least, task.unit, task.higher_is_better)
        return Outcome(verdict, text)


@dataclass(frozen=True)
class SpeedTrend:
    """:func:`faster_on_slow_links` on one ratio per network (fastest link first); ``why`` is the
    ratios as text (and the paper's range beside our slowest link's gain)."""

    ratios: str
    paper: tuple[float, float] | None = None

    def judge(self, values: dict) -> Outcome:
        text, verdict = faster_on_slow_links(values[self.ratios], self.paper)
        return Outcome(verdict, text)


@dataclass(frozen=True)
class AllOf:
    """Several rules on one measurement: reproduced when every one is, partly when one is at least
    partly, not reproduced otherwise; ``why`` holds each rule's words in order (``{why[0]}``)."""

    rules: tuple

    def judge(self, values: dict) -> Outcome:
        outcomes = [rule.judge(values) for rule in self.rules]
        verdicts = {o.verdict for o in outcomes}
        verdict = REPRODUCED if verdicts == {REPRODUCED} else \
            PARTLY if verdicts & {REPRODUCED, PARTLY} else NOT_REPRODUCED
        return Outcome(verdict, tuple(o.why for o in outcomes))


@dataclass(frozen=True)
class Share:
    """How many cases (budget pairs, layer sizes, runs) hold: every one ``every`` (reproduced),
    some partly, none ``none`` (not reproduced). Where the evidence can give no more than partly
    (``every="partly reproduced"``) or no less (``none="partly reproduced"``), say so. No cases:
    not measured."""

    flags: str
    every: str = REPRODUCED
    none: str = NOT_REPRODUCED

    def judge(self, values: dict) -> Outcome:
        flags = [bool(f) for f in values[self.flags]]
        if not flags:
            return Outcome(NOT_MEASURED, "no cases")
        held = sum(flags)
        why = f"{held}/{len(flags)} hold"
        return Outcome(self.every if held == len(flags) else PARTLY if held else self.none, why)


@dataclass(frozen=True)
class Conditions:
    """A main condition and further ones: reproduced when all hold, partly when only the main one
    does, not reproduced without it (e.g. "less blocked time" and then "with the same bytes")."""

    main: str
    also: tuple[str, ...] = ()

    def judge(self, values: dict) -> Outcome:
        failed = [name for name in self.also if not values[name]]
        if not values[self.main]:
            return Outcome(NOT_REPRODUCED, f"{self.main} does not hold")
        if failed:
            return Outcome(PARTLY, f"{self.main} holds; not {', '.join(failed)}")
        return Outcome(REPRODUCED, f"{', '.join((self.main, *self.also))} hold")


@dataclass(frozen=True)
class ClosesGap:
    """A variant closing a baseline's gap to the reference (accuracy points): no gap to close
    (``gap <= tolerance``) is not reproduced; a remaining gap within the tolerance reproduced; at
    most half the gap remaining partly; more not reproduced. ``baseline``, ``reference`` and
    ``variant`` name the three in the rule's words (templates over the measurement's values)."""

    gap: str
    remaining: str
    tolerance: str | float
    baseline: str = "the baseline"
    reference: str = "the reference"
    variant: str = "the variant"

    def judge(self, values: dict) -> Outcome:
        gap, left, tol = (_number(values, k) for k in (self.gap, self.remaining, self.tolerance))
        baseline, reference, variant = (s.format_map(values) for s in (self.baseline, self.reference, self.variant))
        if gap <= tol:
            return Outcome(NOT_REPRODUCED, f"no gap to close at this scale: {baseline} is {-gap:+.2f} pp against "
                                           f"{reference}, not more than the tolerance ({tol:.2f} pp) below it")
        if left <= tol:
            return Outcome(REPRODUCED, f"{variant} within {tol:.2f} pp of {reference}")
        if left <= gap / 2:
            return Outcome(PARTLY, f"{variant} closes at least half of the gap")
        return Outcome(NOT_REPRODUCED, f"{variant} does not close half of the gap")


@dataclass(frozen=True)
class Largest:
    """Which case gains most (``values``: case -> gain): reproduced when it is ``expected`` and its
    gain is above ``floor`` (a gain at all), else not reproduced."""

    values: str
    expected: str
    floor: float = 1.0

    def judge(self, values: dict) -> Outcome:
        gains = values[self.values]
        if not gains:
            return Outcome(NOT_MEASURED, "no cases")
        best = max(gains, key=gains.get)
        verdict = REPRODUCED if best == self.expected and gains[best] > self.floor else NOT_REPRODUCED
        return Outcome(verdict, f"largest: {best} ({gains[best]:.2f})")


@dataclass(frozen=True)
class Gain:
    """A gain per seed that must be there and exceed the noise: reproduced when positive on every
    seed, at least ``min_gain`` on average and more than the seed ``spread``; partly when only the
    spread is not exceeded; not reproduced otherwise. No seeds: not measured."""

    gains: str
    spread: str
    min_gain: float = 0.5

    def judge(self, values: dict) -> Outcome:
        gains = _series(values, self.gains)
        if gains.empty:
            return Outcome(NOT_MEASURED, "no paired seeds")
        mean, spread = float(gains.mean()), _number(values, self.spread)
        consistent = bool((gains > 0).all()) and mean >= self.min_gain
        if consistent and mean > spread:
            return Outcome(REPRODUCED, f"gain {mean:+.2f} on every seed, beyond the seed spread {spread:.2f}")
        if consistent:
            return Outcome(PARTLY, "The difference is within the seed spread.")
        return Outcome(NOT_REPRODUCED, f"gain {mean:+.2f}: not at least {self.min_gain:g} on every seed")


@dataclass(frozen=True)
class Consistency:
    """A statement that holds by construction (a byte count from a formula, a density the method is
    set to): consistent or inconsistent, never a reproduction."""

    holds: str

    def judge(self, values: dict) -> Outcome:
        holds = values[self.holds]
        return Outcome(CONSISTENT if holds else INCONSISTENT, "holds" if holds else "does not hold")


@dataclass(frozen=True)
class Unmeasurable:
    """A claim this setting cannot measure (a cluster's scale): always not measured."""

    def judge(self, values: dict) -> Outcome:
        return Outcome(NOT_MEASURED, "not measurable in this setting")


def finite(value) -> bool:
    """Whether a measured number is there (not None, not NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))
