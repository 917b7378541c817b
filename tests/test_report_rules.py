"""The shared rules that judge every paper's claims (commlab.report.rules), each on small hand-made
measurements: every outcome a rule can give, at and around its thresholds, and the words it
writes (``why``), which the claims tables show. Noisy comparisons are checked against the paired
statistics written out here: per-seed differences, their mean, s.d. (n - 1) and standard error,
and Student's t one-sided 95% quantiles from a printed table."""

import math

import pandas as pd
import pytest

from commlab.report.convergence import Trend
from commlab.report.paired import Difference
from commlab.report.rules import (
    AccuracyMatch,
    AllOf,
    Below,
    Better,
    ClosesGap,
    Conditions,
    Consistency,
    Gain,
    Largest,
    NotTestable,
    Reaches,
    Share,
    SpeedTrend,
    Unmeasurable,
    Within,
    accuracy_match,
    faster_on_slow_links,
)

R, P, C, UNSURE = "reproduced", "partly reproduced", "contradicted", "inconclusive"
UT, UB, M = "not testable at this scale", "not testable at this budget", "not measured"
NAN = math.nan
T95 = {1: 6.314, 2: 2.920, 4: 2.132, 5: 2.015, 14: 1.761, 15: 1.753}  # Student's t, one-sided 95%, from a table


def seeds(*values) -> pd.Series:
    """Values of seeds 0, 1, 2, ..."""
    return pd.Series(values, dtype=float)


def paired_numbers(ours, ref) -> tuple[float, float]:
    """Mean and half-width t x se of the per-seed differences, written out."""
    gaps = [a - b for a, b in zip(ours, ref, strict=True)]
    n, mean = len(gaps), sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1))
    return mean, T95[n - 1] * sd / math.sqrt(n)


@pytest.mark.parametrize(("value", "bound", "partly", "verdict", "why"), [
    (0.01, 0.02, 2, R, "0.01 <= 0.02"),
    (0.02, 0.02, 2, R, "0.02 <= 0.02"),  # the bound itself is within
    (0.03, 0.02, 2, P, "0.03 <= 2 x 0.02"),
    (0.05, 0.02, 2, C, "0.05 > 2 x 0.02"),
    (0.03, 0.02, None, C, "0.03 > 1 x 0.02"),  # no partly band
    (NAN, 0.02, 2, C, "nan > 2 x 0.02"),
])
def test_within_a_tolerance(value, bound, partly, verdict, why):
    outcome = Within("gap", bound="allowed", partly=partly).judge({"gap": value, "allowed": bound})
    assert (outcome.verdict, outcome.why) == (verdict, why)
    assert Within("gap", bound=bound, partly=partly).judge({"gap": value}).verdict == verdict  # a number as bound


@pytest.mark.parametrize(("rule", "value", "near", "verdict", "why"), [
    (Reaches("v", 0.62, floor=0.0), 0.62, NAN, R, "0.62: at least 0.62"),
    (Reaches("v", 0.62, floor=0.0), 0.3, NAN, P, "0.3: above 0, short of 0.62"),
    (Reaches("v", 0.62, floor=0.0), -0.1, NAN, C, "-0.1: not at least 0.62"),
    (Reaches("v", 0.62, floor=0.0), NAN, NAN, C, "nan: not at least 0.62"),
    (Reaches("v", 0.99, strict=True, floor=0.9), 0.99, NAN, P, "0.99: above 0.9, short of 0.99"),  # "more than"
    (Reaches("v", 0.99, strict=True, floor=0.9, near="n"), 0.995, NAN, R, "0.995: more than 0.99"),
    (Reaches("v", 0.99, strict=True, floor=0.9, near="n"), NAN, 0.995, P,
     "nan short of 0.99; 0.995 under the looser condition"),
    (Reaches("v", 0.99, strict=True, floor=0.9, near="n"), 0.5, 0.98, C, "0.5: not more than 0.99"),
    (Reaches("v", 102_000, near="n"), 60_000, 102_000, P,
     "60,000 short of 102,000; 102,000 under the looser condition"),
    (Reaches("v", 1.05), 1.04, NAN, C, "1.04: not at least 1.05"),  # no partly band without floor or near
])
def test_reaches_the_papers_number(rule, value, near, verdict, why):
    outcome = rule.judge({"v": value, "n": near})
    assert (outcome.verdict, outcome.why) == (verdict, why)


