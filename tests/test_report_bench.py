"""Benchmark results in the claims tables (commlab.report.bench): the ratio table, the provenance
and the cost model's speed-ups on hand-made benchmark payloads (the speed verdict itself is a
rule: tests/test_report_rules.py)."""

import json

import pytest

from commlab.report.bench import (
    dense_comm_share,
    environment_note,
    link_mbit,
    load_bench,
    modelled_speedups,
    provenance,
    strongest_dense,
    strongest_dense_note,
    throughput_ratios,
)


def _row(network, method, ratio, step_s=0.1, collective_s=0.001, blocked_s=0.05, link=None):
    return {"network": network, "method": method, "ratio_to_ssgd": ratio, "step_s": step_s,
            "collective_s": collective_s, "blocked_s": blocked_s, "comm_s": collective_s + blocked_s,
            "measured_link_mbit": link}


BENCH = {
    "workers": 4, "model": "cnn", "dataset": "fashion_mnist", "batch_per_worker": 32, "max_steps": 40,
    "repeats": 1, "warmup_steps_zero": True, "file": "/out/bench/throughput.json",
    "environment": {"git_commit": "0123456789abcdef", "time": "2026-01-01T00:00:00+0000", "cpus": 2,
                    "load_average": [9.1, 8.0, 7.5]},
    "summary": [
        # the 100 Mbit/s row of a default run: step 0.1455 s, launches 0.001 s, blocked 0.1154 s
        _row("100Mbit", "ssgd", 1.0, 0.1455, 0.001, 0.1154, 95.9), _row("100Mbit", "fast", 1.8),
        _row("loopback", "ssgd", 1.0, 0.08, 0.0004, 0.0236), _row("loopback", "fast", 0.9),
        _row("1000Mbit", "ssgd", 1.0, 0.1, 0.001, 0.029, 958.5), _row("1000Mbit", "fast", 1.2),
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


def test_comm_share_counts_the_blocked_time_and_provenance_names_the_file():
    # (collectives' own time + waits on asynchronous ones) / step, written out per link
    shares = [(0.0004 + 0.0236) / 0.08, (0.001 + 0.029) / 0.1, (0.001 + 0.1154) / 0.1455]
    assert [round(100 * x) for x in shares] == [30, 30, 80]
    assert dense_comm_share(BENCH) == ("loopback 30%, 1000Mbit 30%, 100Mbit 80% (ssgd's collectives' own time plus "
                                       "its waits on asynchronous allreduces, over its step)")
    text = provenance(BENCH)
    for part in ("/out/bench/throughput.json (", "cnn on fashion_mnist", "4 workers x batch 32", "40 steps",
                 "median of 1", "no warm-up", "100Mbit measured 95.9 Mbit/s", "2 CPUs, load average 9.1",
                 "commit 0123456789ab", "2026-01-01"):
        assert part in text, (part, text)


def test_comm_share_missing_figures_are_not_measured():
    old = {"summary": [{"network": "loopback", "method": "ssgd", "step_s": 0.1, "comm_s": 0.001, "blocked_s": 0.03}]}
    assert dense_comm_share(old).startswith("not measured (the throughput benchmark's file predates comm_s")
    unlogged = {"summary": [_row("loopback", "ssgd", 1.0) | {"comm_s": None}]}
    assert dense_comm_share(unlogged).startswith("loopback not measured (")
    assert dense_comm_share({"summary": []}) == "not measured (no ssgd row in the throughput benchmark)"
    assert environment_note(None) == "" and environment_note({"environment": {"cpus": 16}}) == "16 CPUs"


def test_load_bench_reads_the_report_folder_or_says_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports/bench").mkdir(parents=True)  # the working directory's files are never read
    (tmp_path / "reports/bench/throughput.json").write_text(json.dumps(BENCH))
    assert load_bench("throughput", tmp_path / "out") is None
    (tmp_path / "out/bench").mkdir(parents=True)
    (tmp_path / "out/bench/throughput.json").write_text(json.dumps({**BENCH, "model": "mlp"}))
    found = load_bench("throughput", tmp_path / "out")
    assert found["model"] == "mlp" and found["file"] == str(tmp_path / "out/bench/throughput.json")
    assert provenance(found).startswith(f"{tmp_path / 'out/bench/throughput.json'} (mlp on fashion_mnist")


def test_modelled_speedups_by_workers():
    scaling = {"predictions_laptop": [
        {"method": m, "workers": p, "link": link, "speedup_vs_dense": s}
        for m, p, link, s in [("a", 4, "100Mbit", 2.0), ("a", 8, "100Mbit", 2.5), ("b", 4, "100Mbit", 1.5),
                              ("b", 8, "100Mbit", 1.0), ("a", 4, "1Gbit", 9.0)]]}
    table = modelled_speedups(scaling, ["a", "b"], "100Mbit")
    assert list(table.index) == [4, 8]
    assert table.loc[8, "a"] == 2.5 and table.loc[8, "b"] == 1.0
    assert modelled_speedups(scaling, ["c"], "100Mbit").empty


def _rates(rates: dict[tuple[str, str], float]) -> dict:
    return {"summary": [{"network": net, "method": method, "samples_per_s": rate, "ratio_to_ssgd": None}
                        for (net, method), rate in rates.items()]}


def test_the_strongest_dense_baseline_is_the_fastest_dense_method_on_each_link():
    bench = _rates({("loopback", "ssgd"): 100.0, ("loopback", "ddp"): 110.0, ("loopback", "ddp_bf16"): 105.0,
                    ("loopback", "oktopk"): 90.0, ("100Mbit", "ssgd"): 20.0, ("100Mbit", "ddp"): 21.0,
                    ("100Mbit", "ddp_bf16"): 35.0, ("100Mbit", "oktopk"): 42.0})
    table = strongest_dense(bench)
    assert table.method.to_dict() == {"loopback": "ddp", "100Mbit": "ddp_bf16"}
    assert strongest_dense_note(bench, "oktopk") == (
        "throughput over the strongest dense baseline on the same link (the fastest of ssgd, ddp, ddp_bf16 measured "
        f"there): loopback {90 / 110:.2f}x (ddp), 100Mbit {42 / 35:.2f}x (ddp_bf16)")


def test_the_strongest_dense_note_says_what_is_missing():
    head = "throughput over the strongest dense baseline on the same link (the fastest of ssgd, ddp, ddp_bf16 " \
           "measured there): "
    assert strongest_dense_note(None, "oktopk") == head + "not measured (no throughput benchmark)"
    older = _rates({("100Mbit", "ssgd"): 20.0, ("100Mbit", "ddp"): 25.0, ("100Mbit", "oktopk"): 30.0})
    assert strongest_dense_note(older, "oktopk") == head + "100Mbit 1.20x (ddp) (ddp_bf16 not measured)"
    assert strongest_dense_note(older, "kstep") == head + "not measured (no kstep or dense row in the throughput " \
                                                          "benchmark)"
