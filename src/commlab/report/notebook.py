"""The prologue every report notebook shares: load the runs, describe them, show claims and figures.

A paper's notebook (workflow/notebooks/<paper>.py) keeps only its figures; its claims are declared
in ``commlab.report.claims_<paper>`` (:mod:`commlab.report.claims`) and evaluated here:

    from commlab.report.notebook import open_report, show, show_claims
    rep = open_report(paper, out_dir, tracking_uri, scale, METRICS)   # shows title and scale
    show_claims(rep)                                                 # the verdicts, first result
    show(rep, fig, "accuracy_vs_bytes")                              # figures at print quality

A report reads MLflow (:mod:`commlab.report.collect`) and the benchmark files under
``<out_dir>/bench`` only. Importing this module also silences the warnings libraries print into a
notebook (tqdm's "IProgress not found", pandas' and seaborn's FutureWarnings): a report shows
results, and the build keeps any other stderr out of the HTML (commlab.report.build).
"""

from __future__ import annotations

import html
import io
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

# Before tqdm or MLflow are imported: no notebook progress widgets (ipywidgets is not installed,
# which is what tqdm's "IProgress not found" warning says) and no progress bars at all.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
for _category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
    warnings.filterwarnings("ignore", category=_category)
warnings.filterwarnings("ignore", message="IProgress not found")
warnings.filterwarnings("ignore", message="(Mean of empty slice|Degrees of freedom|invalid value encountered)")

import matplotlib  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from commlab.report.claims import (  # noqa: E402
    VERDICT_COLOURS,
    VERDICT_MEANINGS,
    VERDICTS,
    Claim,
    Evidence,
    declarations,
    evaluate,
    write_claims,
)
from commlab.report.collect import load_history, load_report_runs  # noqa: E402
from commlab.report.metrics import TASK_METRICS  # noqa: E402
from commlab.report.ranking import evaluations_table  # noqa: E402
from commlab.report.tables import link_mbit  # noqa: E402

DPI = 150  # print quality for every embedded and saved figure
SCREEN_DPI = 96  # the figure's width in inches at this density is its width on the page
#: What the index's cross-paper charts read from every report (<out>/<paper>/runs.csv).
SUMMARY_COLUMNS = ["paper", "name", "method", "seed", "workers", "model", "dataset", "scale", "network",
                   "link_mbit", "test_accuracy", "bytes_sent", "wall_seconds", "samples", "test_perplexity",
                   "test_mlm_accuracy"]

#: What the index's ranking reads from every report's history (<out>/<paper>/evaluations.csv).
EVALUATION_METRICS = ("samples", *TASK_METRICS)

#: The lab template right-aligns table cells: the report's own tables read left to right.
STYLE = ("<style>.commlab-claims td,.commlab-claims th,.commlab-scale td,.commlab-scale th"
         "{text-align:left!important;vertical-align:top;padding:.3em .5em}"
         ".commlab-claims td:nth-child(4){white-space:nowrap}</style>")

pd.set_option("display.max_colwidth", None)
matplotlib.rcParams.update({"savefig.dpi": DPI, "figure.dpi": SCREEN_DPI, "savefig.bbox": "tight"})


@dataclass
class Report(Evidence):
    """One paper's report: the evidence its claims are measured from (its runs, newest finished
    per name and seed at one scale, their history and the benchmark files) and what it shows."""

    paper: str = ""
    title: str = ""
    scale: str | None = None
    figures: list[str] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        return self.out_dir / self.paper


def grid_title(paper: str) -> str:
    """The paper's title from its grid file, or the paper's name where there is no grid file."""
    from commlab.grid import grid_title as title_of

    return title_of(paper) or paper


def open_report(paper: str, out_dir: str | Path, tracking_uri: str | None = None,
                scale: str | None = None, metrics: list[str] | tuple = ()) -> Report:
    """Load the paper's runs at ``scale`` and the history of ``metrics``, show the title and what
    was run, and write for the index the runs' final numbers (``<out>/<paper>/runs.csv``) and
    their evaluations with the samples processed at each (``evaluations.csv``: the index's ranking
    by time to a shared accuracy target, :mod:`commlab.report.ranking`)."""
    runs = load_report_runs(paper, uri=tracking_uri, scale=scale)
    history = load_history(runs, list(metrics), uri=tracking_uri) if len(runs) and metrics else \
        pd.DataFrame(columns=["run_id", "name", "method", "seed", "metric", "step", "value"])
    rep = Report(runs, history, Path(out_dir), paper=paper, title=grid_title(paper), scale=scale)
    rep.folder.mkdir(parents=True, exist_ok=True)
    # The index shows every run once, under the paper that trained it: borrowed runs stay out of these.
    own = runs[runs.borrowed_from == ""] if "borrowed_from" in runs else runs
    summary = own.assign(paper=paper, link_mbit=link_mbit(own)) if len(own) else pd.DataFrame()
    summary.reindex(columns=SUMMARY_COLUMNS).to_csv(rep.folder / "runs.csv", index=False)
    evaluation_history(own, history[history.run_id.isin(own.run_id)], metrics, tracking_uri).pipe(
        evaluations_table, own, paper).to_csv(rep.folder / "evaluations.csv", index=False)
    _display_html(header_html(rep))
    return rep


def evaluation_history(runs: pd.DataFrame, history: pd.DataFrame, metrics, tracking_uri: str | None) -> pd.DataFrame:
    """The history of the samples processed and of every task metric: what the report loaded, and
    the rest of :data:`EVALUATION_METRICS` read now."""
    have = history[history.metric.isin(EVALUATION_METRICS)]
    needed = [m for m in EVALUATION_METRICS if m not in metrics]
    if not len(runs) or not needed:
        return have
    return pd.concat([have, load_history(runs, needed, uri=tracking_uri)], ignore_index=True)


