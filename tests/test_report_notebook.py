"""The notebooks' shared pieces on hand-made tables: the prologue's header, claims table and legend
(commlab.report.notebook), the tidy tables (commlab.report.tables), the curves
(commlab.report.figures), and the index's count of every kind of verdict (commlab.report.index)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from commlab.report import claims_baseline as baseline
from commlab.report import notebook, tables
from commlab.report.claims import VERDICTS, Claim, write_claims
from commlab.report.figures import curves
from commlab.report.index import build_index, verdict_counts
from commlab.report.metrics import ACCURACY, PERPLEXITY
from evidence import history, per_seed, runs

# ---- notebook ------------------------------------------------------------------------------------

def report(frame: pd.DataFrame, points: pd.DataFrame, out, paper: str = "baseline") -> notebook.Report:
    return notebook.Report(frame, points, out, paper=paper, title=f"{paper} <title>", scale="laptop")


def test_header_names_what_was_run():
    frame = runs([*per_seed("ssgd", [84.0, 84.2, 84.1]), *per_seed("ddp", [84.0, 84.2])],
                 model="cnn", dataset="fashion_mnist", samples=24576.0)
    page = notebook.header_html(report(frame, history([]), None))
    assert "<h1>baseline &lt;title&gt;</h1>" in page
    cells = dict(zip(["scale", "runs", "seeds per variant", "workers", "dataset", "model", "samples per run", "links"],
                     [c.split("</td>")[0] for c in page.split("<td>")[1:]], strict=True))
    assert cells == {"scale": "laptop", "runs": "5 (2 variants)", "seeds per variant": "2-3 (seeds 0, 1, 2)",
                     "workers": "4", "dataset": "fashion_mnist", "model": "cnn", "samples per run": "24,576",
                     "links": "loopback"}
    empty = notebook.header_html(report(runs([]), history([]), None))
    assert "<b>No finished runs</b> at scale <code>laptop</code>" in empty


def test_span_of_values():
    assert notebook._span([4, 4, 8]) == "4, 8"
    assert notebook._span([1024, 2048, 4096, 9600]) == "1,024-9,600"
    assert notebook._span([None, float("nan")]) == "?"


def test_claims_table_colours_each_verdict_and_escapes_text():
    rows = [Claim("a < b", "Fig. 1", "1 ± 0 (n=3)", "contradicted", "note <i>"),
            Claim("c", "Fig. 2", "no runs", "not testable at this budget", "longer runs")]
    page = notebook.claims_html(rows)
    assert '<td style="background:#f8d7da"><b>contradicted</b></td>' in page
    assert '<td style="background:#dbe7f3"><b>not testable at this budget</b></td>' in page
    assert "a &lt; b" in page and "note &lt;i&gt;" in page and "<td>n=3</td>" in page
    legend = notebook.verdict_legend(rows)
    assert legend == ('<p class="commlab-legend"><small>2 claims: 1 contradicted (the premise holds here and the '
                      "measurement goes against the claim beyond the noise); 1 not testable at this budget (the runs "
                      "have not converged (the reference still improves or the gap still closes): the note gives the "
                      "trend and what would test it).</small></p>")


def test_show_claims_writes_the_table_it_shows(tmp_path, monkeypatch):
    shown = []
    monkeypatch.setattr(notebook, "_display_html", shown.append)
    frame = runs([*per_seed("ssgd", [84.0, 84.2, 84.1]), *per_seed("ddp", [84.0, 84.2, 84.1])])
    notebook.show_claims(report(frame, history([]), tmp_path))
    written = json.loads((tmp_path / "baseline/claims.json").read_text())
    assert written["title"] == "baseline <title>" and len(written["claims"]) == len(baseline.CLAIMS) == 5
    accuracy = next(c for c in written["claims"] if c["claim"] == "ssgd and DDP reach the same final test accuracy")
    assert accuracy["verdict"] == "reproduced" and accuracy["seeds"] == "n=3"
    assert shown[0].startswith("<h2>Claims and verdicts</h2>") and 'class="commlab-legend"' in shown[0]


# ---- tables --------------------------------------------------------------------------------------

def test_params_are_read_as_numbers_or_strings():
    frame = pd.DataFrame({"param.a": ["3", "None", "x"], "param.b": ["adam", "None", ""]})
    assert list(tables.param(frame, "a", 0)) == [3.0, 0.0, 0.0]
    assert list(tables.param(frame, "b", "sgd", numeric=False)) == ["adam", "sgd", "sgd"]
    assert tables.param(frame, "missing").isna().all()
    links = pd.DataFrame({"param.network.bandwidth_mbit": ["100", None]})
    assert tables.link_mbit(links).iloc[0] == 100.0 and math.isnan(tables.link_mbit(links).iloc[1])


POINTS = [("a", 0, "samples", 10, 320.0), ("a", 0, "samples", 20, 640.0), ("a", 0, "bytes_sent", 10, 1000.0),
          ("a", 0, "bytes_sent", 20, 3000.0), ("a", 0, "test_accuracy", 15, 80.0), ("a", 0, "test_accuracy", 20, 82.0)]


def test_wide_history_fills_within_a_run():
    wide = tables.wide_history(history(POINTS))
    assert list(wide.step) == [10, 15, 20]
    assert list(wide.samples) == [320.0, 320.0, 640.0]  # step 15 carries step 10's counter forward
    raw = tables.wide_history(history(POINTS), fill=False)
    assert math.isnan(raw.samples.iloc[1])
    assert list(tables.wide_history(history([])).columns) == tables.KEYS


def test_counters_are_interpolated_at_evaluations():
    evals = tables.at_evaluations(history(POINTS), axes=("samples", "bytes_sent"))
    assert list(evals.step) == [15, 20]
    assert list(evals.samples) == [480.0, 640.0] and list(evals.bytes_sent) == [2000.0, 3000.0]
    first = tables.at_evaluations(history([("a", 0, "bytes_sent", 10, 1000.0), ("a", 0, "test_accuracy", 5, 70.0)]),
                                  axes=("bytes_sent",))
    assert list(first.bytes_sent) == [500.0]  # counters start at 0 at step 0


def test_bytes_per_step_is_the_steady_state():
    assert tables.bytes_per_step(history(POINTS), "a-0") == 200.0
    assert math.isnan(tables.bytes_per_step(history(POINTS[:1]), "a-0"))


def test_mean_sd_table_per_run_name():
    frame = runs([*per_seed("a", [1.0, 3.0]), *per_seed("b", [5.0])])
    table = tables.mean_sd_table(frame, "name", {"accuracy": "test_accuracy", "absent": "nothing"})
    assert table.loc["a", "seeds"] == 2 and table.loc["a", "accuracy"] == "2 ± 1.4"
    assert table.loc["b", "accuracy"] == "5 ± 0" and "absent" not in table


def test_by_seed_and_parity():
    frame = runs([*per_seed("ssgd", [84.0, 84.2]), *per_seed("oktopk", [83.0, None, 83.5])])
    acc = tables.by_seed(frame[frame.name == "oktopk"], "test_accuracy")
    assert list(acc.index) == [0, 2] and list(acc) == [83.0, 83.5]
    assert tables.by_seed(frame, "nothing").empty
    points = [(r["name"], r["seed"], "test_accuracy", step, r["test_accuracy"] - (1.0 if step == 1 else 0.0))
              for _, r in frame.dropna(subset=["test_accuracy"]).iterrows() for step in (1, 2)]
    found = tables.parity(history(points, frame), frame[frame.name == "oktopk"], frame[frame.name == "ssgd"], ACCURACY)
    assert found["trend"].steps == (1, 2) and found["trend"].gap == pytest.approx((-1.0, -1.0))
    assert found["trend"].reference == pytest.approx((83.1, 84.1))
    assert found["acc_text"] == "83.25 ± 0.35 (n=2)" and found["margin"] == 1.0 and found["metric"] == "test_accuracy"
    ppl = tables.parity(history([]), frame.assign(test_perplexity=110.0), frame.assign(test_perplexity=100.0),
                        PERPLEXITY)
    assert ppl["margin"] == pytest.approx(2.0) and ppl["trend_text"] == "no evaluation history"


# ---- figures -------------------------------------------------------------------------------------

def test_curves_draw_the_mean_over_seeds_in_the_axis_units():
    import matplotlib.pyplot as plt

    wide = pd.DataFrame({"name": ["a"] * 4, "seed": [0, 1, 0, 1], "bytes_sent": [1e6, 1e6, 2e6, 2e6],
                         "test_accuracy": [80.0, 82.0, 84.0, 88.0]})
    ax = curves(wide, "bytes_sent", "test_accuracy", title="t")
    [line] = [ln for ln in ax.get_lines() if len(ln.get_xdata())]
    assert list(line.get_xdata()) == [1.0, 2.0]  # MB
    assert list(line.get_ydata()) == [81.0, 86.0]
    assert ax.get_xlabel() == "data sent per rank (MB)" and ax.get_ylabel() == "test accuracy (%)"
    assert ax.get_title() == "t"
    empty = curves(wide.iloc[0:0], "samples", "train_loss", logx=True)
    assert not empty.get_lines() and empty.get_xscale() == "log"
    plt.close("all")


# ---- index ---------------------------------------------------------------------------------------

def test_the_index_counts_every_kind_of_verdict(tmp_path):
    write_claims("alpha", "Alpha", [Claim("a", "p", "x", "reproduced"), Claim("b", "p", "x", "contradicted"),
                                    Claim("c", "p", "x", "not testable at this budget")], tmp_path)
    write_claims("beta", "Beta", [Claim("d", "p", "x", "inconclusive"), Claim("e", "p", "x", "contradicted")],
                 tmp_path)
    counts = verdict_counts({"alpha": json.loads((tmp_path / "alpha/claims.json").read_text())["claims"]})
    assert counts["alpha"]["contradicted"] == 1 and counts["alpha"]["not measured"] == 0
    page = build_index(tmp_path).read_text()
    header = page[page.index("<th>paper</th><th>title</th>"):].split("</tr>")[0]
    assert [h.split("</th>")[0] for h in header.split("<th>")[1:]] == ["paper", "title", "claims", *VERDICTS]
    assert ("In all: 5 claims: 1 reproduced, 0 partly reproduced, 2 contradicted, 1 inconclusive, 0 not testable at "
            "this scale, 1 not testable at this budget, 0 not measured, 0 consistent, 0 inconsistent.") in page
    beta = page[page.index("<td>beta</td>"):].split("</tr>")[0]
    cells = [c.split("</td>")[0] for c in beta.split("<td>")[1:]]
    assert cells[:3] == ["beta", "Beta", "2"]
    filled = {VERDICTS[i]: cell for i, cell in enumerate(cells[3:]) if cell}
    assert set(filled) == {"contradicted", "inconclusive"} and all(">1</span>" in c for c in filled.values())
    assert page.count("<dt>") == len(VERDICTS)  # what each verdict says


def test_numpy_scalars_do_not_reach_the_texts():
    assert notebook._span(np.array([2, 4])) == "2, 4"
