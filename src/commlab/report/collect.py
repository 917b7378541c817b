"""MLflow runs -> tidy pandas tables, the input of every report notebook.

``load_runs(paper, scale=...)`` returns one row per (name, seed): the newest FINISHED run at that
scale (re-running a job adds a run beside the old one; reports pick the newest).

Scale: runs carry a ``scale`` tag (smoke, laptop, laptop_full, paper). ``load_runs`` keeps the
runs tagged with the asked scale; runs without the tag (made before runs were tagged) count as
that scale only when no run of the experiment carries a ``scale`` tag at all. ``scale=None``
keeps every run.

``load_history(runs, metrics)`` returns the per-step values of those runs in long form: run_id,
name, method, seed, metric, step, value (commlab.report.notebook.wide_history pivots it).
"""

from __future__ import annotations

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