@pytest.mark.parametrize(("reachable", "value", "verdict", "why"), [
    # 279 synchronous steps keeping 10 reductions: at most 1 - 10/279 = 96.4% fewer
    (1 - 10 / 279, 0.5, UT, "this setting can show at most 0.9642, not more than 0.99: out of reach by construction "
                            "(measured 0.5)"),
    (1 - 10 / 279, 0.995, UT, "this setting can show at most 0.9642, not more than 0.99: out of reach by construction "
                              "(measured 0.995)"),
    (1 - 10 / 5000, 0.995, R, "0.995: more than 0.99"),  # a long enough run: judged as measured
    (1 - 10 / 5000, 0.5, C, "0.5: not more than 0.99"),
])
def test_reaches_a_number_out_of_reach_is_not_testable(reachable, value, verdict, why):
    outcome = Reaches("v", 0.99, strict=True, floor=0.9, reachable="r").judge({"v": value, "r": reachable})
    assert (outcome.verdict, outcome.why) == (verdict, why)


@pytest.mark.parametrize(("values", "verdict", "why"), [
    ([4.2, 5.1, 5.9], R, "largest 5.9 < 6 at 3 points"),
    ([4.2, 5.9], P, "below 6 at 2 points, fewer than 3"),
    ([4.2, 6.0, 5.0], C, "largest 6 >= 6"),  # the bound is strict: "less than 6k"
    ([NAN], M, "no values"),
])
def test_below_a_volume_bound(values, verdict, why):
    outcome = Below("worst", 6, min_points=3).judge({"worst": values})
    assert (outcome.verdict, outcome.why) == (verdict, why)


# ---- accuracy parity: paired over seeds, at convergence -------------------------------------------

def test_a_gap_within_the_margin_beyond_the_noise_is_reproduced():
    ours, ref = [84.1, 83.2, 85.0], [84.0, 83.5, 84.4]
    mean, half = paired_numbers(ours, ref)
    assert abs(mean) + half <= 1.0  # the whole 90% interval inside the margin
    text, verdict = accuracy_match(seeds(*ours), seeds(*ref))
    assert verdict == R
    assert text == (f"gap {mean:+.2f} points (paired over seeds 0, 1, 2; s.e. {half / T95[2]:.2f}; 90% interval "
                    f"{mean - half:+.2f} to {mean + half:+.2f}), margin 1")


def test_a_gap_outside_the_margin_beyond_the_noise_is_contradicted():
    ours, ref = [80.5, 81.0, 80.2], [84.0, 84.3, 83.9]
    mean, half = paired_numbers(ours, ref)
    assert abs(mean) - half > 1.0
    text, verdict = accuracy_match(seeds(*ours), seeds(*ref))
    assert verdict == C and text.startswith(f"gap {mean:+.2f} points (paired over seeds 0, 1, 2")


def test_pairing_by_seed_removes_what_the_seeds_share():
    """Seed effects common to both methods (seed 1 high, seed 0 low) cancel in the per-seed gap:
    paired, a steady 1.5-point shortfall is a contradiction; the same numbers without their seeds
    are too noisy to tell."""
    ours, ref = [80.0, 86.0, 83.0], [81.5, 87.5, 84.5]
    text, verdict = accuracy_match(seeds(*ours), seeds(*ref))
    assert verdict == C and "s.e. 0.00" in text
    text, verdict = accuracy_match(ours, ref)  # plain lists: no seeds to pair on
    assert verdict == UNSURE and "unpaired: no seeds given, n=3" in text
    # Welch's standard error, written out: sqrt(sd_a^2/3 + sd_b^2/3) with sd 3 on both sides
    assert f"s.e. {math.sqrt(9 / 3 + 9 / 3):.2f}" in text


