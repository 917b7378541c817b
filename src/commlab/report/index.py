"""reports/index.html: every paper's report, every claims table, and a cross-paper view.

The index reads what each paper's report wrote beside its HTML: ``claims.json`` (the claims and
verdicts, with the seeds behind each mean) and ``runs.csv`` (each run's final test metric, bytes
sent by a worker and wall-clock time, and its link). From the runs it draws what no single report
shows: every method of every paper on one chart of final test accuracy against bytes sent per
worker, and on one against wall-clock time: the time on an emulated link where the run had one
(its ``network`` tag names the link), else on loopback, and the legend says which. A run is
charted by its task's metric (:mod:`commlab.report.metrics`): runs of language models (perplexity)
and masked language models (masked-token accuracy) get charts of their own, as their numbers do not
share an axis with an image classifier's accuracy.

It also ranks every run of every paper by its time to a shared accuracy target on each emulated
link of the throughput benchmark (:mod:`commlab.report.ranking`, from each report's
``evaluations.csv`` and ``<out>/bench/throughput*.json``): one table per task and link, the runs
without a throughput measurement listed as not measured.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import Counter
from pathlib import Path

import pandas as pd

from commlab.report.claims import VERDICT_COLOURS, VERDICT_MEANINGS, VERDICTS
from commlab.report.metrics import ACCURACY, DATASET_NAMES, MODEL_NAMES, TASK_METRICS, run_metric
from commlab.report.ranking import load_evaluations, rank_by_link, throughput_files

CHART_DPI = 150


def _table(headers: list[str], rows: list[list[str]], verdict_col: int | None = None, css: str = "") -> str:
    """An HTML table; cells are already escaped HTML."""
    out = [f'<table class="{css}">' if css else "<table>",
           "<tr>" + "".join(f"<th>{h}</th>" for h in headers) + "</tr>"]
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            style = ""
            if i == verdict_col:
                style = f' style="background:{VERDICT_COLOURS.get(html.unescape(cell), "#ffffff")}"'
            cells.append(f"<td{style}>{cell}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def load_summaries(out: Path) -> pd.DataFrame:
    """Every report's runs.csv, one row per run; the link is 'loopback' where none was emulated."""
    frames = [pd.read_csv(p) for p in sorted(out.glob("*/runs.csv")) if p.stat().st_size]
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame()
    runs = pd.concat(frames, ignore_index=True)
    runs["link"] = runs["network"].astype(object).where(runs["network"].notna(), "loopback").astype(str)
    runs.loc[runs.link != "loopback", "link"] = "emulated " + runs.link
    return runs


def cross_paper_points(runs: pd.DataFrame, x: str, y: str = ACCURACY.name) -> pd.DataFrame:
    """Mean over seeds per (paper, run name, link) of the final test metric ``y`` and ``x``."""
    data = runs.dropna(subset=[y, x])
    if data.empty:
        return pd.DataFrame(columns=["paper", "name", "link", y, x, "seeds"])
    return data.groupby(["paper", "name", "link"], as_index=False).agg(
        **{y: (y, "mean")}, **{x: (x, "mean")}, seeds=("seed", "nunique"))


def cross_paper_figure(runs: pd.DataFrame, x: str, xlabel: str, scale_x: float = 1.0, y: str = ACCURACY.name):
    """The final test metric ``y`` against ``x`` (divided by ``scale_x``): colour = paper, marker =
    link, each point labelled with its run name."""
    import matplotlib.pyplot as plt

    points = cross_paper_points(runs, x, y)
    fig, ax = plt.subplots(figsize=(10, 6))
    markers = dict(zip(sorted(points.link.unique()), "osD^v<>", strict=False))
    colours = plt.get_cmap("tab10")
    for i, (paper, g) in enumerate(points.groupby("paper")):
        for link, h in g.groupby("link"):
            ax.scatter(h[x] / scale_x, h[y], color=colours(i % 10), marker=markers.get(link, "o"),
                       s=36, label=f"{paper} ({link})", alpha=0.85, edgecolors="black", linewidths=0.4)
            for row in h.itertuples():
                ax.annotate(row.name, (getattr(row, x) / scale_x, getattr(row, y)), fontsize=6,
                            xytext=(3, 2), textcoords="offset points", color=colours(i % 10))
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"final {TASK_METRICS[y].label}")
    ax.grid(True, which="major", alpha=0.3)
    if len(points):
        ax.legend(fontsize=7, loc="best", title="paper (link)", title_fontsize=7)
    fig.tight_layout()
    return fig


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=CHART_DPI, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def emulated_link_seconds(runs: pd.DataFrame, out: Path) -> tuple[pd.Series, str]:
    """Per run, the seconds its samples take at the throughput its method measured on the slowest
    emulated link of the throughput benchmark (``out/bench/throughput.json``), for runs with the
    benchmark's model and worker count; NaN for the others. Also the link's name ('' without one)."""
    path = out / "bench" / "throughput.json"
    if runs.empty or not path.exists():
        return pd.Series(float("nan"), index=runs.index), ""
    bench = json.loads(path.read_text())
    rates = [r for r in bench.get("summary", []) if r.get("measured_link_mbit") and r.get("samples_per_s")]
    if not rates:
        return pd.Series(float("nan"), index=runs.index), ""
    slowest = min(rates, key=lambda r: r["measured_link_mbit"])["network"]
    rate = {r["method"]: r["samples_per_s"] for r in rates if r["network"] == slowest}
    same_setting = (runs.model.astype(str) == str(bench.get("model"))) & (runs.workers == bench.get("workers"))
    per_run = runs.samples / runs.method.map(rate)
    return per_run.where(same_setting), slowest


