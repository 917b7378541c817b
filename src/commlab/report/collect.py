"""MLflow runs -> tidy pandas tables, the input of every report notebook.

``load_runs(paper, scale=...)`` returns one row per (name, seed): the newest FINISHED run at that
scale (re-running a job adds a run beside the old one; reports pick the newest).

Scale: runs carry a ``scale`` tag (smoke, laptop, laptop_full, paper). ``load_runs`` keeps the
runs tagged with the asked scale; runs without the tag (made before runs were tagged) count as
that scale only when no run of the experiment carries a ``scale`` tag at all. ``scale=None``
keeps every run.

``load_report_runs(paper, scale=...)`` adds the runs the paper's grid borrows from another grid
(:func:`commlab.grid.borrowed_runs`), read from the lender's experiment, marked ``borrowed_from``.

``load_history(runs, metrics)`` returns the per-step values of those runs in long form: run_id,
name, method, seed, metric, step, value (commlab.report.notebook.wide_history pivots it).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from commlab.tracking import client

RUN_COLUMNS = ["run_id", "name", "method", "seed", "workers", "model", "dataset", "scale", "network", "status",
               "start_time"]


def load_runs(paper: str, uri: str | None = None, status: str = "FINISHED", scale: str | None = None) -> pd.DataFrame:
    """Newest ``status`` run per (name, seed) of the paper's experiment at ``scale``, with final
    metrics as columns (``test_accuracy``, ``bytes_sent``, ...), params as ``param.<key>``
    columns, and the tags model, dataset, scale and network (the emulated link's label; None on
    loopback)."""
    c = client(uri)
    exp = c.get_experiment_by_name(paper)
    if exp is None:
        return pd.DataFrame(columns=RUN_COLUMNS)
    rows = []
    for run in c.search_runs([exp.experiment_id], max_results=50000):
        if run.info.status != status:
            continue
        tags = run.data.tags
        row = {"run_id": run.info.run_id, "name": tags.get("name"), "method": tags.get("method"),
               "seed": int(tags.get("seed", -1)), "workers": int(tags.get("workers", 0)),
               "model": tags.get("model"), "dataset": tags.get("dataset"), "scale": tags.get("scale"),
               "network": tags.get("network"), "status": run.info.status, "start_time": run.info.start_time}
        row.update(run.data.metrics)
        row.update({f"param.{k}": v for k, v in run.data.params.items()})
        rows.append(row)
    if not rows:
        return pd.DataFrame(columns=RUN_COLUMNS)
    df = pd.DataFrame(rows).sort_values("start_time")
    if scale is not None:
        tagged = df.scale.notna()
        df = df[df.scale == scale] if tagged.any() else df
        if df.empty:
            return pd.DataFrame(columns=RUN_COLUMNS)
    return df.groupby(["name", "seed"], as_index=False).last().reset_index(drop=True)


def borrowed(paper: str, scale: str | None) -> dict[tuple[str, int], str]:
    """``{(name, seed): lender}`` of the runs the paper's grid borrows at ``scale`` (laptop when
    none is given); none where there is no grid of that name here (an ad-hoc experiment)."""
    from commlab.config import ConfigError
    from commlab.grid import PAPERS_DIR, borrowed_runs

    if not (Path(PAPERS_DIR) / f"{paper}.yaml").exists():
        return {}
    try:
        return borrowed_runs(paper, scale=scale or "laptop")
    except ConfigError:
        return {}  # a scale the grid does not have: it borrows nothing there


def load_report_runs(paper: str, uri: str | None = None, scale: str | None = None) -> pd.DataFrame:
    """The runs a paper's report reads: :func:`load_runs` of its own experiment and, for each run
    its grid borrows, the lender's run of that name and seed (column ``borrowed_from``: the lender,
    empty for its own)."""
    own = load_runs(paper, uri=uri, scale=scale)
    parts = [own.assign(borrowed_from="")]
    lent: dict[str, set] = {}
    for (name, seed), lender in borrowed(paper, scale).items():
        lent.setdefault(lender, set()).add((name, seed))
    for lender, keys in sorted(lent.items()):
        theirs = load_runs(lender, uri=uri, scale=scale)
        mine = [(r.name, int(r.seed)) in keys for r in theirs.itertuples()]
        parts.append(theirs[mine].assign(borrowed_from=lender))
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else own.assign(borrowed_from="")


def load_history(runs: pd.DataFrame, metrics: list[str], uri: str | None = None) -> pd.DataFrame:
    """Per-step values of ``metrics`` for the given runs, long form."""
    c = client(uri)
    rows = []
    for run in runs.itertuples():
        for metric in metrics:
            for m in c.get_metric_history(run.run_id, metric):
                rows.append({"run_id": run.run_id, "name": run.name, "method": run.method,
                             "seed": run.seed, "metric": metric, "step": m.step, "value": m.value})
    return pd.DataFrame(rows, columns=["run_id", "name", "method", "seed", "metric", "step", "value"])