def test_a_gap_within_the_noise_says_how_many_seeds_would_decide_it():
    ours, ref = [80.0, 86.0, 83.0], [82.0, 84.0, 83.3]
    gaps = [a - b for a, b in zip(ours, ref, strict=True)]
    mean = sum(gaps) / 3
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / 2)
    distance = 1.0 - abs(mean)  # from the margin
    # the first n at which t(n-1) sd / sqrt(n) falls below the distance, from the printed table
    assert T95[14] * sd / math.sqrt(15) >= distance > T95[15] * sd / math.sqrt(16)
    text, verdict = accuracy_match(seeds(*ours), seeds(*ref))
    assert verdict == UNSURE
    assert text.endswith("within the noise of the margin: about 16 seeds would decide it at this spread")


def test_one_seed_measures_no_spread_and_decides_nothing():
    text, verdict = accuracy_match(seeds(84.0), seeds(84.5))
    assert verdict == UNSURE
    assert text == ("gap -0.50 points (paired over seed 0; one seed: no spread measured), margin 1; a spread needs "
                    "at least 2 seeds")


def test_unmatched_seeds_are_left_out_and_named():
    ours = pd.Series([84.0, 84.2, 90.0], index=[0, 1, 2])
    ref = pd.Series([84.1, 84.1, 70.0], index=[0, 1, 3])
    text, verdict = accuracy_match(ours, ref)
    assert "(paired over seeds 0, 1, seeds 2, 3 left out (unmatched); " in text
    assert text.startswith("gap +0.00 points") and verdict == R  # t(1) = 6.31 x se 0.1 = 0.63: within 1


def test_similar_or_better_is_one_sided():
    above, below = [88.0, 88.2, 87.9], [80.0, 80.2, 79.9]
    ref = [84.0, 84.1, 83.9]
    assert accuracy_match(seeds(*above), seeds(*ref), at_least=True)[1] == R  # far above: no shortfall
    assert accuracy_match(seeds(*above), seeds(*ref))[1] == C  # but not "within a point"
    text, verdict = accuracy_match(seeds(*below), seeds(*ref), at_least=True)
    assert verdict == C and "at most 1 below" in text
    # a shortfall right at the margin: within the noise
    text, verdict = accuracy_match(seeds(82.6, 83.6, 82.9), seeds(84.0, 84.1, 83.9), at_least=True)
    assert verdict == UNSURE and "within the noise of the margin" in text
    assert accuracy_match([], [84.0]) == ("no runs", M)


def test_a_comparison_still_moving_is_not_testable_at_this_budget():
    moving = Trend(steps=(96, 192), reference=(80.10, 83.20), gap=(-5.41, -2.83))
    text, verdict = accuracy_match(seeds(80.0, 80.3, 80.1), seeds(83.0, 83.3, 83.3), trend=moving)
    assert verdict == UB
    assert text.startswith("not converged: the reference still improves by 3.10 points between its last two "
                           "evaluations and the gap still closes by 2.58 points (more than 0.5 x the margin, 0.50); "
                           "final gap -3.07 points (paired over seeds 0, 1, 2")
    assert moving.describe() == "gap by evaluation (step 96, 192): -5.41, -2.83 points; reference 80.10, 83.20"
    # settled: judged as measured
    settled = Trend(steps=(96, 192), reference=(84.00, 84.10), gap=(-0.20, -0.15))
    assert accuracy_match(seeds(84.1, 83.2, 85.0), seeds(84.0, 83.5, 84.4), trend=settled)[1] == R
    # one evaluation: no trend to tell convergence by
    text, verdict = accuracy_match(seeds(84.0, 84.1), seeds(84.0, 84.2), trend=Trend((192,), (84.1,), (-0.05,)))
    assert verdict == UB and text.startswith("not converged: 1 evaluation: no trend measured")