def _display_html(text: str) -> None:
    from IPython.display import HTML, display

    display(HTML(text))


def _span(values) -> str:
    """'4' or '2, 4, 8' or '1,024-9,600' for a column's distinct values."""
    vals = sorted({v for v in values if v is not None and not (isinstance(v, float) and np.isnan(v))})
    if not vals:
        return "?"
    if all(isinstance(v, (int, float, np.integer, np.floating)) for v in vals) and len(vals) > 3:
        return f"{vals[0]:,.0f}-{vals[-1]:,.0f}"
    return ", ".join(f"{v:,.0f}" if isinstance(v, (int, float, np.integer, np.floating)) else str(v) for v in vals)


def header_html(rep: Report) -> str:
    """Title and what was run: scale, runs, workers, dataset, model, seeds, samples per run."""
    e = html.escape
    runs = rep.runs
    parts = [STYLE, f"<h1>{e(rep.title)}</h1>"]
    if runs.empty:
        parts.append(f"<p><b>No finished runs</b> at scale <code>{e(str(rep.scale))}</code> in MLflow "
                     f"experiment <code>{e(rep.paper)}</code>: every claim below is <i>not measured</i>.</p>")
        return "\n".join(parts)
    seeds = runs.groupby("name").seed.nunique()
    seed_text = str(seeds.iloc[0]) if seeds.nunique() == 1 else f"{seeds.min()}-{seeds.max()}"
    cells = {
        "scale": e(str(rep.scale or "untagged")),
        "runs": f"{len(runs)} ({runs.name.nunique()} variant{'s' if runs.name.nunique() > 1 else ''})",
        "seeds per variant": f"{seed_text} (seeds {e(_span(runs.seed))})",
        "workers": e(_span(runs.workers)),
        "dataset": e(_span(runs.get("dataset", pd.Series(dtype=object)))),
        "model": e(_span(runs.get("model", pd.Series(dtype=object)))),
        "samples per run": e(_span(runs["samples"])) if "samples" in runs else "?",
        "links": e(_span(runs.network.fillna("loopback"))) if "network" in runs else "loopback",
    }
    parts.append('<table class="commlab-scale"><tr>' + "".join(f"<th>{k}</th>" for k in cells) + "</tr><tr>"
                 + "".join(f"<td>{v}</td>" for v in cells.values()) + "</tr></table>")
    lent = runs[runs.borrowed_from != ""] if "borrowed_from" in runs else runs.iloc[:0]
    if len(lent):
        names = "; ".join(f"<code>{e(n)}</code> from <code>{e(g.borrowed_from.iloc[0])}</code>'s grid"
                          for n, g in lent.groupby("name"))
        parts.append(f"<p>Runs read from another paper's grid, trained once with the same config for both: "
                     f"{names}.</p>")
    parts.append("<p><small>Verdicts first; figures and per-run details follow. The code is in "
                 '<a href="report.ipynb">report.ipynb</a> beside this page.</small></p>')
    return "\n".join(parts)


def claims_html(claims: list[Claim]) -> str:
    """The claims table: claim, paper's figure, ours, seeds behind the means, verdict, note."""
    e = html.escape
    rows = ["<tr><th>claim</th><th>paper</th><th>ours</th><th>n</th><th>verdict</th><th>note</th></tr>"]
    for c in claims:
        colour = VERDICT_COLOURS.get(c.verdict, "#ffffff")
        rows.append(f"<tr><td>{e(c.claim)}</td><td>{e(c.paper)}</td><td>{e(c.ours)}</td><td>{e(c.seeds)}</td>"
                    f'<td style="background:{colour}"><b>{e(c.verdict)}</b></td><td><small>{e(c.note)}</small>'
                    "</td></tr>")
    return '<table class="commlab-claims">' + "\n".join(rows) + "</table>"


def verdict_legend(claims: list[Claim]) -> str:
    """What each verdict of the table says, for the kinds it holds, in the vocabulary's order:
    '<p><small>4 claims: 1 reproduced (measured here as the paper claims); ...</small></p>'."""
    counts = {v: sum(c.verdict == v for c in claims) for v in VERDICTS}
    parts = [f"{n} {html.escape(v)} ({html.escape(VERDICT_MEANINGS[v])})" for v, n in counts.items() if n]
    return f'<p class="commlab-legend"><small>{len(claims)} claims: ' + "; ".join(parts) + ".</small></p>"


def show_claims(rep: Report) -> None:
    """Evaluate the paper's declared claims (``commlab.report.claims_<paper>``), write
    ``claims.json`` and show the claims table with what its verdicts say (the report's first
    result)."""
    claims = evaluate(declarations(rep.paper).CLAIMS, rep)
    write_claims(rep.paper, rep.title, claims, rep.out_dir)
    _display_html("<h2>Claims and verdicts</h2>" + claims_html(claims) + verdict_legend(claims))


def show(rep: Report, fig, name: str) -> Path:
    """Embed a figure as a PNG at ``DPI`` and save it as ``<out>/<paper>/<name>.png``."""
    from IPython.display import Image, display

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    path = rep.folder / f"{name}.png"
    path.write_bytes(buf.getvalue())
    rep.figures.append(name)
    display(Image(buf.getvalue(), width=int(fig.get_figwidth() * SCREEN_DPI)))
    return path


def nothing(text: str) -> None:
    """An italic line where a figure or table has no data."""
    from IPython.display import Markdown, display

    display(Markdown(f"_{text}_"))
