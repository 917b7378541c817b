"""The shared rules that judge every paper's claims (commlab.report.rules), each on small hand-made
measurements: every outcome a rule can give, at and around its thresholds, and the words it
writes (``why``), which the claims tables show."""

import math

import pandas as pd
import pytest

from commlab.report.rules import (
    AccuracyMatch,
    AllOf,
    Below,
    ClosesGap,
    Conditions,
    Consistency,
    Gain,
    Largest,
    Reaches,
    Share,
    SpeedTrend,
    Unmeasurable,
    Within,
    accuracy_match,
    faster_on_slow_links,
)

R, P, N, M = "reproduced", "partly reproduced", "not reproduced", "not measured"
NAN = math.nan


@pytest.mark.parametrize(("value", "bound", "partly", "verdict", "why"), [
    (0.01, 0.02, 2, R, "0.01 <= 0.02"),
    (0.02, 0.02, 2, R, "0.02 <= 0.02"),  # the bound itself is within
    (0.03, 0.02, 2, P, "0.03 <= 2 x 0.02"),
    (0.05, 0.02, 2, N, "0.05 > 2 x 0.02"),
    (0.03, 0.02, None, N, "0.03 > 1 x 0.02"),  # no partly band
    (NAN, 0.02, 2, N, "nan > 2 x 0.02"),
])
def test_within_a_tolerance(value, bound, partly, verdict, why):
    outcome = Within("gap", bound="allowed", partly=partly).judge({"gap": value, "allowed": bound})
    assert (outcome.verdict, outcome.why) == (verdict, why)
    assert Within("gap", bound=bound, partly=partly).judge({"gap": value}).verdict == verdict  # a number as bound


@pytest.mark.parametrize(("rule", "value", "near", "verdict", "why"), [
    (Reaches("v", 0.62, floor=0.0), 0.62, NAN, R, "0.62: at least 0.62"),
    (Reaches("v", 0.62, floor=0.0), 0.3, NAN, P, "0.3: above 0, short of 0.62"),
    (Reaches("v", 0.62, floor=0.0), -0.1, NAN, N, "-0.1: not at least 0.62"),
    (Reaches("v", 0.62, floor=0.0), NAN, NAN, N, "nan: not at least 0.62"),
    (Reaches("v", 0.99, strict=True, floor=0.9), 0.99, NAN, P, "0.99: above 0.9, short of 0.99"),  # "more than"
    (Reaches("v", 0.99, strict=True, floor=0.9, near="n"), 0.995, NAN, R, "0.995: more than 0.99"),
    (Reaches("v", 0.99, strict=True, floor=0.9, near="n"), NAN, 0.995, P,
     "nan short of 0.99; 0.995 under the looser condition"),
    (Reaches("v", 0.99, strict=True, floor=0.9, near="n"), 0.5, 0.98, N, "0.5: not more than 0.99"),
    (Reaches("v", 102_000, near="n"), 60_000, 102_000, P,
     "60,000 short of 102,000; 102,000 under the looser condition"),
    (Reaches("v", 1.05), 1.04, NAN, N, "1.04: not at least 1.05"),  # no partly band without floor or near
])
def test_reaches_the_papers_number(rule, value, near, verdict, why):
    outcome = rule.judge({"v": value, "n": near})
    assert (outcome.verdict, outcome.why) == (verdict, why)


@pytest.mark.parametrize(("values", "verdict", "why"), [
    ([4.2, 5.1, 5.9], R, "largest 5.9 < 6 at 3 points"),
    ([4.2, 5.9], P, "below 6 at 2 points, fewer than 3"),
    ([4.2, 6.0, 5.0], N, "largest 6 >= 6"),  # the bound is strict: "less than 6k"
    ([NAN], M, "no values"),
])
def test_below_a_volume_bound(values, verdict, why):
    outcome = Below("worst", 6, min_points=3).judge({"worst": values})
    assert (outcome.verdict, outcome.why) == (verdict, why)


def test_accuracy_match_needs_seeds_that_can_tell():
    # a small gap with a small spread: a match
    assert accuracy_match([84.1, 83.2, 85.0], [84.0, 83.5, 84.4])[1] == R
    # a large gap hidden in a huge spread (ResNet-20 after 64 steps): never a match
    text, verdict = accuracy_match([10.0, 60.0, 34.0], [65.0, 74.0, 70.0])
    assert verdict == N, text
    # a gap of 1.5 points with a spread that cannot separate it from the margin: partly
    assert accuracy_match([82.0, 83.5, 82.5], [84.0, 84.5, 84.0])[1] == P
    # noisy seeds, small gap: partly, and the text says why
    text, verdict = accuracy_match([80.0, 86.0, 83.0], [82.0, 84.0, 83.3])
    assert verdict == P and "too noisy" in text
    assert accuracy_match([], [84.0]) == ("no runs", M)
    # "similar or better": being far above the reference is a match, being far below is not
    assert accuracy_match([88.0, 88.2, 87.9], [84.0, 84.1, 83.9], at_least=True)[1] == R
    assert accuracy_match([88.0, 88.2, 87.9], [84.0, 84.1, 83.9])[1] == N
    assert accuracy_match([80.0, 80.2, 79.9], [84.0, 84.1, 83.9], at_least=True)[1] == N
    # a mean gap right at the margin is no match while the seeds leave it a standard error beyond
    text, verdict = accuracy_match([80.6, 81.6, 80.9], [82.0, 82.1, 81.9], at_least=True)
    assert verdict == P and "within a standard error of the margin" in text
    text, verdict = accuracy_match([81.0, 86.0, 83.0], [84.0, 84.1, 83.9], at_least=True)
    assert verdict == P and "at most 1 below" in text