def test_a_gap_that_opens_is_not_closing():
    """Only a gap moving toward parity keeps a comparison open; one that widens is judged once the
    reference has settled."""
    widening = Trend(steps=(96, 192), reference=(84.0, 84.1), gap=(-1.5, -3.0))
    assert accuracy_match(seeds(81.0, 81.2, 80.9), seeds(84.0, 84.2, 84.1), trend=widening)[1] == C


def test_perplexity_improves_downwards_in_the_trend():
    falling = Trend(steps=(10, 20), reference=(120.0, 110.0), gap=(1.0, 1.0))
    text, verdict = accuracy_match(seeds(111, 112), seeds(110, 111), margin=2.2, unit="perplexity",
                                   higher_is_better=False, trend=falling)
    assert verdict == UB and "the reference still improves by 10.00 perplexity" in text
    rising = Trend(steps=(10, 20), reference=(110.0, 110.3), gap=(1.0, 1.0))  # worse, not improving
    assert accuracy_match(seeds(111, 111.1), seeds(110, 110.1), margin=2.2, unit="perplexity",
                          higher_is_better=False, trend=rising)[1] == R


def test_accuracy_match_rule_reads_the_trend_it_names():
    values = {"ours": seeds(84.0, 84.0), "dense": seeds(84.5, 84.5),
              "trend": Trend((1, 2), (80.0, 84.5), (-2.0, -0.5))}
    assert AccuracyMatch("ours", "dense").judge(values).verdict == R  # no trend named: judged as measured
    outcome = AccuracyMatch("ours", "dense", trend="trend").judge(values)
    assert outcome.verdict == UB and outcome.why.startswith("not converged: the reference still improves by 4.50")
    assert AccuracyMatch("ours", "dense", margin=0.2).judge({"ours": seeds(84.0, 84.1),
                                                            "dense": seeds(84.5, 84.6)}).verdict == C
    assert AccuracyMatch("ours", "dense").judge({"ours": [], "dense": [84.5]}).verdict == M


# ---- gains and paired cases -------------------------------------------------------------------------

@pytest.mark.parametrize(("gains", "verdict", "ending"), [
    ([1.0, 1.4, 1.2], R, "above 0 beyond the noise, at least 0.5 on average"),
    ([0.3, 0.35, 0.4], P, "above 0 beyond the noise, but less than 0.5 on average"),
    ([-5.0, -5.5, -5.64], C, "below 0.5 beyond the noise"),  # a loss is never "within the spread"
    ([1.0, -0.2, 0.8], UNSURE, "within the noise; about 6 seeds would decide it at this spread"),
])
def test_gain_beyond_the_noise(gains, verdict, ending):
    outcome = Gain("g", min_gain=0.5).judge({"g": seeds(*gains)})
    mean, half = paired_numbers(gains, [0.0] * len(gains))
    assert outcome.verdict == verdict and outcome.why.endswith(ending)
    assert outcome.why.startswith(f"gain {mean:+.2f} points (paired over seeds 0, 1, 2; s.e. {half / T95[2]:.2f}; "
                                  f"90% interval {mean - half:+.2f} to {mean + half:+.2f})")


def test_gain_seeds_needed_by_the_table():
    gains = [1.0, -0.2, 0.8]
    mean = sum(gains) / 3
    sd = math.sqrt(sum((g - mean) ** 2 for g in gains) / 2)
    distance = max(mean, 0.5 - mean)
    assert T95[4] * sd / math.sqrt(5) >= distance > T95[5] * sd / math.sqrt(6)  # hence "about 6 seeds"


def test_gain_without_a_spread_or_seeds():
    assert Gain("g").judge({"g": seeds(2.0)}).verdict == UNSURE
    assert Gain("g").judge({"g": []}) == type(Gain("g").judge({"g": []}))(M, "no paired seeds")


