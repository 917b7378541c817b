"""Differences between two methods over seeds: the statistics behind every verdict on noisy numbers
(docs/claims.md, "Statistics").

Runs of two methods with the same seed share their data order and their initialisation, so most
of what makes one seed better than another cancels in their difference. A comparison is therefore
**paired**: the per-seed differences ``ours[s] - reference[s]`` over the seeds both have, their
mean, standard deviation and standard error ``sd / sqrt(n)`` with ``n - 1`` degrees of freedom.
Only where fewer than two seeds match does it fall back to **unpaired** means (Welch: the standard
error ``sqrt(sd_a^2 / n_a + sd_b^2 / n_b)``, the smaller group's ``n - 1`` degrees of freedom), and
it says so.

Every test on a difference is one-sided at 5%: a bound is passed "beyond the noise" when the
mean is past it by more than ``t(0.95, df) x se``, i.e. the 90% two-sided interval lies on one
side of it (two one-sided tests, the usual test of equivalence). With one seed no spread is
measured and nothing is beyond the noise.

    diff = difference(ours, reference)        # pandas Series indexed by seed
    diff.mean, diff.se, diff.low, diff.high   # low/high: the 90% interval
    diff.describe("points")                   # '-2.83 points (paired over seeds 0, 1, 2; s.e. 0.21; ...)'
    gains = of_differences(per_seed_gains)    # differences already taken per seed (a speed-up - 1, ...)
    seeds_to_decide(diff, distance=0.8)       # seeds at which the interval would clear a bound 0.8 away

Invariants: values indexed by seed are paired on the seeds they share, never by position; a plain
list (no seeds) is unpaired; NaN values are dropped before anything is counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

#: Student's t, one-sided 95% quantile, by degrees of freedom 1..30 (larger: the series below).
T95 = (6.313752, 2.919986, 2.353363, 2.131847, 2.015048, 1.943180, 1.894579, 1.859548, 1.833113, 1.812461,
       1.795885, 1.782288, 1.770933, 1.761310, 1.753050, 1.745884, 1.739607, 1.734064, 1.729133, 1.724718,
       1.720743, 1.717144, 1.713872, 1.710882, 1.708141, 1.705618, 1.703288, 1.701131, 1.699127, 1.697261)
Z95 = 1.6448536269514722  # the normal quantile the t quantiles tend to
MAX_SEEDS = 50  # "how many seeds would decide it" is not counted beyond this


def t95(df: float) -> float:
    """Student's t one-sided 95% quantile at ``df`` degrees of freedom (a fractional df is rounded
    down: the larger, more cautious quantile); NaN below one degree of freedom."""
    if not df >= 1:
        return float("nan")
    whole = int(df)
    if whole <= len(T95):
        return T95[whole - 1]
    z = Z95  # Cornish-Fisher series in 1/df: within 1e-4 of the quantile above 30 degrees of freedom
    return z + (z**3 + z) / (4 * whole) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * whole**2)


def _numbers(values) -> pd.Series:
    """Values as floats, NaN dropped; a Series keeps its index (seeds), anything else has none."""
    if isinstance(values, pd.Series):
        return pd.to_numeric(values, errors="coerce").astype(float).dropna()
    return pd.Series(list(values), dtype=float).dropna().reset_index(drop=True)


@dataclass(frozen=True)
class Difference:
    """The difference ours - reference over seeds, paired or not, with its noise."""

    mean: float
    sd: float  # s.d. of the per-seed differences (paired) or sqrt(sd_a^2 + sd_b^2) (unpaired); NaN with n < 2
    n: int  # seeds paired, or the smaller group's seeds (unpaired)
    paired: bool
    seeds: tuple = ()  # the seeds paired
    unmatched: tuple = ()  # seeds of either side left out of the pairing
    unpaired_because: str = "the seeds do not match"  # why an unpaired comparison is not paired

    @property
    def df(self) -> float:
        return self.n - 1

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.n) if self.n >= 2 else float("nan")

    @property
    def half_width(self) -> float:
        """t(0.95, n - 1) x se: how far the mean must be past a bound to be past it beyond the noise."""
        return t95(self.df) * self.se if self.n >= 2 else float("nan")

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def describe(self, unit: str = "points") -> str:
        """'-2.83 points (paired over seeds 0, 1, 2; s.e. 0.21; 90% interval -3.44 to -2.22)'."""
        named = ", ".join(str(s) for s in self.seeds) if self.seeds else f"n={self.n}"
        how = (f"paired over seed{'s' if self.n > 1 else ''} {named}" if self.paired
               else f"unpaired: {self.unpaired_because}, n={self.n}")
        if self.unmatched:
            how += f", seed{'s' if len(self.unmatched) > 1 else ''} {', '.join(str(s) for s in self.unmatched)} "
            how += "left out (unmatched)"
        if self.n < 2:
            return f"{self.mean:+.2f} {unit} ({how}; one seed: no spread measured)"
        return (f"{self.mean:+.2f} {unit} ({how}; s.e. {self.se:.2f}; 90% interval {self.low:+.2f} to "
                f"{self.high:+.2f})")


def difference(ours, reference) -> Difference | None:
    """ours - reference over seeds (None when either side has no value). Series indexed by seed
    are paired on the seeds both have when there are at least two; otherwise (or for plain lists)
    the means are compared unpaired."""
    a, b = _numbers(ours), _numbers(reference)
    if a.empty or b.empty:
        return None
    seeded = isinstance(ours, pd.Series) and isinstance(reference, pd.Series)
    common = sorted(set(a.index) & set(b.index)) if seeded else []
    if seeded and a.index.is_unique and b.index.is_unique and len(common) >= min(2, len(a), len(b)):
        gaps = a.loc[common] - b.loc[common]
        unmatched = tuple(sorted(set(a.index) ^ set(b.index)))
        sd = float(gaps.std(ddof=1)) if len(gaps) > 1 else float("nan")
        return Difference(float(gaps.mean()), sd, len(gaps), True, tuple(common), unmatched)
    n = min(len(a), len(b))
    sd = math.sqrt(a.var(ddof=1) * n / len(a) + b.var(ddof=1) * n / len(b)) if n >= 2 else float("nan")
    because = ("no seeds given" if not seeded else "several runs share a seed"
               if not (a.index.is_unique and b.index.is_unique) else "the seeds do not match")
    return Difference(float(a.mean() - b.mean()), sd, n, False, unpaired_because=because)


def of_differences(values) -> Difference | None:
    """A :class:`Difference` of values that are already per-seed differences (a Series indexed by
    seed, or a list): their mean and spread, paired by construction. None without values."""
    gains = _numbers(values)
    if gains.empty:
        return None
    sd = float(gains.std(ddof=1)) if len(gains) > 1 else float("nan")
    seeds = tuple(gains.index) if isinstance(values, pd.Series) else ()
    return Difference(float(gains.mean()), sd, len(gains), True, seeds)


def seeds_to_decide(diff: Difference, distance: float) -> int | None:
    """The fewest seeds at which a difference with this spread would lie beyond the noise from a
    bound ``distance`` away from its mean: the smallest n >= 2 with t(0.95, n - 1) x sd / sqrt(n) <
    distance, assuming the mean and s.d. stay as measured. None when the spread is not measured
    (one seed) or more than ``MAX_SEEDS`` would be needed (the mean sits on the bound)."""
    if not diff.sd >= 0 or not distance > 0:
        return None
    for n in range(2, MAX_SEEDS + 1):
        if t95(n - 1) * diff.sd / math.sqrt(n) < distance:
            return n
    return None


def decide_text(diff: Difference, distance: float) -> str:
    """'about 7 seeds would decide it', or why no count can be given."""
    if diff.n < 2:
        return "a spread needs at least 2 seeds"
    n = seeds_to_decide(diff, distance)
    if n is None:
        return f"more than {MAX_SEEDS} seeds would be needed at this spread (the mean sits on the bound)"
    return f"about {n} seeds would decide it at this spread"
