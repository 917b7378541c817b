"""Differences over seeds (commlab.report.paired) against the statistics written out in the test:
paired on the seeds both sides have, Welch's unpaired standard error where they do not match, the
t quantiles against scipy's where it is installed, and "how many seeds would decide it" against a
brute-force search."""

import math

import pandas as pd
import pytest

from commlab.report.paired import MAX_SEEDS, T95, decide_text, difference, of_differences, seeds_to_decide, t95


def test_t_quantiles_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 5, 10, 29, 30, 31, 45, 100, 1000):
        assert t95(df) == pytest.approx(stats.t.ppf(0.95, df), abs=2e-4), df
    assert t95(2.7) == T95[1]  # a fractional df is rounded down: the more cautious quantile
    assert math.isnan(t95(0)) and math.isnan(t95(float("nan")))


def test_t_quantiles_from_a_printed_table():
    for df, printed in {1: 6.314, 2: 2.920, 3: 2.353, 9: 1.833, 20: 1.725, 30: 1.697, 60: 1.671, 120: 1.658}.items():
        assert t95(df) == pytest.approx(printed, abs=1e-3), df


def test_a_paired_difference_is_taken_per_seed():
    ours = pd.Series([80.0, 86.0, 83.0], index=[2, 0, 1])  # any order: matched by seed
    ref = pd.Series([86.5, 83.5, 85.0], index=[0, 1, 2])
    diff = difference(ours, ref)
    gaps = [86.0 - 86.5, 83.0 - 83.5, 80.0 - 85.0]  # seeds 0, 1, 2
    mean = sum(gaps) / 3
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / 2)
    assert diff.paired and diff.seeds == (0, 1, 2) and diff.n == 3 and not diff.unmatched
    assert diff.mean == pytest.approx(mean) and diff.sd == pytest.approx(sd)
    assert diff.se == pytest.approx(sd / math.sqrt(3))
    assert diff.low == pytest.approx(mean - 2.919986 * sd / math.sqrt(3))
    assert diff.high == pytest.approx(mean + 2.919986 * sd / math.sqrt(3))


def test_unmatched_seeds_are_left_out_and_one_common_seed_is_not_a_pair():
    ours = pd.Series([1.0, 2.0, 3.0], index=[0, 1, 2])
    diff = difference(ours, pd.Series([0.5, 1.0, 9.0], index=[0, 1, 7]))
    assert diff.paired and diff.seeds == (0, 1) and diff.unmatched == (2, 7) and diff.mean == pytest.approx(0.75)
    # one seed in common out of three each: compared unpaired, every seed counted
    unpaired = difference(ours, pd.Series([0.0, 1.0, 2.0], index=[2, 5, 6]))
    assert not unpaired.paired and unpaired.mean == pytest.approx(1.0) and unpaired.n == 3
    # Welch: se = sqrt(sd_a^2 / n_a + sd_b^2 / n_b) = sqrt(1/3 + 1/3)
    assert unpaired.se == pytest.approx(math.sqrt(2 / 3))
    assert "unpaired: the seeds do not match, n=3" in unpaired.describe()


def test_several_runs_of_a_seed_are_compared_unpaired_and_say_so():
    diff = difference(pd.Series([1.0, 2.0, 3.0], index=[0, 0, 1]), pd.Series([1.0, 1.0], index=[0, 1]))
    assert not diff.paired and "unpaired: several runs share a seed, n=2" in diff.describe()
    assert "unpaired: no seeds given, n=2" in difference([1.0, 2.0], [1.0, 1.5]).describe()


def test_unequal_groups_unpaired():
    diff = difference([1.0, 2.0, 3.0, 4.0], [1.0, 3.0])
    var_a, var_b = sum((x - 2.5) ** 2 for x in (1, 2, 3, 4)) / 3, 2.0
    assert not diff.paired and diff.n == 2
    assert diff.se == pytest.approx(math.sqrt(var_a / 4 + var_b / 2))
    assert diff.df == 1  # the smaller group's n - 1


def test_one_seed_and_no_values():
    one = difference(pd.Series([84.0], index=[3]), pd.Series([84.5], index=[3]))
    assert one.paired and one.n == 1 and math.isnan(one.se) and math.isnan(one.low)
    assert one.describe() == "-0.50 points (paired over seed 3; one seed: no spread measured)"
    assert decide_text(one, 1.0) == "a spread needs at least 2 seeds"
    assert difference([], [1.0]) is None and difference(pd.Series([float("nan")]), [1.0]) is None


def test_seeds_to_decide_by_brute_force():
    stats = pytest.importorskip("scipy.stats")
    for sd, distance in ((2.0, 0.9), (0.5, 0.5), (1.0, 0.1), (0.2, 3.0)):
        expected = next((n for n in range(2, MAX_SEEDS + 1)
                         if stats.t.ppf(0.95, n - 1) * sd / math.sqrt(n) < distance), None)
        assert seeds_to_decide(of_differences([0.0, sd * math.sqrt(2)]), distance) == expected, (sd, distance)
    assert of_differences([0.0, 2.0 * math.sqrt(2)]).sd == pytest.approx(2.0)


def test_seeds_to_decide_edge_cases():
    assert seeds_to_decide(of_differences([1.0]), 1.0) is None  # no spread
    assert seeds_to_decide(of_differences([1.0, 1.0]), 0.5) == 2  # no noise: 2 seeds already decide
    assert seeds_to_decide(of_differences([1.0, 2.0]), 0.0) is None  # on the bound: never
    text = decide_text(of_differences([0.0, 1.0]), 0.001)
    assert text == f"more than {MAX_SEEDS} seeds would be needed at this spread (the mean sits on the bound)"


def test_gains_taken_per_seed_keep_their_seeds():
    gains = of_differences(pd.Series([0.4, 0.6], index=[5, 6]))
    assert gains.seeds == (5, 6) and gains.mean == pytest.approx(0.5) and gains.paired
    assert of_differences([0.4, 0.6]).describe("x").startswith("+0.50 x (paired over seeds n=2; s.e. 0.10;")
    assert of_differences([]) is None