#: Datasets of generated samples, whose accuracy means nothing (commlab.data: synthetic, synthetic_tokens).
GENERATED = ("synthetic", "synthetic_tokens")


def real_data_runs(runs: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """The runs to chart, and whether they are all on generated data. Runs on generated data (Ok-Topk's
    volume-only runs, BERT's throughput rows) are set aside wherever runs on real data exist: their
    accuracy says nothing beside the others. Where no run has real data (a pipeline check), they are
    what there is to draw."""
    if runs.empty or "dataset" not in runs:
        return runs, False
    generated = runs.dataset.astype(str).isin(GENERATED)
    if generated.all():
        return runs, True
    return runs[~generated], False


def by_task_metric(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The runs grouped by their task's metric (in :data:`TASK_METRICS` order, accuracy last),
    each group only with runs that have a final value of it."""
    metric = run_metric(runs)
    groups = {}
    for name in TASK_METRICS:
        group = runs[metric == name]
        if name in group and group[name].notna().any():
            groups[name] = group
    return groups


def _charts(runs: pd.DataFrame, out: Path, metric: str) -> list[str]:
    """The cross-paper charts of runs of one task metric, as <figure> elements."""
    links = sorted(runs.link.unique())
    time_label = ("wall-clock time of the training loop (s; " + ", ".join(links) + ")")
    charts = [("bytes", runs, "bytes_sent", "data sent by one worker (MB, log scale)", 1e6),
              ("time", runs, "wall_seconds", time_label + ", log scale", 1.0)]
    seconds, link = emulated_link_seconds(runs, out)
    if seconds.notna().any():
        on_link = runs.assign(link_seconds=seconds, link=f"emulated {link}, benchmark rate")
        charts.append(("link", on_link, "link_seconds", f"time of the run's samples at its method's throughput on "
                       f"the emulated {link} link (s, log scale; bench/throughput.json beside this page)", 1.0))
    suffix, measured = ("" if metric == ACCURACY.name else f"-{metric}"), TASK_METRICS[metric].measured
    figures = []
    for key, frame, column, label, scale in charts:
        fig = cross_paper_figure(frame, column, label, scale, y=metric)
        figures.append(f'<figure><img class="cross-paper-{key}{suffix}" alt="final {measured} against '
                       f'{html.escape(label)}" width="960" src="data:image/png;base64,{_png(fig)}"></figure>')
    return figures


def cross_paper_html(out: Path) -> str:
    """The two cross-paper charts as embedded PNGs, per task metric (an explanation where no run
    has a result)."""
    runs, generated_only = real_data_runs(load_summaries(out))
    groups = by_task_metric(runs) if not runs.empty else {}
    if not groups:
        return '<p id="cross-paper">No run with a final test accuracy yet.</p>'
    parts = ['<div id="cross-paper">']
    if generated_only:
        parts.append('<p class="generated-data"><strong>Every run here trained on generated data</strong> '
                     '(<code>dataset: synthetic</code>): the accuracies show the pipeline works, not how '
                     'methods compare.</p>')
    if len(groups) > 1:
        parts.append("<p>Runs of different tasks are charted apart, each by its task's metric: "
                     + ", ".join(f"{len(g)} runs by {html.escape(TASK_METRICS[m].label)}" for m, g in groups.items())
                     + ". A perplexity and an accuracy share no axis.</p>")
    for metric, group in groups.items():
        if len(groups) > 1:
            parts.append(f"<h3>{html.escape(TASK_METRICS[metric].label)}</h3>")
        parts += _charts(group, out, metric)
    parts.append("<p><small>Each point: one run variant of one paper, mean over its seeds. Papers train "
                 "different models on different subsets, so compare methods within a colour; across colours the "
                 "chart shows where each paper's methods sit. Time on loopback is measured on a shared machine "
                 "where computation dominates; only emulated links speak to a network's speed: the last chart "
                 "(when the throughput benchmark has run) divides each run's samples by the samples per second "
                 "its method reached on the benchmark's slowest emulated link, for the runs with the "
                 "benchmark's model and worker count.</small></p>")
    parts.append("</div>")
    return "\n".join(parts)


def _cell(value, fmt: str) -> str:
    """A number of a ranking table, '' where it is not measured."""
    return "" if value is None or (isinstance(value, float) and value != value) else fmt.format(value)


def ranking_html(out: Path) -> str:
    """Per throughput benchmark file and emulated link, every run ranked by its time to the task's
    shared target (:func:`commlab.report.ranking.rank_by_link`), or why there is no ranking."""
    e = html.escape
    evaluations, files = load_evaluations(out), throughput_files(out)
    if not files:
        return ('<p id="ranking">Not measured: no throughput benchmark beside the reports '
                "(<code>bench/throughput.json</code>; <code>snakemake bench</code> measures it).</p>")
    parts = ['<div id="ranking">',
             "<p>The target, per task: the highest accuracy every compared run reaches (the lowest of their best "
             "seed-mean evaluations). A run's time: the samples it processed up to its first evaluation at the "
             "target (its seed-mean curve, on loopback), over the samples per second its method trained on that "
             "link in the throughput benchmark. Runs differ in their grids' settings (learning-rate schedule, "
             "training subset) and are ranked as their grids trained them.</p>"]
    for bench in files:
        tables, shared = rank_by_link(evaluations, bench)
        task = (f"{DATASET_NAMES.get(str(bench.get('dataset')), bench.get('dataset'))} "
                f"{MODEL_NAMES.get(str(bench.get('model')), bench.get('model'))}, {bench.get('workers')} workers")
        if not tables:
            parts.append(f"<p>{e(task)} ({e(Path(bench['file']).name)}): not measured (no emulated link in the "
                         "benchmark, or no run of its model with an evaluation history).</p>")
            continue
        metric = shared["metric"]
        for link, table in tables.items():
            parts.append(f"<h3>{e(task)}: emulated {e(link)} link</h3>")
            parts.append(f"<p>Target: {e(metric.measured)} {_cell(shared['target'], '{:.2f}')} "
                         f"(reached by all {shared['compared']} compared runs); rates from "
                         f"{e(Path(bench['file']).name)}.</p>")
            rows = [[_cell(r.rank, "{:.0f}"), e(str(r.paper)), e(str(r.name)), e(str(r.method)), str(r.seeds),
                     str(r.workers), _cell(r.samples_to_target, "{:,.0f}"), _cell(r.samples_per_s, "{:,.0f}"),
                     _cell(r.seconds, "{:,.1f}"), _cell(r.over_fastest, "{:.2f}x"), e(r.note)]
                    for r in table.itertuples()]
            parts.append(_table(["rank", "paper", "run", "method", "seeds", "workers", "samples to target",
                                 f"samples/s at {e(link)}", "time (s)", "over the fastest", "note"], rows,
                                css="commlab-ranking"))
    parts.append("</div>")
    return "\n".join(parts)


def verdict_counts(claims_by_paper: dict[str, list[dict]]) -> dict[str, Counter]:
    """Per paper, how many of its claims got each verdict (a kind it has none of counts 0)."""
    return {paper: Counter(c.get("verdict", "") for c in claims) for paper, claims in claims_by_paper.items()}


def _count_cell(count: int, verdict: str) -> str:
    return f'<span style="background:{VERDICT_COLOURS[verdict]};padding:0 .3em">{count}</span>' if count else ""


def totals_html(counts: dict[str, Counter]) -> str:
    """'In all: 36 claims: 12 reproduced, 0 partly reproduced, ...': every kind, over every paper."""
    total = sum(counts.values(), Counter())
    return (f"<p>In all: {sum(total.values())} claims: "
            + ", ".join(f"{total[v]} {html.escape(v)}" for v in VERDICTS) + ".</p>")


def verdicts_html() -> str:
    """The verdicts and what each means, as a list."""
    items = [f'<dt><span style="background:{VERDICT_COLOURS[v]};padding:0 .3em">{html.escape(v)}</span></dt>'
             f"<dd>{html.escape(VERDICT_MEANINGS[v])}</dd>" for v in VERDICTS]
    return '<dl class="commlab-verdicts">' + "".join(items) + "</dl>"


def time_html(results: Path | None, log: Path | None) -> str:
    """How the workflow run that built the index spent its time, from its Snakemake log (``log``,
    up to now: the index is its last job) and the training jobs' timelines under ``results``
    (:mod:`commlab.bench.overhead`); what is not there is said to be not measured."""
    from commlab.bench.overhead import parse_snakemake_log, training_phases, workflow_split

    e = html.escape
    parts = []
    if log is not None and log.exists():
        split = workflow_split(parse_snakemake_log(log.read_text()))
        if split["elapsed"]:
            rows = [[e(r["rule"]), str(r["jobs"]), f"{r['seconds'] / 60:.1f}"] for r in split["rules"]]
            rows.append(["no job running (Snakemake's own)", "", f"{split['idle'] / 60:.1f}"])
            parts.append(f"<p>Snakemake's run, up to this page: {split['elapsed'] / 60:.1f} minutes "
                         f"(<code>{e(log.name)}</code>; the installation before it is not counted).</p>"
                         + _table(["rule", "jobs", "minutes"], rows))
    if not parts:
        parts.append("<p>The workflow's own time: not measured (no Snakemake log given).</p>")
    training = training_phases(results) if results is not None and results.exists() else {"jobs": 0}
    if training["jobs"]:
        seconds, total = training["seconds"], training["total"]
        overhead = {p: s for p, s in seconds.items() if p != "steps" and s > 0}
        worst = sorted(overhead.items(), key=lambda kv: -kv[1])[:4]
        parts.append(f"<p>{training['jobs']} training jobs ({training['served']} served by the warm launcher): "
                     f"{total / 60:.1f} minutes, {seconds['steps'] / total:.0%} of it in training steps; the most "
                     "of the rest: " + ", ".join(f"{e(p)} {s / total:.1%}" for p, s in worst)
                     + ". Each job's split is its <code>timeline.json</code>; <code>commlab bench overhead "
                     "--workflow latest</code> prints it all.</p>")
    else:
        parts.append("<p>The training jobs' phases: not measured (no <code>timeline.json</code> under the "
                     "results).</p>")
    return "\n".join(parts)


def build_index(out: Path, results: Path | None = None, log: Path | None = None) -> Path:
    """``out/index.html``: every paper's report, every claims table, each kind of verdict counted
    per paper and in all, the cross-paper charts, and how the run spent its time (``results``:
    the runs' folder; ``log``: the Snakemake log of the run, see :func:`time_html`)."""
    e = html.escape
    papers = sorted({p.parent.name for pattern in ("*/report.html", "*/claims.json") for p in out.glob(pattern)})
    summary, claim_rows, titles, links, claims_by_paper = [], [], {}, {}, {}
    for paper in papers:
        claims_path = out / paper / "claims.json"
        data = json.loads(claims_path.read_text()) if claims_path.exists() else {"title": "", "claims": []}
        link = e(paper)
        if (out / paper / "report.html").exists():
            link = f'<a href="{e(paper)}/report.html">{e(paper)}</a>'
        titles[paper], links[paper], claims_by_paper[paper] = data.get("title", ""), link, data.get("claims", [])
        for c in data.get("claims", []):
            claim_rows.append([link] + [e(str(c.get(k, ""))) for k in ("claim", "paper", "ours", "seeds", "verdict",
                                                                        "note")])
    counts = verdict_counts(claims_by_paper)
    for paper in papers:
        summary.append([links[paper], e(titles[paper]), str(len(claims_by_paper[paper]))]
                       + [_count_cell(counts[paper][v], v) for v in VERDICTS])
    style = ("body{font-family:sans-serif;margin:2em;max-width:75em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #bbb;padding:.35em .6em;vertical-align:top;text-align:left}"
             "th{background:#f0f0f0}img{max-width:100%;height:auto}")
    page = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>commlab reports</title><style>{style}</style></head><body>",
        "<h1>commlab: reproduction reports</h1>",
        "<p>Each paper's report shows its runs from MLflow (mean and spread over seeds) and a claims "
        "table: the paper's claim, its figure, our measurement at our scale with the number of seeds n "
        "behind each mean, and a verdict computed from the numbers. Only reproduced, partly reproduced "
        "and contradicted measure the paper's claim; the others say why this setting could not decide "
        "it.</p>",
        "<h2>Papers</h2>",
        _table(["paper", "title", "claims", *(e(v) for v in VERDICTS)], summary, css="commlab-counts")
        + totals_html(counts) if summary else "<p>No reports yet.</p>",
        "<h2>The verdicts</h2>",
        verdicts_html(),
        "<h2>Every method of every paper: accuracy against communication and time</h2>",
        cross_paper_html(out),
        "<h2>Time to a shared accuracy target on each emulated link</h2>",
        ranking_html(out),
        "<h2>How this run spent its time</h2>",
        time_html(results, log),
        "<h2>All claims</h2>",
        _table(["paper", "claim", "paper's figure", "ours", "n", "verdict", "note"], claim_rows, verdict_col=5,
               css="commlab-claims")
        if claim_rows else "<p>No claims tables yet.</p>",
        "</body></html>",
    ]
    out.mkdir(parents=True, exist_ok=True)
    target = out / "index.html"
    target.write_text("\n".join(page) + "\n", encoding="utf-8")
    return target