def diff(mean: float, sd: float, n: int = 3) -> Difference:
    return Difference(mean, sd, n, True, tuple(range(n)))


@pytest.mark.parametrize(("cases", "verdict", "why"), [
    ([("a", diff(1.0, 0.1), True), ("b", diff(0.5, 0.1), True)], R,
     "2/2 hold beyond the noise, 0 fail, 0 within the noise"),
    ([("a", diff(1.0, 0.1), True), ("b", diff(1.0, 0.1), False)], P,  # more syncs: the pair fails
     "1/2 hold beyond the noise, 1 fail, 0 within the noise"),
    ([("a", diff(-1.0, 0.1), True), ("b", diff(0.1, 1.0), True)], C,
     "0/2 hold beyond the noise, 1 fail, 1 within the noise"),
    ([("a", diff(0.1, 1.0), True), ("b", diff(0.5, 0.5), True)], UNSURE,
     "0/2 hold beyond the noise, 0 fail, 2 within the noise; b: about 5 seeds would decide it at this spread"),
    ([("a", None, True)], M, "no cases"),
])
def test_better_in_each_case(cases, verdict, why):
    outcome = Better("cases").judge({"cases": cases})
    assert (outcome.verdict, outcome.why) == (verdict, why)
    # b's count from the table: t(3) 0.5/2 = 0.59 >= 0.5 > t(4) 0.5/sqrt(5) = 0.48
    assert 2.353 * 0.5 / 2 >= 0.5 > T95[4] * 0.5 / math.sqrt(5)


@pytest.mark.parametrize(("gap", "left", "verdict", "why"), [
    (diff(-1.5, 0.3), diff(0.0, 0.1), UT, "no gap to close at this scale: Adam is +1.50 pp against SGD, not more "
                                          "than the tolerance (0.50 pp) below it"),
    (diff(0.4, 0.1), diff(0.4, 0.1), UT, "no gap to close at this scale: Adam is -0.40 pp against SGD, not more than "
                                         "the tolerance (0.50 pp) below it"),
    (diff(2.0, 3.0), diff(0.0, 0.1), UNSURE,
     "the gap SGD - Adam is within the noise: +2.00 pp (paired over seeds 0, 1, 2; s.e. 1.73; 90% interval -3.06 to "
     "+7.06); about 9 seeds would decide it at this spread"),
    (diff(3.0, 0.2), diff(0.1, 0.1), R, "Adam K=16 within 0.50 pp of SGD beyond the noise"),
    (diff(3.0, 0.2), diff(1.0, 0.1), P, "Adam K=16 closes at least half of the gap beyond the noise"),
    (diff(3.0, 0.2), diff(2.5, 0.1), C, "Adam K=16 leaves more than half of the gap beyond the noise (+2.50 pp "
                                        "(paired over seeds 0, 1, 2; s.e. 0.06; 90% interval +2.33 to +2.67))"),
    (diff(3.0, 0.2), diff(1.5, 1.0), UNSURE,
     "what Adam K=16 leaves of the gap is within the noise: +1.50 pp (paired over seeds 0, 1, 2; s.e. 0.58; 90% "
     "interval -0.19 to +3.19); more than 50 seeds would be needed at this spread (the mean sits on the bound)"),
])
def test_closes_gap(gap, left, verdict, why):
    rule = ClosesGap("gap", "left", 0.5, baseline="Adam", reference="SGD", variant="Adam K={k}")
    outcome = rule.judge({"gap": gap, "left": left, "k": 16})
    assert (outcome.verdict, outcome.why) == (verdict, why)
    assert rule.judge({"gap": None, "left": left, "k": 16}).verdict == M


# ---- speed, shares, conditions ----------------------------------------------------------------------

LINKS = ["loopback", "1000Mbit", "100Mbit"]


