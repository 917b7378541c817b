"""The prologue every report notebook shares: load the runs, describe them, show claims and figures.

A paper's notebook (workflow/notebooks/<paper>.py) keeps only what is specific to its paper: which
metrics it reads, its claims and its figures. Everything else lives here:

    from commlab.report.notebook import open_report, show, show_claims, param, at_evaluations
    rep = open_report(paper, out_dir, tracking_uri, scale, METRICS)   # shows title and scale
    runs, history = rep.runs, rep.history
    ...                                                              # the paper's claims
    show_claims(rep, claims)                                         # the verdicts, first result
    show(rep, fig, "accuracy_vs_bytes")                              # figures at print quality

The report reads what the runs logged; the one thing it can still compute for older runs is the
model's parameter count (:func:`model_parameters`), which new runs log as ``model_parameters``.
Importing this module also silences the warnings libraries print into a notebook (tqdm's
"IProgress not found", pandas' and seaborn's FutureWarnings): a report shows results, and the
build keeps any other stderr out of the HTML (commlab.report.build).
"""

from __future__ import annotations

import html
import io
import json
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

from commlab.report.claims import VERDICT_COLOURS, Claim, seeds_label, write_claims  # noqa: E402
from commlab.report.collect import load_history, load_runs  # noqa: E402

DPI = 150  # print quality for every embedded and saved figure
SCREEN_DPI = 96  # the figure's width in inches at this density is its width on the page
KEYS = ["run_id", "name", "method", "seed", "step"]
#: What the index's cross-paper charts read from every report (<out>/<paper>/runs.csv).
SUMMARY_COLUMNS = ["paper", "name", "method", "seed", "workers", "model", "dataset", "scale", "network",
                   "link_mbit", "test_accuracy", "bytes_sent", "wall_seconds", "samples"]

#: The lab template right-aligns table cells: the report's own tables read left to right.
STYLE = ("<style>.commlab-claims td,.commlab-claims th,.commlab-scale td,.commlab-scale th"
         "{text-align:left!important;vertical-align:top;padding:.3em .5em}"
         ".commlab-claims td:nth-child(4){white-space:nowrap}</style>")

pd.set_option("display.max_colwidth", None)
matplotlib.rcParams.update({"savefig.dpi": DPI, "figure.dpi": SCREEN_DPI, "savefig.bbox": "tight"})


@dataclass
class Report:
    """One paper's report: its runs (newest finished per name and seed at one scale) and history."""

    paper: str
    title: str
    out_dir: Path
    scale: str | None
    runs: pd.DataFrame
    history: pd.DataFrame
    figures: list[str] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        return self.out_dir / self.paper


def grid_title(paper: str) -> str:
    """The paper's title from its grid file, or the paper's name away from the project root."""
    from commlab.grid import grid_title as title_of

    try:
        return title_of(paper)
    except Exception:  # noqa: BLE001 - the report still builds outside the project root
        return paper


def open_report(paper: str, out_dir: str | Path = "reports", tracking_uri: str | None = None,
                scale: str | None = None, metrics: list[str] | tuple = ()) -> Report:
    """Load the paper's runs at ``scale`` and the history of ``metrics``, show the title and what
    was run, and write the runs' final numbers for the index (``<out>/<paper>/runs.csv``)."""
    runs = load_runs(paper, uri=tracking_uri, scale=scale)
    history = load_history(runs, list(metrics), uri=tracking_uri) if len(runs) and metrics else \
        pd.DataFrame(columns=["run_id", "name", "method", "seed", "metric", "step", "value"])
    rep = Report(paper, grid_title(paper), Path(out_dir), scale, runs, history)
    rep.folder.mkdir(parents=True, exist_ok=True)
    summary = runs.assign(paper=paper, link_mbit=link_mbit(runs)) if len(runs) else pd.DataFrame()
    summary.reindex(columns=SUMMARY_COLUMNS).to_csv(rep.folder / "runs.csv", index=False)
    _display_html(header_html(rep))
    return rep


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


def show_claims(rep: Report, claims: list[Claim]) -> None:
    """Write ``claims.json`` and show the claims table (the report's first result)."""
    write_claims(rep.paper, rep.title, claims, rep.out_dir)
    _display_html("<h2>Claims and verdicts</h2>" + claims_html(claims))


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


def seeds_of(runs: pd.DataFrame) -> str:
    """'n=3' (or 'n=1-3'): the seeds per run name behind the means a claim compares."""
    return seeds_label(runs.groupby("name").seed.nunique()) if len(runs) else ""


def param(frame: pd.DataFrame, key: str, default=np.nan, numeric: bool = True) -> pd.Series:
    """The run parameter ``key`` (dotted, as logged) as a column: numbers, or strings with
    ``numeric=False``; ``default`` where a run lacks it (MLflow stores params as strings, and an
    unset option as "None")."""
    col = f"param.{key}"
    if col not in frame:
        return pd.Series(default, index=frame.index, dtype=float if numeric else object)
    if numeric:
        return pd.to_numeric(frame[col], errors="coerce").fillna(default)
    return frame[col].replace({"None": default, "": default}).fillna(default)


