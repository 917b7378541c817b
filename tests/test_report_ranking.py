"""The index's ranking by time to a shared accuracy target on each emulated link
(commlab.report.ranking) on hand-made evaluations and benchmark files: the target, the samples to
it, the time at the benchmark's rate, and the runs listed as not measured with their reason."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from commlab.report import ranking
from commlab.report.index import build_index
from evidence import history, runs


def evaluation_rows(paper: str, name: str, method: str, accuracies: list[float], workers: int = 4, seeds=(0, 1),
                    model: str = "cnn", dataset: str = "fashion_mnist", per_eval: int = 8192) -> list[dict]:
    """A run name's evaluations, one per epoch (``per_eval`` samples each), the same on every seed."""
    return [{"paper": paper, "name": name, "method": method, "seed": seed, "workers": workers, "model": model,
             "dataset": dataset, "step": 64 * (i + 1), "samples": per_eval * (i + 1), "metric": "test_accuracy",
             "value": value} for seed in seeds for i, value in enumerate(accuracies)]


def bench(rates: dict[tuple[str, str], float], workers: int = 4, model: str = "cnn") -> dict:
    return {"workers": workers, "model": model, "dataset": "fashion_mnist", "file": "/out/bench/throughput.json",
            "summary": [{"network": net, "method": method, "samples_per_s": rate} for (net, method), rate in
                        rates.items()] + [{"network": "100Mbit", "method": "broken", "error": "rank 1 died"}]}


EVALUATIONS = pd.DataFrame(
    evaluation_rows("baseline", "ssgd", "ssgd", [80.0, 85.0])
    + evaluation_rows("adpsgd", "adpsgd_b16", "adpsgd", [83.5, 83.0])  # best 83.5: the target
    + evaluation_rows("oktopk", "oktopk", "oktopk", [84.0, 86.0])
    + evaluation_rows("kstep", "kstep_msgd_k64", "kstep", [70.0, 75.0], workers=6)  # never timed: 6 workers
    + evaluation_rows("adpsgd", "qsgd8", "qsgd", [60.0, 70.0])  # no rate: neither timed nor compared
    + evaluation_rows("oktopk", "scale_oktopk_p4", "oktopk", [10.0, 11.0], dataset="synthetic"))
RATES = {("loopback", "ssgd"): 1000.0, ("100Mbit", "ssgd"): 400.0, ("100Mbit", "adpsgd"): 800.0,
         ("100Mbit", "oktopk"): 512.0, ("100Mbit", "kstep"): 2000.0, ("1000Mbit", "ssgd"): 900.0,
         ("1000Mbit", "adpsgd"): 950.0}


def test_every_run_is_ranked_by_its_time_to_the_shared_target_on_each_emulated_link():
    tables, shared = ranking.rank_by_link(EVALUATIONS, bench(RATES))
    assert list(tables) == ["1000Mbit", "100Mbit"]  # emulated links only, fastest first
    assert shared["target"] == 83.5 and shared["compared"] == 3  # the lowest best of ssgd, adpsgd, oktopk
    slow = tables["100Mbit"].set_index("name")
    # samples at the first evaluation reaching 83.5: ssgd its second (16,384), adpsgd its first, oktopk its first
    assert slow.samples_to_target.to_dict() == pytest.approx(
        {"adpsgd_b16": 8192.0, "oktopk": 8192.0, "ssgd": 16384.0, "kstep_msgd_k64": np.nan, "qsgd8": np.nan},
        nan_ok=True)
    assert slow.seconds[["adpsgd_b16", "oktopk", "ssgd"]].tolist() == pytest.approx([8192 / 800, 8192 / 512,
                                                                                    16384 / 400])
    assert tables["100Mbit"].name.tolist() == ["adpsgd_b16", "oktopk", "ssgd", "qsgd8", "kstep_msgd_k64"]
    assert slow["rank"].tolist()[:3] == [1, 2, 3] and slow["rank"].isna().tolist()[3:] == [True, True]
    assert slow.over_fastest["ssgd"] == pytest.approx((16384 / 400) / (8192 / 800))
    assert slow.note["kstep_msgd_k64"] == "not measured: trained on 6 workers, the benchmark measured 4"
    assert np.isnan(slow.samples_per_s["kstep_msgd_k64"])
    assert slow.note["qsgd8"] == "not measured: no qsgd rate on the 100Mbit link"
    assert "scale_oktopk_p4" not in slow.index  # generated data
    fast = tables["1000Mbit"].set_index("name")
    assert fast.note["oktopk"] == "not measured: no oktopk rate on the 1000Mbit link"
    assert fast.seconds["ssgd"] == pytest.approx(16384 / 900)


