"""Benchmark results in the claims tables (commlab.report.bench): the ratio table, the provenance
and the cost model's speed-ups on hand-made benchmark payloads (the speed verdict itself is a
rule: tests/test_report_rules.py)."""

import json

import pytest

from commlab.report.bench import (
    dense_comm_share,
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