def test_accuracy_match_rule_writes_the_gap_and_its_standard_error():
    outcome = AccuracyMatch("ours", "dense").judge({"ours": pd.Series([84.0, 84.0]), "dense": [84.5, 84.5]})
    assert outcome == type(outcome)(R, "gap -0.50 points, standard error 0.00 (margin 1)")
    assert AccuracyMatch("ours", "dense", margin=0.2).judge({"ours": [84.0], "dense": [84.5]}).verdict == N
    assert AccuracyMatch("ours", "dense").judge({"ours": [], "dense": [84.5]}).verdict == M


LINKS = ["loopback", "1000Mbit", "100Mbit"]


@pytest.mark.parametrize(("ratios", "verdict"), [
    ([0.9, 1.2, 1.8], R),   # faster on every emulated link, most on the slowest
    ([0.9, 0.95, 1.4], P),  # faster on the slowest link only
    ([0.9, 1.6, 1.3], P),   # faster, but less so on the slower link
    ([1.0, 1.0, 1.02], N),  # within the 5% threshold: no faster
    ([1.1, 0.9, 0.8], N),
])
def test_speed_trend_verdicts(ratios, verdict):
    outcome = SpeedTrend("r").judge({"r": pd.Series(ratios, index=LINKS)})
    assert outcome.verdict == verdict
    assert outcome.why == f"loopback: {ratios[0]:.2f}x, 1000Mbit: {ratios[1]:.2f}x, 100Mbit: {ratios[2]:.2f}x"


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
    ([1.0, 1.2, 1.8], [1.0, 1.0, 1.0], P),  # one reproduced, one not: partly
    ([1.0, 1.0, 1.0], [1.0, 0.9, 0.9], N),
])
def test_all_of_several_rules(a, b, verdict):
    rule = AllOf((SpeedTrend("a"), SpeedTrend("b")))
    outcome = rule.judge({"a": pd.Series(a, index=LINKS), "b": pd.Series(b, index=LINKS)})
    assert outcome.verdict == verdict
    assert outcome.why[1] == ", ".join(f"{n}: {r:.2f}x" for n, r in zip(LINKS, b, strict=True))


@pytest.mark.parametrize(("flags", "kwargs", "verdict", "why"), [
    ([True, True], {}, R, "2/2 hold"),
    ([True, False, False], {}, P, "1/3 hold"),
    ([False, False], {}, N, "0/2 hold"),
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
    (False, True, N, "lower does not hold"),
])
def test_conditions(lower, same, verdict, why):
    outcome = Conditions("lower", also=("same_bytes",)).judge({"lower": lower, "same_bytes": same})
    assert (outcome.verdict, outcome.why) == (verdict, why)


@pytest.mark.parametrize(("gap", "left", "verdict", "why"), [
    (0.4, 0.4, N, "no gap to close at this scale: Adam is -0.40 pp against SGD, not more than the tolerance "
                  "(0.50 pp) below it"),
    (3.0, 0.3, R, "Adam K=16 within 0.50 pp of SGD"),
    (3.0, 1.5, P, "Adam K=16 closes at least half of the gap"),
    (3.0, 2.0, N, "Adam K=16 does not close half of the gap"),
])
def test_closes_gap(gap, left, verdict, why):
    rule = ClosesGap("gap", "left", 0.5, baseline="Adam", reference="SGD", variant="Adam K={k}")
    outcome = rule.judge({"gap": gap, "left": left, "k": 16})
    assert (outcome.verdict, outcome.why) == (verdict, why)


@pytest.mark.parametrize(("gains", "verdict", "why"), [
    ({"resnet20": 1.1, "wide_mlp": 1.6}, R, "largest: wide_mlp (1.60)"),
    ({"resnet20": 1.7, "wide_mlp": 1.6}, N, "largest: resnet20 (1.70)"),
    ({"resnet20": 0.8, "wide_mlp": 0.9}, N, "largest: wide_mlp (0.90)"),  # largest, but no gain at all
    ({}, M, "no cases"),
])
def test_largest_for_the_expected_case(gains, verdict, why):
    outcome = Largest("g", "wide_mlp").judge({"g": gains})
    assert (outcome.verdict, outcome.why) == (verdict, why)


@pytest.mark.parametrize(("gains", "spread", "verdict", "why"), [
    ([1.0, 1.4], 0.8, R, "gain +1.20 on every seed, beyond the seed spread 0.80"),
    ([1.0, 1.4], 1.5, P, "The difference is within the seed spread."),
    ([1.0, -0.2], 0.1, N, "gain +0.40: not at least 0.5 on every seed"),
    ([0.3, 0.4], 0.1, N, "gain +0.35: not at least 0.5 on every seed"),
    ([], 0.1, M, "no paired seeds"),
])
def test_gain_beyond_the_seed_spread(gains, spread, verdict, why):
    outcome = Gain("gain", "spread", min_gain=0.5).judge({"gain": gains, "spread": spread})
    assert (outcome.verdict, outcome.why) == (verdict, why)


def test_consistency_and_unmeasurable():
    assert Consistency("holds").judge({"holds": True}).verdict == "consistent"
    assert Consistency("holds").judge({"holds": False}) == type(Consistency("h").judge({"h": 1}))(
        "inconsistent", "does not hold")
    assert Unmeasurable().judge({}).verdict == M
