"""Seaborn figures shared by the report notebooks: a metric against an x-axis (samples, bytes,
global reductions, seconds), one line per method variant, mean and spread over seeds
(tests/test_report_notebook.py checks the drawn means and units)."""

from __future__ import annotations

# No backend is forced here: inside a notebook the inline backend embeds the figures, and
# without a display matplotlib falls back to Agg by itself.
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

AXIS_LABELS = {
    "samples": "samples processed", "bytes_sent": "data sent per rank (MB)",
    "reductions_global": "global reductions", "wall_seconds": "wall-clock time (s)",
    "train_loss": "training loss", "test_accuracy": "test accuracy (%)", "test_loss": "test loss",
    "test_perplexity": "test perplexity (lower is better)", "test_mlm_accuracy": "masked-token accuracy (%)",
    "step": "training step",
}
#: Columns drawn in another unit than logged: bytes are shown in MB.
AXIS_SCALE = {"bytes_sent": 1e6}


def curves(wide: pd.DataFrame, x: str, y: str, hue: str = "name", ax=None, logx: bool = False,
           title: str | None = None):
    """Line plot of ``y`` against ``x``; seeds are aggregated (mean, band = one s.d.). A metric the
    runs did not log leaves the axes empty (labelled), never a zero line."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    data = wide.dropna(subset=[x, y]) if {x, y} <= set(wide.columns) else wide.iloc[0:0]
    data = data.assign(**{c: data[c] / AXIS_SCALE[c] for c in (x, y) if c in AXIS_SCALE})
    if not data.empty:
        sns.lineplot(data=data, x=x, y=y, hue=hue, errorbar="sd", ax=ax, marker="o", markersize=3)
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS.get(y, y))
    if logx:
        ax.set_xscale("log")
    if title:
        ax.set_title(title)
    return ax

