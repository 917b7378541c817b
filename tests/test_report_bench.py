"""Benchmark results in the claims tables (commlab.report.bench): the ratio table and the verdict
of "faster than dense SGD, more so as bandwidth falls" on hand-made benchmark payloads."""

import json

import pandas as pd
import pytest

from commlab.report.bench import (
    dense_comm_share,
    faster_on_slow_links,
    link_mbit,
    load_bench,
    modelled_speedups,
    provenance,
    throughput_ratios,
)


def _row(network, method, ratio, step_s=0.1, comm_s=0.05, link=None):
    return {"network": network, "method": method, "ratio_to_ssgd": ratio, "step_s": step_s, "comm_s": comm_s,
            "measured_link_mbit": link}


BENCH = {
    "workers": 4, "model": "cnn", "dataset": "fashion_mnist", "batch_per_worker": 32, "max_steps": 40,
    "repeats": 1, "warmup_steps_zero": True,
    "environment": {"git_commit": "0123456789abcdef", "time": "2026-01-01T00:00:00+0000"},
    "summary": [
        _row("100Mbit", "ssgd", 1.0, 0.2, 0.14, 95.9), _row("100Mbit", "fast", 1.8),
        _row("loopback", "ssgd", 1.0, 0.08, 0.02), _row("loopback", "fast", 0.9),
        _row("1000Mbit", "ssgd", 1.0, 0.1, 0.03, 958.5), _row("1000Mbit", "fast", 1.2),
        {"network": "1000Mbit", "method": "broken", "error": "rank 1 died"},
    ],
}


def test_ratio_table_orders_links_fastest_first_and_skips_failed_runs():
    table = throughput_ratios(BENCH)
    assert list(table.index) == ["loopback", "1000Mbit", "100Mbit"]
    assert sorted(table.columns) == ["fast", "ssgd"]
    assert table.loc["100Mbit", "fast"] == pytest.approx(1.8) and (table["ssgd"] == 1.0).all()
    assert link_mbit("100Mbit") == 100.0 and link_mbit("loopback") == float("inf")
    assert throughput_ratios({"summary": []}).empty


@pytest.mark.parametrize(("ratios", "verdict"), [
    ([0.9, 1.2, 1.8], "reproduced"),            # faster on every emulated link, most on the slowest
    ([0.9, 0.95, 1.4], "partly reproduced"),    # faster on the slowest link only
    ([0.9, 1.6, 1.3], "partly reproduced"),     # faster, but less so on the slower link
    ([1.0, 1.0, 1.02], "not reproduced"),       # within the 5% threshold: no faster
    ([1.1, 0.9, 0.8], "not reproduced"),
])
def test_faster_on_slow_links_verdicts(ratios, verdict):
    series = pd.Series(ratios, index=["loopback", "1000Mbit", "100Mbit"])
    ours, got = faster_on_slow_links(series)
    assert got == verdict
    assert ours == f"loopback: {ratios[0]:.2f}x, 1000Mbit: {ratios[1]:.2f}x, 100Mbit: {ratios[2]:.2f}x"


@pytest.mark.parametrize(("ratios", "verdict", "words"), [
    ([1.0, 1.3, 1.7], "reproduced", "within"),          # trend and magnitude as the paper's
    ([1.0, 1.1, 1.2], "partly reproduced", "below"),    # the trend, but a smaller gain than the paper's
    ([1.0, 1.3, 2.5], "reproduced", "above"),
    ([1.0, 1.5, 1.42], "partly reproduced", "below"),   # gain falls on the slowest link
])
def test_faster_on_slow_links_sets_the_magnitude_beside_the_papers(ratios, verdict, words):
    series = pd.Series(ratios, index=["loopback", "1000Mbit", "100Mbit"])
    ours, got = faster_on_slow_links(series, paper=(1.46, 1.95))
    assert got == verdict
    assert ours.endswith(f"paper 1.46-1.95x: our slowest link's gain is {words} it")


def test_no_emulated_link_is_not_measured():
    assert faster_on_slow_links(pd.Series([1.3], index=["loopback"]))[1] == "not measured"
    assert faster_on_slow_links(pd.Series(dtype=float)) == ("no measurement", "not measured")


def test_comm_share_and_provenance_name_the_measurement():
    assert dense_comm_share(BENCH) == "loopback 25%, 1000Mbit 30%, 100Mbit 70%"
    text = provenance(BENCH)
    for part in ("cnn on fashion_mnist", "4 workers x batch 32", "40 steps", "median of 1", "no warm-up",
                 "100Mbit measured 95.9 Mbit/s", "commit 0123456789ab", "2026-01-01"):
        assert part in text, (part, text)


def test_load_bench_reads_the_report_folder_or_says_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_bench("throughput", tmp_path / "out") is None
    (tmp_path / "out/bench").mkdir(parents=True)
    (tmp_path / "out/bench/throughput.json").write_text(json.dumps(BENCH))
    assert load_bench("throughput", tmp_path / "out")["model"] == "cnn"


def test_modelled_speedups_by_workers():
    scaling = {"predictions_laptop": [
        {"method": m, "workers": p, "link": link, "speedup_vs_dense": s}
        for m, p, link, s in [("a", 4, "100Mbit", 2.0), ("a", 8, "100Mbit", 2.5), ("b", 4, "100Mbit", 1.5),
                              ("b", 8, "100Mbit", 1.0), ("a", 4, "1Gbit", 9.0)]]}
    table = modelled_speedups(scaling, ["a", "b"], "100Mbit")
    assert list(table.index) == [4, 8]
    assert table.loc[8, "a"] == 2.5 and table.loc[8, "b"] == 1.0
    assert modelled_speedups(scaling, ["c"], "100Mbit").empty
