"""Whether an accuracy comparison has converged (commlab.report.convergence), on hand-made long
histories shaped like ``Evidence.history``: the seed-mean reference and the per-seed gap at the
evaluations both sides logged, and the numbers that say "still moving"."""

import pandas as pd
import pytest

from commlab.report.convergence import PLATEAU, Trend, evaluation_trend


def history(curves: dict[tuple[str, int], list[tuple[int, float]]], metric: str = "test_accuracy") -> pd.DataFrame:
    """(run name, seed) -> [(step, value)] in the long form reports read; the run id is name-seed."""
    return pd.DataFrame([{"run_id": f"{name}-{seed}", "name": name, "method": name, "seed": seed, "metric": metric,
                          "step": step, "value": value}
                         for (name, seed), points in curves.items() for step, value in points])


CURVES = {("oktopk", 0): [(96, 80.0), (192, 84.0)], ("oktopk", 1): [(96, 79.0), (192, 83.5)],
          ("ssgd", 0): [(96, 85.0), (192, 86.5)], ("ssgd", 1): [(96, 84.8), (192, 86.3)],
          ("ssgd", 2): [(96, 85.2), (192, 86.9)]}  # seed 2 of ssgd has no partner


def test_the_trend_pairs_each_evaluation_by_seed():
    trend = evaluation_trend(history(CURVES), ["oktopk-0", "oktopk-1"], ["ssgd-0", "ssgd-1", "ssgd-2"],
                             "test_accuracy")
    assert trend.steps == (96, 192)
    # the reference: its mean over all its seeds; the gap: over the seeds both evaluated
    assert trend.reference == pytest.approx(((85.0 + 84.8 + 85.2) / 3, (86.5 + 86.3 + 86.9) / 3))
    assert trend.gap == pytest.approx((((80.0 - 85.0) + (79.0 - 84.8)) / 2, ((84.0 - 86.5) + (83.5 - 86.3)) / 2))
    assert trend.describe() == ("gap by evaluation (step 96, 192): -5.40, -2.65 points; reference 85.00, 86.57")


def test_steps_only_one_side_evaluated_are_left_out_and_unmatched_seeds_compare_means():
    curves = {("a", 0): [(10, 50.0), (20, 60.0), (30, 70.0)], ("b", 1): [(20, 65.0), (30, 72.0)]}
    trend = evaluation_trend(history(curves), ["a-0"], ["b-1"], "test_accuracy")
    assert trend.steps == (20, 30) and trend.gap == pytest.approx((-5.0, -2.0))


def test_no_history_no_trend():
    empty = evaluation_trend(pd.DataFrame(), ["a"], ["b"], "test_accuracy")
    assert empty == Trend((), (), ()) and empty.describe() == "no evaluation history"
    assert empty.unsettled(1.0) == "0 evaluations: no trend measured"
    other = evaluation_trend(history(CURVES), ["oktopk-0"], ["ssgd-0"], "test_perplexity")
    assert other.steps == ()


@pytest.mark.parametrize(("reference", "gap", "why"), [
    ((85.0, 85.4), (-2.0, -1.6), ""),  # both within half the margin: settled
    ((85.0, 85.6), (-2.0, -1.9), "the reference still improves by 0.60 points between its last two evaluations "
                                 "(more than 0.5 x the margin, 0.50)"),
    ((85.0, 85.1), (-2.0, -1.4), "the gap still closes by 0.60 points (more than 0.5 x the margin, 0.50)"),
    ((85.0, 85.1), (-1.0, -2.0), ""),  # a gap that opens is not closing
    ((85.0, 84.0), (+0.9, +0.2), "the gap still closes by 0.70 points (more than 0.5 x the margin, 0.50)"),
])
def test_still_moving_means_more_than_half_the_margin(reference, gap, why):
    assert PLATEAU == 0.5
    assert Trend((1, 2), reference, gap).unsettled(1.0) == why


def test_one_sided_claims_count_only_a_shortfall_closing():
    ahead_then_level = Trend((1, 2), (85.0, 85.1), (0.8, 0.1))  # ours ahead, less so: no shortfall moved
    assert ahead_then_level.unsettled(1.0, at_least=True) == ""
    assert ahead_then_level.unsettled(1.0) != ""  # |gap| shrank by 0.7
    behind = Trend((1, 2), (85.0, 85.1), (-1.2, -0.6))
    assert behind.unsettled(1.0, at_least=True) == "the gap still closes by 0.60 points (more than 0.5 x the " \
                                                    "margin, 0.50)"


def test_lower_is_better_for_perplexity():
    improving = Trend((1, 2), (130.0, 120.0), (4.0, 4.0))
    assert improving.unsettled(2.4, higher_is_better=False, unit="perplexity") == (
        "the reference still improves by 10.00 perplexity between its last two evaluations (more than 0.5 x the "
        "margin, 1.20)")
    assert Trend((1, 2), (120.0, 120.5), (4.0, 4.0)).unsettled(2.4, higher_is_better=False) == ""


@pytest.mark.parametrize(("gap", "why"), [
    ((-10.86, -5.38), "the gap still moves by +5.48 points between the last two evaluations (more than 0.5 x the "
                      "margin, 0.50)"),
    ((2.0, 1.2), "the gap still moves by -0.80 points"),  # a gain shrinking counts as moving too
    ((1.93, 2.21), ""),
    ((1.0, 1.5), ""),  # exactly half the margin: settled
])
def test_a_gain_settles_when_its_gap_moves_by_at_most_half_the_margin(gap, why):
    trend = Trend((60, 120), (75.0, 80.0), gap)
    moving = trend.gap_moving(1.0)
    assert moving.startswith(why) and bool(moving) == bool(why)
    assert Trend((120,), (80.0,), gap[-1:]).gap_moving(1.0) == "1 evaluation: no trend measured"
