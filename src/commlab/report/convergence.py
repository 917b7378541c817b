"""Whether an accuracy comparison has converged: the trend of the reference and of the gap over the
last evaluations (docs/claims.md, "Statistics").

A paper's "as accurate as dense SGD" is a statement about trained models. Runs that stop while the
reference still improves, or while the gap to it is still closing, measure early training: a gap
there says nothing yet about the gap at the end. So an accuracy-parity claim is judged only when
both have settled between the last two evaluations:

* the reference's seed-mean metric improved by no more than ``PLATEAU`` x the claim's margin, and
* the gap (seed mean of the per-seed differences, paired on the seeds both runs evaluated) moved
  toward parity by no more than ``PLATEAU`` x the margin.

Fewer than two evaluations leave the trend unmeasured, which counts as not settled.

    trend = evaluation_trend(history, ours_ids, reference_ids, "test_accuracy")
    trend.unsettled(margin=1.0, higher_is_better=True)   # '' when settled, else why (with the numbers)
    trend.describe("points")                             # 'gap by evaluation (step 96, 192): -5.41, -2.83 ...'

Invariants: read from the long history only (run_id, seed, metric, step, value); steps are the
evaluations both sides logged; a perplexity improves downwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

#: Between the last two evaluations, a change above this fraction of the margin is "still moving".
#: Half: a schedule that anneals to its end still adds a little in its last epoch while the gap
#: between the methods has already settled.
PLATEAU = 0.5


@dataclass(frozen=True)
class Trend:
    """The seed-mean reference value and the seed-mean gap (ours - reference) at each evaluation
    both sides logged, in step order."""

    steps: tuple[int, ...]
    reference: tuple[float, ...]
    gap: tuple[float, ...]

    def unsettled(self, margin: float, higher_is_better: bool = True, at_least: bool = False,
                  unit: str = "points") -> str:
        """Why the comparison has not converged ('' when it has): the reference still improving,
        or the shortfall (|gap|; with ``at_least`` only a gap on the worse side) still shrinking,
        by more than ``PLATEAU`` x ``margin`` between the last two evaluations."""
        if len(self.steps) < 2:
            return f"{len(self.steps)} evaluation{'s' if len(self.steps) != 1 else ''}: no trend measured"
        sign = 1.0 if higher_is_better else -1.0
        step = PLATEAU * margin
        gained = sign * (self.reference[-1] - self.reference[-2])
        shortfall = [(max(0.0, -sign * g) if at_least else abs(g)) for g in self.gap[-2:]]
        closing = shortfall[0] - shortfall[1]
        reasons = []
        if gained > step:
            reasons.append(f"the reference still improves by {gained:.2f} {unit} between its last two evaluations")
        if closing > step:
            reasons.append(f"the gap still closes by {closing:.2f} {unit}")
        if not reasons:
            return ""
        return " and ".join(reasons) + f" (more than {PLATEAU:g} x the margin, {step:.2f})"

    def gap_moving(self, margin: float, unit: str = "points") -> str:
        """Why a gain between the two sides has not settled ('' when it has): the gap (ours -
        reference, paired) still moves, either way, by more than ``PLATEAU`` x ``margin`` between
        the last two evaluations. A gain still growing may yet reach a claim's size; one still
        shrinking may yet vanish."""
        if len(self.steps) < 2:
            return f"{len(self.steps)} evaluation{'s' if len(self.steps) != 1 else ''}: no trend measured"
        moved, step = self.gap[-1] - self.gap[-2], PLATEAU * margin
        if abs(moved) <= step:
            return ""
        return (f"the gap still moves by {moved:+.2f} {unit} between the last two evaluations "
                f"(more than {PLATEAU:g} x the margin, {step:.2f})")

    def describe(self, unit: str = "points") -> str:
        """'gap by evaluation (step 96, 192): -5.41, -2.83 points; reference 80.10, 83.20'."""
        if not self.steps:
            return "no evaluation history"
        steps = ", ".join(str(s) for s in self.steps)
        return (f"gap by evaluation (step {steps}): {', '.join(f'{g:+.2f}' for g in self.gap)} {unit}; "
                f"reference {', '.join(f'{r:.2f}' for r in self.reference)}")


def _by_seed_and_step(history: pd.DataFrame, run_ids, metric: str) -> pd.DataFrame:
    """One column per seed, one row per step: the metric's values of these runs."""
    rows = history[history.run_id.isin(list(run_ids)) & (history.metric == metric)]
    if rows.empty:
        return pd.DataFrame()
    return rows.pivot_table(index="step", columns="seed", values="value", aggfunc="mean")


def evaluation_trend(history: pd.DataFrame, ours_ids, reference_ids, metric: str) -> Trend:
    """The :class:`Trend` of ``metric`` between runs ``ours_ids`` and ``reference_ids`` (their
    evaluations: the steps where both logged it). The gap at a step is paired on the seeds both
    evaluated there, or the difference of the means where none matches."""
    empty = Trend((), (), ())
    if history is None or history.empty or not {"run_id", "metric", "step", "seed"} <= set(history.columns):
        return empty
    ours, ref = _by_seed_and_step(history, ours_ids, metric), _by_seed_and_step(history, reference_ids, metric)
    if ours.empty or ref.empty:
        return empty
    steps = sorted(set(ours.index) & set(ref.index))
    gaps, means = [], []
    for step in steps:
        mine, theirs = ours.loc[step].dropna(), ref.loc[step].dropna()
        common = mine.index.intersection(theirs.index)
        gaps.append(float((mine[common] - theirs[common]).mean()) if len(common)
                    else float(mine.mean() - theirs.mean()))
        means.append(float(theirs.mean()))
    return Trend(tuple(int(s) for s in steps), tuple(means), tuple(gaps))
