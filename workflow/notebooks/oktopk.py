# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---


# %% tags=["parameters"]
paper = "oktopk"
out_dir = "reports"
tracking_uri = None
scale = None


# %%
# ruff: noqa: E402 - a notebook imports after its parameters cell
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from IPython.display import display

from commlab.report.claims_oktopk import (
    METRICS,
    accuracy_runs,
    applied_table,
    describe,
    phase_mean,
    ratio_table,
    scaling_table,
    volume_table,
    wide_table,
)
from commlab.report.figures import curves
from commlab.report.metrics import TASK_METRICS, run_metric
from commlab.report.notebook import open_report, show, show_claims

rep = open_report(paper, out_dir, tracking_uri, scale, METRICS)
show_claims(rep)  # declared in commlab.report.claims_oktopk
runs, wide = rep.table(describe), rep.table(wide_table)
acc_runs = rep.table(accuracy_runs)


# %% [markdown]
# ## Accuracy against bytes (4 workers, Fashion-MNIST CNN)


# %%
if not acc_runs.empty:
    # One row of panels per task metric (test accuracy; BERT's masked-token accuracy).
    tasks = acc_runs.assign(metric=run_metric(acc_runs)).groupby("metric", sort=False)
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4 * len(tasks)), squeeze=False)
    for (metric, task_runs), row in zip(tasks, axes, strict=True):
        acc_wide = wide[wide.run_id.isin(task_runs.run_id)].copy()
        acc_wide["bytes_sent"] = acc_wide.groupby("run_id")["bytes_sent"].ffill()
        evals = acc_wide.dropna(subset=[metric]) if metric in acc_wide else acc_wide
        curves(evals, "bytes_sent", metric, ax=row[0], logx=True,
               title=f"{TASK_METRICS[metric].measured} against bytes sent per rank (each evaluation)")
        curves(acc_wide, "samples", "train_loss", ax=row[1], title="training loss against samples")
    fig.tight_layout()
    show(rep, fig, "accuracy_vs_bytes")
    for metric, task_runs in tasks:
        summary = task_runs.groupby("name").agg(
            method=("method", "first"), workers=("workers", "first"), seeds=("seed", "nunique"),
            **{metric: (metric, "mean")}, acc_sd=(metric, "std"),
            MB_sent=("bytes_sent", lambda b: b.mean() / 1e6), selection_s=("selection_seconds", "mean"),
            wall_s=("wall_seconds", "mean")).sort_values("MB_sent")
        display(summary.round(4))


# %% [markdown]
# ## Entries applied per step against k
# Ok-Topk's update applies the entries kept by the global selection: `algo_global_selected`, the
# mean per sparse step over each log window (rank 0; every rank applies the same update), over
# `algo_k`. The paper applies the global top-k of the summed local top-k selections, so 1 is the
# target. The bounded control keeps exactly k on every exact (tau') step (less `algo_trimmed`, the
# entries of a region too full for the allgather's budget) and otherwise reuses its threshold
# while the total stays in [3k/4, 5k/4], recomputing it to within k/16 of k when it leaves; the
# release nudges its thresholds by about 1% a step when the count leaves the same band. Each
# control where it ran (mean over seeds, band: one s.d.), with the band and k. The table gives
# each control's runs as the claims read them: the windows' mean weighted by their sparse steps,
# the lowest and highest window, the share of exact global steps and the threshold cuts per step.


# %%
ok_acc = runs[(runs.method == "oktopk") & ~runs.scaling] if not runs.empty else runs
if not ok_acc.empty and "algo_global_selected" in wide:
    kept = wide[wide.run_id.isin(ok_acc.run_id)].dropna(subset=["algo_global_selected", "algo_k"])
    by_run = ok_acc.set_index("run_id")
    kept = kept.assign(applied_over_k=kept.algo_global_selected / kept.algo_k, run_seed=kept.run_id.map(by_run.seed),
                       control=kept.run_id.map(by_run.control) + ", P=" + kept.run_id.map(by_run.workers).astype(str))
    fig, ax = plt.subplots(figsize=(9, 4))
    sns.lineplot(data=kept, x="step", y="applied_over_k", hue="control", errorbar="sd", marker="o", markersize=3,
                 ax=ax)
    ax.axhline(1, color="k", lw=1, label="k")
    ax.axhspan(0.75, 1.25, color="grey", alpha=0.12, label="[3k/4, 5k/4]")
    ax.set_xlabel("step")
    ax.set_ylabel("entries applied per sparse step / k")
    ax.legend(fontsize=7)
    ax.set_title("Ok-Topk: entries applied per step against k (log windows)")
    fig.tight_layout()
    show(rep, fig, "applied_vs_k")
    applied = rep.table(applied_table)
    if not applied.empty:
        display(applied.groupby(["control", "workers"]).agg(
            runs=("applied_over_k", "size"), applied_over_k=("applied_over_k", "mean"),
            lowest_run=("applied_over_k", "min"), highest_run=("applied_over_k", "max"),
            lowest_window=("lowest_window", "min"), highest_window=("highest_window", "max"),
            exact_global_share=("exact_global_share", "mean"), cuts_per_step=("cuts_per_step", "mean")).round(3))


# %% [markdown]
# ## Details: volume per rank against the number of workers
# The paper's claim is a bound per worker and step, so it is judged on the **worst step of the
# worst rank over the whole sparse phase**: every rank tracks the largest volume it sent in one
# sparse step between two log points, and the logged `algo_step_volume_over_k_max` is its max over
# the ranks; the max over a run's log points is then the max over every sparse step (the windows
# cover them all, including the transient right after the dense warm-up). Beside it the
# cumulative mean per sparse step, max over ranks (`algo_volume_over_k_max`). Volume counts the
# elements sent, indices and values both, count exchanges included. Ok-Topk runs with its
# default bounded threshold control (module docstring); `threshold_control: release` is the
# release's. TopkA's volume is 2k(P-1) at every step.


