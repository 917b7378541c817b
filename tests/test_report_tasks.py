"""Reports read each task's metric (commlab.report.metrics): a run is told by the metric it logged,
the accuracy claims of RedSync and Ok-Topk compare language models by perplexity (lower is
better) and BERT by masked-token accuracy, and the index charts each task's runs apart. All on
small hand-made tables; image runs keep their test accuracy."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from commlab.loop.tasks import TASKS
from commlab.report.claims import Evidence, evaluate
from commlab.report.metrics import ACCURACY, MLM_ACCURACY, PERPLEXITY, TASK_METRICS, run_metric, setting, task_metric
from commlab.report.rules import AccuracyMatch, accuracy_match


def test_the_reports_know_each_tasks_metric_and_its_direction():
    assert set(TASK_METRICS) == {task.metric for task in TASKS.values()}
    for task in TASKS.values():
        assert TASK_METRICS[task.metric].higher_is_better == task.higher_is_better, task.__name__


def test_a_run_is_told_by_the_metric_it_logged():
    runs = pd.DataFrame({"test_accuracy": [91.0, None, None, None],
                         "test_perplexity": [None, 120.5, None, None],
                         "test_mlm_accuracy": [None, None, 12.0, None],
                         "test_loss": [0.3, 4.8, 6.1, None]})
    assert list(run_metric(runs)) == ["test_accuracy", "test_perplexity", "test_mlm_accuracy", "test_accuracy"]
    assert list(run_metric(pd.DataFrame({"test_accuracy": [90.0]}))) == ["test_accuracy"]  # runs before tasks
    assert task_metric(runs.iloc[[1]]) is PERPLEXITY and task_metric(runs.iloc[[0, 2, 2]]) is MLM_ACCURACY
    assert task_metric(pd.DataFrame()) is ACCURACY
    assert setting(pd.DataFrame({"dataset": ["ptb", "wikitext2"], "model": ["lstm_lm"] * 2})) == "PTB/WikiText-2 LSTM"


def test_near_is_a_point_of_accuracy_or_two_percent_of_perplexity():
    assert ACCURACY.margin_for([90.0, 91.0]) == 1.0 and ACCURACY.within(1.0) == "1 point"
    assert ACCURACY.near == "test accuracy within about a point"
    assert PERPLEXITY.margin_for([100.0, 120.0]) == pytest.approx(2.2)
    assert PERPLEXITY.within(2.2) == "2% (2.2)" and PERPLEXITY.near == "test perplexity within 2%"


def test_perplexity_gaps_are_judged_lower_is_better():
    def seeds(*values):
        return pd.Series(values, dtype=float)

    # |gap| within the margin either way
    text, verdict = accuracy_match(seeds(101.0, 101.2), seeds(100.0, 100.2), margin=2.0, unit="perplexity",
                                   higher_is_better=False)
    assert verdict == "reproduced" and text.startswith("gap +1.00 perplexity")
    # "no worse than": a lower perplexity is no shortfall, a higher one is
    assert accuracy_match(seeds(90.0, 91.0), seeds(100.0, 101.0), 2.0, at_least=True,
                          higher_is_better=False)[1] == "reproduced"
    text, verdict = accuracy_match(seeds(110.0, 111.0), seeds(100.0, 101.0), 2.0, at_least=True, unit="perplexity",
                                   higher_is_better=False)
    assert verdict == "contradicted" and text.endswith("), at most 2 above")
    # the rule reads the metric and the margin from the measurement
    rule = AccuracyMatch("acc", "dense", margin="margin", metric="metric")
    outcome = rule.judge({"acc": seeds(103.0, 103.1), "dense": seeds(100.0, 100.1), "margin": 2.0,
                          "metric": "test_perplexity"})
    assert outcome.verdict == "contradicted" and "gap +3.00 perplexity" in outcome.why
    outcome = rule.judge({"acc": seeds(90.5, 90.6), "dense": seeds(91.0, 91.1), "margin": 1.0,
                          "metric": "test_accuracy"})
    assert outcome.verdict == "reproduced"
    assert outcome.why == "gap -0.50 points (paired over seeds 0, 1; s.e. 0.00; 90% interval -0.50 to -0.50), margin 1"


def _runs(rows: list[dict]) -> pd.DataFrame:
    base = {"seed": 0, "workers": 8, "network": None, "samples": 4000.0, "wall_seconds": 100.0,
            "param.train.batch_size": "5"}
    return pd.DataFrame([{**base, **row, "run_id": f"r{i}"} for i, row in enumerate(rows)])


def _history(runs: pd.DataFrame, per_step: dict[str, float]) -> pd.DataFrame:
    """bytes_sent at steps 10 and 20 per run: ``per_step`` bytes a step by method; the run's final
    test metric at both steps (two evaluations that have settled)."""
    rows = [{"run_id": r.run_id, "name": r.name, "method": r.method, "seed": r.seed,
             "metric": "bytes_sent", "step": step, "value": per_step.get(r.method, 1e3) * step}
            for r in runs.itertuples() for step in (10, 20)]
    for metric in ("test_accuracy", "test_perplexity", "test_mlm_accuracy"):
        if metric in runs:
            rows += [{"run_id": r.run_id, "name": r.name, "method": r.method, "seed": r.seed, "metric": metric,
                      "step": step, "value": getattr(r, metric)}
                     for r in runs.itertuples() if pd.notna(getattr(r, metric)) for step in (10, 20)]
    return pd.DataFrame(rows)


def test_redsync_judges_a_language_model_by_perplexity():
    from commlab.report import claims_redsync

    runs = _runs([
        *({"name": "ssgd_lstm", "method": "ssgd", "model": "lstm_lm", "dataset": "ptb", "seed": s,
           "test_perplexity": p} for s, p in enumerate([100.0, 101.0, 99.0])),
        *({"name": "redsync_lstm", "method": "redsync", "model": "lstm_lm", "dataset": "ptb", "seed": s,
           "test_perplexity": p, "algo_sent_fraction": 0.002, "algo_selected_fraction": 0.001}
          for s, p in enumerate([100.5, 101.5, 99.5])),
    ])
    ev = Evidence(runs, _history(runs, {"ssgd": 1e6, "redsync": 3e3}))
    rows = {c.claim: c for c in evaluate(claims_redsync.CLAIMS, ev)}
    row = rows["RGC at 0.1% density reaches perplexity near dense SGD (lstm_lm)"]
    assert row.verdict == "reproduced"
    assert row.ours == "test perplexity 100.5 ± 1 (n=3) vs ssgd 100 ± 1 (n=3)"
    assert row.note.startswith("gap +0.50 perplexity (paired over seeds 0, 1, 2; s.e. 0.00")
    assert "within 2% (2) of ssgd" in row.note
    # the message claim quotes the wire table where it ran, and says "not measured" where not
    message = rows["[consistency check] RGC's messages are about 0.1% of the gradient (lstm_lm)"]
    assert "wire volume not measured" in message.note


def test_redsync_keeps_test_accuracy_for_image_models():
    from commlab.report import claims_redsync

    runs = _runs([*({"name": "ssgd_wide", "method": "ssgd", "model": "wide_mlp", "dataset": "fashion_mnist",
                     "test_accuracy": 80.0 + s, "workers": 4, "seed": s} for s in (0, 1)),
                  *({"name": "redsync_wide", "method": "redsync", "model": "wide_mlp", "dataset": "fashion_mnist",
                     "test_accuracy": 79.5 + s, "workers": 4, "seed": s, "algo_sent_fraction": 0.002,
                     "algo_selected_fraction": 0.001} for s in (0, 1))])
    rows = {c.claim: c for c in evaluate(claims_redsync.CLAIMS, Evidence(runs, _history(runs, {"ssgd": 1e6,
                                                                                              "redsync": 3e3})))}
    row = rows["RGC at 0.1% density reaches accuracy near dense SGD (wide_mlp)"]
    assert row.ours == "test accuracy 80 ± 0.71 (n=2) vs ssgd 80.5 ± 0.71 (n=2)"
    assert row.note.startswith("gap -0.50 points") and row.verdict == "reproduced"
    assert "; redsync_wide; near = within 1 point of ssgd" in row.note


def test_oktopk_compares_bert_by_masked_token_accuracy_in_its_own_setting():
    from commlab.report import claims_oktopk

    runs = _runs([
        *({"name": "ssgd_bert", "method": "ssgd", "model": "bert", "dataset": "bert_tokens", "seed": s,
           "test_mlm_accuracy": 40.0 + s} for s in (0, 1)),
        *({"name": "oktopk_bert", "method": "oktopk", "model": "bert", "dataset": "bert_tokens", "seed": s,
           "test_mlm_accuracy": 39.7 + s, "param.method_params.density": "0.01"} for s in (0, 1)),
        # image runs on as many workers: not BERT's reference; nor is ResNet-44's VGG-16's
        *({"name": "ssgd", "method": "ssgd", "model": "vgg16", "dataset": "cifar10", "seed": s,
           "test_accuracy": 92.0 + s} for s in (0, 1)),
        *({"name": "ssgd_resnet44", "method": "ssgd", "model": "resnet44", "dataset": "cifar10", "seed": s,
           "test_accuracy": 70.0} for s in (0, 1)),
        *({"name": "gtopk", "method": "gtopk", "model": "vgg16", "dataset": "cifar10", "seed": s,
           "test_accuracy": 91.2 + s, "param.method_params.density": "0.02"} for s in (0, 1)),
    ])
    claims = evaluate(claims_oktopk.CLAIMS, Evidence(runs, _history(runs, {})))
    rows = {c.claim: c for c in claims}
    bert = rows["oktopk_bert: masked-token accuracy within about a point of dense allreduce"]
    assert bert.verdict == "reproduced"
    assert bert.ours == "40.2 ± 0.71 (n=2) vs ssgd 40.5 ± 0.71 (n=2)"
    assert bert.note.startswith("gap -0.30 points (paired over seeds 0, 1")
    assert "; tokenised corpus BERT, 8 workers, density 0.01" in bert.note
    vgg = rows["gtopk: test accuracy within about a point of dense allreduce"]
    assert vgg.ours == "91.7 ± 0.71 (n=2) vs ssgd 92.5 ± 0.71 (n=2)" and vgg.note.startswith("gap -0.80 points")
    assert "; CIFAR-10 VGG-16, 8 workers" in vgg.note
    # methods of the grid without runs are named in the grid's prevailing metric
    missing = [c for c in claims if c.claim.startswith("topk_allgather:")]
    assert missing and missing[0].verdict == "not measured"


def test_the_index_charts_each_tasks_runs_apart(tmp_path):
    from commlab.report.index import by_task_metric, cross_paper_html, real_data_runs

    (tmp_path / "redsync").mkdir()
    (tmp_path / "oktopk").mkdir()
    common = {"seed": 0, "workers": 4, "network": None, "bytes_sent": 1e7, "wall_seconds": 60.0, "samples": 1000}
    pd.DataFrame([{**common, "paper": "redsync", "name": "ssgd_wide", "method": "ssgd", "model": "wide_mlp",
                   "dataset": "fashion_mnist", "test_accuracy": 80.0},
                  {**common, "paper": "redsync", "name": "redsync_lstm", "method": "redsync", "model": "lstm_lm",
                   "dataset": "ptb", "test_perplexity": 120.0}]).to_csv(tmp_path / "redsync/runs.csv", index=False)
    pd.DataFrame([{**common, "paper": "oktopk", "name": "oktopk_bert", "method": "oktopk", "model": "bert",
                   "dataset": "synthetic_tokens", "test_mlm_accuracy": 0.1}]).to_csv(tmp_path / "oktopk/runs.csv",
                                                                                      index=False)
    from commlab.report.index import load_summaries

    runs, generated_only = real_data_runs(load_summaries(tmp_path))
    assert not generated_only and "oktopk_bert" not in set(runs.name)  # generated tokens are set aside
    groups = by_task_metric(runs)
    assert list(groups) == ["test_perplexity", "test_accuracy"]
    assert list(groups["test_perplexity"].name) == ["redsync_lstm"]
    page = cross_paper_html(tmp_path)
    assert "Runs of different tasks are charted apart" in page and "1 runs by test perplexity" in page
    assert "<h3>test perplexity (lower is better)</h3>" in page and "<h3>test accuracy (%)</h3>" in page
    assert 'class="cross-paper-bytes-test_perplexity" alt="final test perplexity against' in page
    assert 'class="cross-paper-bytes" alt="final test accuracy against' in page
    assert math.isnan(groups["test_accuracy"].test_perplexity.iloc[0])
