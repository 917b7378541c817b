"""The shared rules that turn a claim's measurement into a verdict (README, "Reading a report";
docs/claims.md, "The verdicts" and "The rules", gives each verdict's decision rule).

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
    AccuracyMatch("ours", "dense", margin=1)    a paired gap within a margin beyond the noise, at convergence
    Gain("gains", min_gain=0.5)                 a per-seed gain beyond the noise and large enough
    Better("cases")                             paired comparisons, one per case, each beyond the noise
    SpeedTrend("ratios", paper=(1.46, 1.95))    faster on emulated links, more so as they slow
    Share("flags")                              all cases hold; partly some
    Consistency("holds")                        a check of our own accounting, not a reproduction
    NotTestable("needs a 32-GPU cluster")       a claim this scale cannot test

The verdicts (:data:`commlab.report.claims.VERDICTS`) keep what was measured apart from what this
setting cannot decide: "contradicted" only where the claim's premise holds here and the
measurement goes against it beyond the noise; "inconclusive" where the noise decides nothing (the
words say how many seeds would); "not testable at this scale" where the premise is absent or the
paper's regime out of reach; "not testable at this budget" where the runs have not converged.
Noisy comparisons are paired over seeds (:mod:`commlab.report.paired`). A measured value that is
NaN passes no comparison. Bounds and thresholds are numbers, or names of values of the
measurement (``bound="allowed"``: a bound computed from the runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from commlab.report.bench import link_mbit
from commlab.report.claims import (
    CONSISTENT,
    CONTRADICTED,
    INCONCLUSIVE,
    INCONSISTENT,
    NOT_MEASURED,
    PARTLY,
    REPRODUCED,
    UNCONVERGED,
    UNTESTABLE,
)
from commlab.report.convergence import Trend
from commlab.report.metrics import ACCURACY, TASK_METRICS
from commlab.report.paired import MAX_SEEDS, decide_text, difference, of_differences, seeds_to_decide

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
                   higher_is_better: bool = True, trend: Trend | None = None) -> tuple[str, str]:
    """(text, verdict) for "our accuracy is within ``margin`` points of the reference's", or with
    ``at_least`` for "no more than ``margin`` points below it" (a claim of similar or better accuracy).
    Any task's metric (:mod:`commlab.report.metrics`) in its ``unit``; with ``higher_is_better``
    false (perplexity) "below" becomes "above": a shortfall is a higher value.

    ``ours`` and ``reference`` are final values, best as Series indexed by seed: the gap is then
    paired over the seeds both have (:func:`commlab.report.paired.difference`; unpaired where the
    seeds do not match, and the text says so). With a ``trend`` (:mod:`commlab.report.convergence`)
    the comparison is judged only once it has converged: not testable at this budget while the
    reference still improves or the gap still closes (the text says by how much; the gap at each
    evaluation, ``trend.describe()``, belongs in the claim's note). Then, with h = t(0.95, n - 1) x the gap's
    standard error and the shortfall = |gap| (or the gap on the worse side with ``at_least``):
    reproduced when shortfall + h <= margin (the whole 90% interval within the margin), contradicted
    when shortfall - h > margin (outside it beyond the noise), inconclusive otherwise (and with one
    seed), with the seeds that would decide it."""
    diff = difference(ours, reference)
    if diff is None:
        return "no runs", NOT_MEASURED
    bound = f"at most {margin:.3g} {'below' if higher_is_better else 'above'}" if at_least else f"margin {margin:.3g}"
    text = f"gap {diff.describe(unit)}, {bound}"
    if trend is not None and (unsettled := trend.unsettled(margin, higher_is_better, at_least, unit)):
        return f"not converged: {unsettled}; final {text}", UNCONVERGED
    worse = -diff.mean if higher_is_better else diff.mean
    shortfall = worse if at_least else abs(diff.mean)
    if diff.n < 2:
        return f"{text}; {decide_text(diff, 0.0)}", INCONCLUSIVE
    if shortfall + diff.half_width <= margin:
        return text, REPRODUCED
    if shortfall - diff.half_width > margin:
        return text, CONTRADICTED
    return f"{text}; within the noise of the margin: {decide_text(diff, abs(margin - shortfall))}", INCONCLUSIVE


def faster_on_slow_links(ratios: pd.Series, paper: tuple[float, float] | None = None,
                         slowest_repeats: list[float] | tuple[float, ...] = ()) -> tuple[str, str]:
    """(text, verdict) for "faster than the reference, more so as bandwidth falls".

    ``ratios``: the method's throughput over the reference's per network (fastest link first).
    The trend is judged on every link: the gain must not fall as the bandwidth falls (within
    ``FASTER - 1`` of noise between neighbours). ``paper``: the paper's range of speed-ups on its
    slowest setting; when given, the magnitude on our slowest link is set beside it.

    Reproduced: faster on every emulated link, the gain grows as bandwidth falls, and (with
    ``paper``) the slowest link's gain reaches the paper's lower bound. Partly: faster on the
    slowest link but the trend or the magnitude falls short. No faster than ``FASTER`` on the slowest
    link: contradicted when every repeat there (``slowest_repeats``, the ratio of each interleaved
    repeat) is no faster either, so that the repeats' own spread cannot explain it; inconclusive when
    one of them is faster, or when there are no repeats to judge the noise by."""
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
    if not len(slowest_repeats):
        return f"{text}; one measurement of the slowest link: no spread to judge the noise by", INCONCLUSIVE
    repeats = ", ".join(f"{r:.2f}x" for r in slowest_repeats)
    if max(slowest_repeats) > FASTER:
        return f"{text}; the slowest link's repeats {repeats}: within their spread", INCONCLUSIVE
    return f"{text}; every repeat on the slowest link at most {FASTER:g}x ({repeats})", CONTRADICTED


# ---- rules ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Within:
    """A measured distance within a tolerance: ``value <= bound`` reproduced; with ``partly`` (a
    factor), ``value <= partly * bound`` partly reproduced; otherwise contradicted (a bound that
    holds the noise, e.g. twice a standard error, is given as ``bound``)."""

    value: str
    bound: str | float
    partly: float | None = None

    def judge(self, values: dict) -> Outcome:
        value, bound = _number(values, self.value), _number(values, self.bound)
        if value <= bound:
            return Outcome(REPRODUCED, f"{value:.4g} <= {bound:.4g}")
        if self.partly is not None and value <= self.partly * bound:
            return Outcome(PARTLY, f"{value:.4g} <= {self.partly:g} x {bound:.4g}")
        return Outcome(CONTRADICTED, f"{value:.4g} > {(self.partly or 1):g} x {bound:.4g}")


@dataclass(frozen=True)
class Reaches:
    """A number reaching the paper's (a saving, a speed-up, a correlation): ``value >= target``
    (``> target`` with ``strict``, for "more than") reproduced; partly when the value is above
    ``floor`` or when ``near`` (the same number under a looser condition, e.g. at any accuracy)
    reaches the target; otherwise contradicted. ``reachable`` names the largest value this setting
    can show at all (a saving that still leaves a run some reductions, the samples of a whole run):
    below the target, the claim is not testable at this scale, whatever was measured."""

    value: str
    target: str | float
    strict: bool = False
    floor: float | None = None
    near: str | None = None
    reachable: str | None = None

    def judge(self, values: dict) -> Outcome:
        value, target = _number(values, self.value), _number(values, self.target)
        word = "more than" if self.strict else "at least"
        if self.reachable is not None and not _passes(top := _number(values, self.reachable), target, self.strict):
            return Outcome(UNTESTABLE, f"this setting can show at most {_num(top)}, not {word} {_num(target)}: "
                                       f"out of reach by construction (measured {_num(value)})")
        if _passes(value, target, self.strict):
            return Outcome(REPRODUCED, f"{_num(value)}: {word} {_num(target)}")
        if self.floor is not None and value > self.floor:
            return Outcome(PARTLY, f"{_num(value)}: above {self.floor:g}, short of {_num(target)}")
        if self.near is not None and _passes(near := _number(values, self.near), target, self.strict):
            return Outcome(PARTLY, f"{_num(value)} short of {_num(target)}; {_num(near)} under the looser condition")
        return Outcome(CONTRADICTED, f"{_num(value)}: not {word} {_num(target)}")


@dataclass(frozen=True)
class Below:
    """A bound such as a volume per worker: every value strictly below ``bound``; reproduced with at
    least ``min_points`` values (e.g. worker counts), partly with fewer; contradicted when one
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
            return Outcome(CONTRADICTED, f"largest {worst:.4g} >= {self.bound:g}")
        if len(points) < self.min_points:
            return Outcome(PARTLY, f"below {self.bound:g} at {len(points)} points, fewer than {self.min_points}")
        return Outcome(REPRODUCED, f"largest {worst:.4g} < {self.bound:g} at {len(points)} points")


@dataclass(frozen=True)
class AccuracyMatch:
    """:func:`accuracy_match` on two series of final values (one per seed, indexed by seed: paired).
    ``margin`` is a number or the name of a value; ``metric``, when given, names the value that
    holds the task's metric (``"test_perplexity"``, :data:`commlab.report.metrics.TASK_METRICS`):
    the gap is then in that metric, lower being better for perplexity. ``trend`` names the value
    holding the comparison's :class:`~commlab.report.convergence.Trend`: judged only at convergence."""

    ours: str
    reference: str
    margin: float | str = 1.0
    at_least: bool = False
    metric: str | None = None
    trend: str | None = None

    def judge(self, values: dict) -> Outcome:
        task = TASK_METRICS[values[self.metric]] if self.metric else ACCURACY
        text, verdict = accuracy_match(values[self.ours], values[self.reference], _number(values, self.margin),
                                       self.at_least, task.unit, task.higher_is_better,
                                       values.get(self.trend) if self.trend else None)
        return Outcome(verdict, text)


@dataclass(frozen=True)
class Gain:
    """A gain per seed (a paired difference: an accuracy with a component minus without it, a
    speed-up minus 1) that must be there beyond the noise and large enough. With its 90% interval
    (:mod:`commlab.report.paired`): reproduced when the interval is above 0 and the mean at least
    ``min_gain``; partly when above 0 with a smaller mean; contradicted when the interval lies below
    ``min_gain`` (no gain of that size, beyond the noise); inconclusive otherwise, with the seeds
    that would decide it. No seeds: not measured.

    ``trend`` names the value holding the :class:`~commlab.report.convergence.Trend` of an
    accuracy gain over the runs' evaluations: where the gap still moves by more than half of
    ``margin`` between the last two, the gain is not testable at this budget (a gain measured
    before it settles may yet change sign or size); a trend of None is not checked."""

    gains: str
    min_gain: float = 0.5
    unit: str = "points"
    trend: str | None = None
    margin: float = 1.0

    def judge(self, values: dict) -> Outcome:
        gain = of_differences(values[self.gains])
        if gain is None:
            return Outcome(NOT_MEASURED, "no paired seeds")
        text = f"gain {gain.describe(self.unit)}"
        trend = values.get(self.trend) if self.trend else None
        if trend is not None and (moving := trend.gap_moving(self.margin, self.unit)):
            return Outcome(UNCONVERGED, f"{text}; not settled: {moving}; {trend.describe(self.unit)}")
        if gain.n < 2:
            return Outcome(INCONCLUSIVE, f"{text}; {decide_text(gain, 0.0)}")
        if gain.low > 0:
            if gain.mean >= self.min_gain:
                return Outcome(REPRODUCED, f"{text}: above 0 beyond the noise, at least {self.min_gain:g} on average")
            return Outcome(PARTLY, f"{text}: above 0 beyond the noise, but less than {self.min_gain:g} on average")
        if gain.high < self.min_gain:
            return Outcome(CONTRADICTED, f"{text}: below {self.min_gain:g} beyond the noise")
        distance = max(gain.mean, self.min_gain - gain.mean)
        return Outcome(INCONCLUSIVE, f"{text}: within the noise; {decide_text(gain, distance)}")


@dataclass(frozen=True)
class Better:
    """Paired comparisons, one per case (e.g. per budget pair): ``cases`` is a list of
    ``(label, difference, condition)`` with the :class:`~commlab.report.paired.Difference` oriented
    so that a positive one is the claim's direction, and ``condition`` a further requirement of the
    case (e.g. no more synchronisations). A case holds when its difference is above 0 beyond the
    noise and its condition holds, fails when the difference is below 0 beyond the noise or the
    condition fails, and is unclear otherwise. Reproduced when every case holds, partly when some
    do, contradicted when some fail and none holds, inconclusive when all are unclear (with the
    seeds that would decide the closest case). No cases: not measured."""

    cases: str

    def judge(self, values: dict) -> Outcome:
        cases = [c for c in values[self.cases] if c[1] is not None]
        if not cases:
            return Outcome(NOT_MEASURED, "no cases")
        held, failed, unclear = [], [], []
        for label, diff, condition in cases:
            if not condition or (diff.n >= 2 and diff.high < 0):
                failed.append(label)
            elif diff.n >= 2 and diff.low > 0:
                held.append(label)
            else:
                unclear.append((label, diff))
        why = f"{len(held)}/{len(cases)} hold beyond the noise, {len(failed)} fail, {len(unclear)} within the noise"
        if len(held) == len(cases):
            return Outcome(REPRODUCED, why)
        if held:
            return Outcome(PARTLY, why)
        if failed:
            return Outcome(CONTRADICTED, why)
        label, diff = min(unclear, key=lambda case: seeds_to_decide(case[1], abs(case[1].mean)) or MAX_SEEDS + 1)
        return Outcome(INCONCLUSIVE, f"{why}; {label}: {decide_text(diff, abs(diff.mean))}")


@dataclass(frozen=True)
class SpeedTrend:
    """:func:`faster_on_slow_links` on one ratio per network (fastest link first); ``why`` is the
    ratios as text (and the paper's range beside our slowest link's gain)."""

    ratios: str
    paper: tuple[float, float] | None = None
    repeats: str | None = None  # the value holding the slowest link's per-repeat ratios

    def judge(self, values: dict) -> Outcome:
        repeats = values.get(self.repeats, ()) if self.repeats else ()
        text, verdict = faster_on_slow_links(values[self.ratios], self.paper, repeats)
        return Outcome(verdict, text)


#: How several outcomes combine when none is reproduced or partly: the first kind present wins.
_PRECEDENCE = (CONTRADICTED, INCONCLUSIVE, UNCONVERGED, UNTESTABLE, NOT_MEASURED)


@dataclass(frozen=True)
class AllOf:
    """Several rules on one measurement: reproduced when every one is, partly when one is at least
    partly; otherwise the first of contradicted, inconclusive, not testable at this budget, not
    testable at this scale, not measured that one of them gave. ``why`` holds each rule's words in
    order (``{why[0]}``)."""

    rules: tuple

    def judge(self, values: dict) -> Outcome:
        outcomes = [rule.judge(values) for rule in self.rules]
        verdicts = {o.verdict for o in outcomes}
        if verdicts == {REPRODUCED}:
            verdict = REPRODUCED
        elif verdicts & {REPRODUCED, PARTLY}:
            verdict = PARTLY
        else:
            verdict = next(v for v in _PRECEDENCE if v in verdicts)
        return Outcome(verdict, tuple(o.why for o in outcomes))


@dataclass(frozen=True)
class Share:
    """How many cases (budget pairs, layer sizes, runs) hold: every one ``every`` (reproduced),
    some partly, none ``none`` (contradicted). Where the evidence can give no more than partly
    (``every="partly reproduced"``) or no less (``none="partly reproduced"``), say so. No cases:
    not measured."""

    flags: str
    every: str = REPRODUCED
    none: str = CONTRADICTED

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
    does, contradicted without it (e.g. "less blocked time" and then "with the same bytes")."""

    main: str
    also: tuple[str, ...] = ()

    def judge(self, values: dict) -> Outcome:
        failed = [name for name in self.also if not values[name]]
        if not values[self.main]:
            return Outcome(CONTRADICTED, f"{self.main} does not hold")
        if failed:
            return Outcome(PARTLY, f"{self.main} holds; not {', '.join(failed)}")
        return Outcome(REPRODUCED, f"{', '.join((self.main, *self.also))} hold")


@dataclass(frozen=True)
class ClosesGap:
    """A variant closing a baseline's gap to the reference (accuracy points). ``gap`` and
    ``remaining`` name :class:`~commlab.report.paired.Difference` values: the reference minus the
    baseline, and the reference minus the variant (paired over seeds; None without the variant's
    runs, which only the premise can then decide). No gap beyond the tolerance
    (``gap.mean <= tolerance``): the claim's premise is absent, not testable at this scale; a gap
    not above 0 beyond the noise: inconclusive. Then, with the remaining gap's 90% interval:
    reproduced when it lies within the tolerance, partly when within half the gap, contradicted when
    more than half the gap remains beyond the noise, inconclusive otherwise. ``baseline``,
    ``reference`` and ``variant`` name the three in the rule's words (templates over the values)."""

    gap: str
    remaining: str
    tolerance: str | float
    baseline: str = "the baseline"
    reference: str = "the reference"
    variant: str = "the variant"

    def judge(self, values: dict) -> Outcome:
        gap, left = values[self.gap], values[self.remaining]
        tol = _number(values, self.tolerance)
        baseline, reference, variant = (s.format_map(values) for s in (self.baseline, self.reference, self.variant))
        if gap is None:
            return Outcome(NOT_MEASURED, "no paired runs")
        if not gap.mean > tol:
            return Outcome(UNTESTABLE, f"no gap to close at this scale: {baseline} is {-gap.mean:+.2f} pp against "
                                       f"{reference}, not more than the tolerance ({tol:.2f} pp) below it")
        if left is None:
            return Outcome(NOT_MEASURED, f"no runs of {variant}")
        if gap.n < 2 or not gap.low > 0:
            return Outcome(INCONCLUSIVE, f"the gap {reference} - {baseline} is within the noise: {gap.describe('pp')}; "
                                         f"{decide_text(gap, gap.mean)}")
        half = gap.mean / 2
        if left.n >= 2 and left.high <= tol:
            return Outcome(REPRODUCED, f"{variant} within {tol:.2f} pp of {reference} beyond the noise")
        if left.n >= 2 and left.high <= half:
            return Outcome(PARTLY, f"{variant} closes at least half of the gap beyond the noise")
        if left.n >= 2 and left.low > half:
            return Outcome(CONTRADICTED, f"{variant} leaves more than half of the gap beyond the noise "
                                         f"({left.describe('pp')})")
        return Outcome(INCONCLUSIVE, f"what {variant} leaves of the gap is within the noise: {left.describe('pp')}; "
                                     f"{decide_text(left, abs(left.mean - half))}")


@dataclass(frozen=True)
class Largest:
    """Which case gains most (``values``: case -> gain): reproduced when it is ``expected`` and its
    gain is above ``floor`` (a gain at all), else contradicted."""

    values: str
    expected: str
    floor: float = 1.0

    def judge(self, values: dict) -> Outcome:
        gains = values[self.values]
        if not gains:
            return Outcome(NOT_MEASURED, "no cases")
        best = max(gains, key=gains.get)
        verdict = REPRODUCED if best == self.expected and gains[best] > self.floor else CONTRADICTED
        return Outcome(verdict, f"largest: {best} ({gains[best]:.2f})")


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
    """A claim whose measurement did not run here (no benchmark on emulated links): always not
    measured; the note says what would measure it."""

    def judge(self, values: dict) -> Outcome:
        return Outcome(NOT_MEASURED, "not measured in this run")


@dataclass(frozen=True)
class NotTestable:
    """A claim this scale cannot test (a cluster's worker count, a paper-scale dataset): always not
    testable at this scale, ``needs`` saying what would test it (a template over the values)."""

    needs: str

    def judge(self, values: dict) -> Outcome:
        return Outcome(UNTESTABLE, self.needs.format_map(values))