# %%
for table in (rep.table(volume_table), rep.table(ratio_table)):
    if not table.empty:
        display(table.round(3))


# %%
scaling = rep.table(scaling_table)
if not scaling.empty:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    ax = axes[0]
    palette = dict(zip(sorted(scaling.method.unique()), sns.color_palette(), strict=False))
    sns.lineplot(data=scaling, x="workers", y="worst_step_over_k", hue="method", palette=palette, marker="o", ax=ax)
    for method, g in scaling.groupby("method"):
        ax.plot(g.workers, g.cumulative_over_k, "s--", lw=1, color=palette[method], label=f"{method}: cumulative mean")
    ps = np.array(sorted(scaling.workers.unique()))
    ax.plot(ps, 2 * (ps - 1), "k--", lw=1, label="2k(P-1) (TopkA model)")
    ax.axhline(6, color="r", ls=":", lw=1, label="6k (Ok-Topk bound)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers P")
    ax.set_ylabel("elements sent per rank and step / k (max over ranks)")
    ax.legend(fontsize=7)
    ax.set_title("Worst step (solid) and cumulative mean (dashed) against P")
    ax = axes[1]
    ok_runs = runs[runs.scaling & (runs.method == "oktopk")] if not runs.empty else runs
    if "algo_step_volume_over_k_max" in wide and not ok_runs.empty:
        for r in ok_runs.sort_values("workers").itertuples():
            g = wide[wide.run_id == r.run_id].dropna(subset=["algo_step_volume_over_k_max"])
            ax.plot(g.step, g.algo_step_volume_over_k_max, ".-", label=f"P={r.workers}")
    ax.axhline(6, color="r", ls=":", lw=1, label="6k")
    ax.set_xlabel("step")
    ax.set_ylabel("largest step volume of any rank in the window / k")
    ax.legend(fontsize=7)
    ax.set_title("Ok-Topk: per-step volume, max over ranks")
    fig.tight_layout()
    show(rep, fig, "volume_vs_workers")

# %% [markdown]
# Elements sent per sparse step by phase (rank 0, mean over the logged windows of the sparse phase).

# %%
PHASES = [c for c in ["algo_sent_split", "algo_sent_repartition", "algo_sent_balance", "algo_sent_allgather",
                      "algo_sent_tree", "algo_sent_broadcast"] if c in wide]
if not runs.empty and PHASES:
    rows = []
    for r in runs[runs.method != "ssgd"].itertuples():
        row = {"name": r.name, "workers": r.workers, "k": getattr(r, "algo_k", np.nan)}
        for c in PHASES:
            row[c.replace("algo_sent_", "")] = phase_mean(rep, r.run_id, c)
        rows.append(row)
    phases = pd.DataFrame(rows).groupby(["name", "workers"]).mean().reset_index()
    display(phases.round(1))


# %% [markdown]
# ## Method and scale
#
# `oktopk` follows the release (Shigangli/Ok-Topk, LSTM/VGG allreducer; module docstring of
# `commlab.algorithms.oktopk`): residuals, a local threshold recomputed exactly every 32 steps and
# reused in between, regions re-balanced every 64 steps, split-and-reduce, a global threshold,
# allgatherv, residual kept wherever an entry was not both sent and kept. One departure, on by
# default: the **bounded threshold control** (`threshold_control: bounded`) sends exactly every
# rank's local top-k and caps the globally kept entries so that every rank's volume stays below 6k
# at every step, recomputing the global threshold (exact top-k every tau' steps, within k/16 of k
# otherwise) when the kept total leaves [3k/4, 5k/4] instead of nudging it by 1.01 / 1.008 (the
# release's control, `threshold_control: release`, lets the volume grow past 6k after the warm-up
# on heavy-tailed gradients). Baselines: `topk_allgather`
# (TopkA: allgather of every rank's exact top-k), `gaussiank` (threshold from a normal fit,
# allgatherv), `gtopk` (tree of pairwise top-k merges, broadcast) and dense `ssgd`. Volume is what
# the Communicator counted: elements sent per rank and step, indices and values both (the paper's
# unit), count exchanges included.
#
# **Scale.** The default (laptop) grid is trimmed to fit the whole pipeline on a 2-core machine:
# accuracy runs are Fashion-MNIST CNN on **4 workers only** (`laptop_full`: 4 and 8), density 2%,
# 12,288 training samples for 2 epochs (192 steps, the first 16 dense, cosine learning rate),
# 3 seeds; the volume-scaling runs (one seed: volume does not need a spread) are a tiny MLP on
# synthetic data, Ok-Topk for 100 steps at 2, 4, 8 and 16 workers (**not 32**: 32 processes need
# about 13 GB of memory and minutes to start on 2 cores; the test suite checks P = 32 on a
# synthetic stream), TopkA, whose volume is the same every step, for 12 steps at 4 and 8 workers
# (elsewhere its 2k(P-1) is the formula that the measured points and the tests confirm, marked as
# such). `laptop_full` holds the untrimmed grid (3 seeds, the whole training set, 4 and 8 workers,
# densities 1% and 2%, both methods at 2-32 workers) and `paper` the VGG-16/CIFAR-10 setting for
# GPU clusters. Short runs favour dense SGD: error feedback delays part of every gradient.
