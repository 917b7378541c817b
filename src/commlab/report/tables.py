"""Tidy tables from what the runs logged: params as columns, wide histories, counters at evaluations.

The claims (``commlab.report.claims_<paper>``) and the notebooks' figures read the same tables,
built from :func:`commlab.report.collect.load_runs` (one row per run: final metrics, ``param.*``)
and :func:`commlab.report.collect.load_history` (long form: run_id, name, method, seed, metric,
step, value). Nothing here reads anything but those two frames.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from commlab.report.claims import mean_sd
from commlab.report.convergence import evaluation_trend
from commlab.report.metrics import TaskMetric

KEYS = ["run_id", "name", "method", "seed", "step"]


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


def by_seed(runs: pd.DataFrame, column: str) -> pd.Series:
    """A column's values indexed by seed, NaN dropped: what a paired comparison takes
    (:func:`commlab.report.paired.difference`)."""
    if runs.empty or column not in runs:
        return pd.Series(dtype=float, name=column)
    values = pd.to_numeric(runs[column], errors="coerce").to_numpy(dtype=float)
    return pd.Series(values, index=runs["seed"].astype(int).to_numpy(), name=column).dropna()


def parity(history: pd.DataFrame, ours: pd.DataFrame, reference: pd.DataFrame, metric: TaskMetric) -> dict:
    """What an accuracy-parity claim is judged on (:class:`commlab.report.rules.AccuracyMatch`):
    both sides' final values of the task's ``metric`` per seed (``acc``, ``dense``) with their texts,
    the margin of "near the reference", and the trend of both over their evaluations (``trend``:
    judged at convergence only) in words (``trend_text``)."""
    acc, dense = by_seed(ours, metric.name), by_seed(reference, metric.name)
    trend = evaluation_trend(history, ours.get("run_id", []), reference.get("run_id", []), metric.name)
    return {"acc": acc, "dense": dense, "acc_text": mean_sd(acc), "dense_text": mean_sd(dense),
            "metric": metric.name, "margin": metric.margin_for(dense), "trend": trend,
            "trend_text": trend.describe(metric.unit)}