def test_a_run_that_never_reaches_the_target_is_listed_and_a_perplexity_improves_downwards():
    evals = pd.DataFrame(evaluation_rows("redsync", "ssgd", "ssgd", [150.0, 120.0], model="lstm_lm", dataset="ptb")
                         + evaluation_rows("redsync", "redsync", "redsync", [160.0, 130.0], model="lstm_lm",
                                           dataset="ptb")).assign(metric="test_perplexity")
    rates = {("100Mbit", "ssgd"): 100.0, ("100Mbit", "redsync"): 150.0}
    tables, shared = ranking.rank_by_link(evals, {**bench(rates, model="lstm_lm"), "dataset": "ptb"})
    assert shared["target"] == 130.0  # the highest of the lowest perplexities
    table = tables["100Mbit"].set_index("name")
    assert table.samples_to_target.tolist() == [16384.0, 16384.0]
    assert table.seconds["redsync"] == pytest.approx(16384 / 150)
    assert shared["metric"].name == "test_perplexity"


def test_without_an_emulated_link_or_runs_of_the_model_there_is_no_ranking():
    assert ranking.rank_by_link(EVALUATIONS, bench({("loopback", "ssgd"): 1000.0})) == ({}, {})
    assert ranking.rank_by_link(EVALUATIONS, bench(RATES, model="resnet20")) == ({}, {})


def test_a_reports_evaluations_carry_the_samples_at_their_step():
    frame = runs([{"name": "ssgd", "seed": 0, "model": "cnn", "dataset": "fashion_mnist"}])
    points = [("ssgd", 0, "samples", step, 128.0 * step) for step in (10, 20, 30)]
    points += [("ssgd", 0, "test_accuracy", 25, 81.0), ("ssgd", 0, "test_perplexity", 25, float("nan"))]
    empty = history([], frame).astype(object)  # a metric no run logged: an empty frame of object columns
    table = ranking.evaluations_table(pd.concat([history(points, frame).dropna(), empty]), frame, "baseline")
    assert table.columns.tolist() == ranking.EVALUATION_COLUMNS
    assert table[["paper", "name", "workers", "step", "samples", "metric", "value"]].values.tolist() == [
        ["baseline", "ssgd", 4, 25, 3200.0, "test_accuracy", 81.0]]


def test_the_index_shows_a_table_per_emulated_link(tmp_path):
    (tmp_path / "adpsgd").mkdir()
    EVALUATIONS.to_csv(tmp_path / "adpsgd" / "evaluations.csv", index=False)
    page = build_index(tmp_path).read_text()
    assert "Not measured: no throughput benchmark beside the reports" in page
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "throughput.json").write_text(json.dumps(bench(RATES)))
    page = build_index(tmp_path).read_text()
    assert page.count('<table class="commlab-ranking">') == 2
    assert "<h3>Fashion-MNIST CNN, 4 workers: emulated 100Mbit link</h3>" in page
    assert "Target: test accuracy 83.50 (reached by all 3 compared runs)" in page
    assert "<td>1</td><td>adpsgd</td><td>adpsgd_b16</td><td>adpsgd</td><td>2</td><td>4</td><td>8,192</td>" in page
    assert "not measured: trained on 6 workers, the benchmark measured 4" in page