def link_mbit(runs: pd.DataFrame) -> pd.Series:
    """The emulated link's rate in Mbit/s per run (NaN on loopback): a metric or a param of the run."""
    for col in ("network_bandwidth_mbit", "param.network_bandwidth_mbit", "param.network.bandwidth_mbit"):
        if col in runs:
            return pd.to_numeric(runs[col], errors="coerce")
    return pd.Series(np.nan, index=runs.index, dtype=float)


def wide_history(history: pd.DataFrame, fill: bool = True) -> pd.DataFrame:
    """Long history -> one row per (run, step), one column per metric; with ``fill`` forward-filled
    within each run (evaluation metrics exist only at epoch ends)."""
    if history.empty:
        return pd.DataFrame(columns=KEYS)
    wide = history.pivot_table(index=KEYS, columns="metric", values="value").reset_index()
    wide.columns.name = None
    wide = wide.sort_values(["run_id", "step"]).reset_index(drop=True)
    if fill:
        cols = [c for c in wide.columns if c not in KEYS]
        wide[cols] = wide.groupby("run_id")[cols].ffill()
    return wide


def at_evaluations(history: pd.DataFrame, axes=("samples", "bytes_sent"), metric: str = "test_accuracy",
                   info: pd.DataFrame | None = None, columns=()) -> pd.DataFrame:
    """One row per evaluation of ``metric``, with the cumulative counters ``axes`` interpolated at
    its step (counters are logged every few steps and start at 0 at step 0; evaluations happen at
    epoch ends) and ``columns`` of ``info`` (one row per run) joined on run_id."""
    evals = history[history.metric == metric].rename(columns={"value": metric}).drop(columns="metric")
    evals = evals.reset_index(drop=True)
    for axis in axes:
        logged = history[history.metric == axis]
        values = []
        for row in evals.itertuples():
            mine = logged[logged.run_id == row.run_id].sort_values("step")
            steps = np.concatenate([[0], mine.step.to_numpy()])
            ys = np.concatenate([[0.0], mine.value.to_numpy()])
            values.append(float(np.interp(row.step, steps, ys)) if len(mine) else np.nan)
        evals[axis] = values
    if info is not None and columns:
        evals = evals.merge(info[["run_id", *columns]], on="run_id", how="left")
    return evals


def bytes_per_step(history: pd.DataFrame, run_id: str) -> float:
    """Bytes a run's rank 0 sent per step between its first and last logged points: the steady
    state, without the one-off broadcast of the initial model (which a short run would otherwise
    spread over few steps)."""
    h = history[(history.run_id == run_id) & (history.metric == "bytes_sent")].sort_values("step")
    if len(h) < 2 or h.step.iloc[-1] == h.step.iloc[0]:
        return float("nan")
    return float((h.value.iloc[-1] - h.value.iloc[0]) / (h.step.iloc[-1] - h.step.iloc[0]))


def mean_sd_table(runs: pd.DataFrame, by: str, columns: dict[str, str]) -> pd.DataFrame:
    """Per ``by`` group: the number of seeds and 'mean ± sd' of each column (label -> column)."""
    def spread(values: pd.Series) -> str:
        values = values.dropna()
        sd = values.std(ddof=1) if len(values) > 1 else 0.0
        return f"{values.mean():.4g} ± {sd:.2g}" if len(values) else ""

    present = {label: col for label, col in columns.items() if col in runs}
    return runs.groupby(by).agg(seeds=("seed", "nunique"), **{k: (c, spread) for k, c in present.items()})


def model_parameters(run) -> int:
    """Trainable parameters of a run's model: the ``model_parameters`` it logged, else computed
    from its model and dataset (runs from before the training loop logged it)."""
    for key in ("param.model_parameters", "model_parameters"):
        value = run.get(key) if hasattr(run, "get") else None
        if value is not None and str(value) not in ("None", "nan", ""):
            return int(float(value))
    from commlab.models import build_model
    from commlab.registry import DATASETS

    spec = DATASETS.get(str(run["param.dataset"]))
    model = build_model(str(run["param.model"]), spec.channels, spec.num_classes, spec.image_size)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_images(run) -> int | None:
    """How many test images a run evaluates on (its test_subset, else the prepared test set)."""
    meta = Path(str(run["param.data_dir"])) / str(run["param.dataset"]) / "meta.json"
    total = json.loads(meta.read_text())["test_shape"][0] if meta.exists() else None
    subset = str(run.get("param.train.test_subset", "None"))
    if subset.isdigit():
        return min(int(subset), total) if total else int(subset)
    return total