@pytest.mark.parametrize(("ratios", "verdict"), [
    ([0.9, 1.2, 1.8], R),   # faster on every emulated link, most on the slowest
    ([0.9, 0.95, 1.4], P),  # faster on the slowest link only
    ([0.9, 1.6, 1.3], P),   # faster, but less so on the slower link
])
def test_speed_trend_verdicts(ratios, verdict):
    outcome = SpeedTrend("r").judge({"r": pd.Series(ratios, index=LINKS)})
    assert outcome.verdict == verdict
    assert outcome.why == f"loopback: {ratios[0]:.2f}x, 1000Mbit: {ratios[1]:.2f}x, 100Mbit: {ratios[2]:.2f}x"


@pytest.mark.parametrize(("ratios", "repeats", "verdict", "words"), [
    ([1.0, 1.0, 1.02], [0.98, 1.02, 1.03], C, "every repeat on the slowest link at most 1.05x (0.98x, 1.02x, 1.03x)"),
    ([1.1, 0.9, 0.8], [0.7, 0.8, 0.85], C, "every repeat on the slowest link at most 1.05x (0.70x, 0.80x, 0.85x)"),
    ([1.0, 1.0, 1.02], [0.90, 1.02, 1.20], UNSURE, "the slowest link's repeats 0.90x, 1.02x, 1.20x: within their "
                                                   "spread"),
    ([1.0, 1.0, 1.02], [], UNSURE, "one measurement of the slowest link: no spread to judge the noise by"),
])
def test_no_faster_on_the_slowest_link_is_contradicted_only_beyond_the_repeats_spread(ratios, repeats, verdict,
                                                                                      words):
    outcome = SpeedTrend("r", repeats="rep").judge({"r": pd.Series(ratios, index=LINKS), "rep": repeats})
    assert outcome.verdict == verdict
    assert outcome.why.endswith(words)


@pytest.mark.parametrize(("ratios", "verdict", "words"), [
    ([1.0, 1.3, 1.7], R, "within"),   # trend and magnitude as the paper's
    ([1.0, 1.1, 1.2], P, "below"),    # the trend, but a smaller gain than the paper's
    ([1.0, 1.3, 2.5], R, "above"),
    ([1.0, 1.5, 1.42], P, "below"),   # gain falls on the slowest link
])
def test_speed_trend_sets_the_magnitude_beside_the_papers(ratios, verdict, words):
    outcome = SpeedTrend("r", paper=(1.46, 1.95)).judge({"r": pd.Series(ratios, index=LINKS)})
    assert outcome.verdict == verdict
    assert outcome.why.endswith(f"paper 1.46-1.95x: our slowest link's gain is {words} it")


def test_speed_trend_without_an_emulated_link_is_not_measured():
    assert faster_on_slow_links(pd.Series([1.3], index=["loopback"])) == ("loopback: 1.30x", M)
    assert faster_on_slow_links(pd.Series(dtype=float)) == ("no measurement", M)


@pytest.mark.parametrize(("a", "b", "verdict"), [
    ([1.0, 1.2, 1.8], [1.0, 1.1, 1.3], R),
    ([1.0, 1.2, 1.8], [1.0, 0.9, 1.2], P),  # one trend partly: partly
    ([1.0, 1.2, 1.8], [1.0, 1.0, 1.0], P),  # one reproduced, one contradicted: partly
    ([1.0, 1.0, 1.0], [1.0, 0.9, 0.9], C),
])
def test_all_of_several_rules(a, b, verdict):
    rule = AllOf((SpeedTrend("a", repeats="ra"), SpeedTrend("b", repeats="rb")))
    outcome = rule.judge({"a": pd.Series(a, index=LINKS), "b": pd.Series(b, index=LINKS),
                          "ra": [a[-1]] * 3, "rb": [b[-1]] * 3})
    assert outcome.verdict == verdict
    assert outcome.why[1].startswith(", ".join(f"{n}: {r:.2f}x" for n, r in zip(LINKS, b, strict=True)))


def test_all_of_keeps_the_strongest_reason_a_claim_is_undecided():
    def rules(*names):
        return AllOf(tuple(Gain(n, 0.5) for n in names))

    values = {"contra": seeds(-2.0, -2.1, -1.9), "noise": seeds(1.0, -0.2, 0.8), "none": []}
    assert rules("noise", "contra").judge(values).verdict == C
    assert rules("none", "noise").judge(values).verdict == UNSURE
    assert rules("none").judge(values).verdict == M
    untestable = AllOf((NotTestable("needs a cluster"), Unmeasurable()))
    assert untestable.judge({}).verdict == UT


@pytest.mark.parametrize(("flags", "kwargs", "verdict", "why"), [
    ([True, True], {}, R, "2/2 hold"),
    ([True, False, False], {}, P, "1/3 hold"),
    ([False, False], {}, C, "0/2 hold"),
    ([], {}, M, "no cases"),
    ([True, True], {"every": P}, P, "2/2 hold"),  # evidence that can give no more than partly
    ([False], {"none": P}, P, "0/1 hold"),  # ... or no less
])
def test_share_of_cases(flags, kwargs, verdict, why):
    outcome = Share("f", **kwargs).judge({"f": flags})
    assert (outcome.verdict, outcome.why) == (verdict, why)


@pytest.mark.parametrize(("lower", "same", "verdict", "why"), [
    (True, True, R, "lower, same_bytes hold"),
    (True, False, P, "lower holds; not same_bytes"),
    (False, True, C, "lower does not hold"),
])
def test_conditions(lower, same, verdict, why):
    outcome = Conditions("lower", also=("same_bytes",)).judge({"lower": lower, "same_bytes": same})
    assert (outcome.verdict, outcome.why) == (verdict, why)


@pytest.mark.parametrize(("gains", "verdict", "why"), [
    ({"resnet20": 1.1, "wide_mlp": 1.6}, R, "largest: wide_mlp (1.60)"),
    ({"resnet20": 1.7, "wide_mlp": 1.6}, C, "largest: resnet20 (1.70)"),
    ({"resnet20": 0.8, "wide_mlp": 0.9}, C, "largest: wide_mlp (0.90)"),  # largest, but no gain at all
    ({}, M, "no cases"),
])
def test_largest_for_the_expected_case(gains, verdict, why):
    outcome = Largest("g", "wide_mlp").judge({"g": gains})
    assert (outcome.verdict, outcome.why) == (verdict, why)


def test_consistency_not_testable_and_unmeasurable():
    assert Consistency("holds").judge({"holds": True}).verdict == "consistent"
    assert Consistency("holds").judge({"holds": False}) == type(Consistency("h").judge({"h": 1}))(
        "inconsistent", "does not hold")
    assert Unmeasurable().judge({}).verdict == M
    outcome = NotTestable("needs {workers} workers").judge({"workers": 32})
    assert (outcome.verdict, outcome.why) == (UT, "needs 32 workers")


def test_a_gain_with_a_trend_is_judged_only_once_it_settles():
    from commlab.report.convergence import Trend
    from commlab.report.rules import Gain

    gains = pd.Series([2.0, 2.1, 2.5], index=[0, 1, 2])
    rule = Gain("gain", min_gain=0.5, trend="trend")
    assert rule.judge({"gain": gains, "trend": Trend((60, 120), (75.0, 80.0), (1.9, 2.2))}).verdict == "reproduced"
    moving = rule.judge({"gain": gains, "trend": Trend((60, 120), (75.0, 80.0), (0.2, 2.2))})
    assert moving.verdict == "not testable at this budget"
    assert moving.why.startswith("gain +2.20 points") and "the gap still moves by +2.00 points" in moving.why
    assert rule.judge({"gain": gains, "trend": None}).verdict == "reproduced"  # no history: not checked
