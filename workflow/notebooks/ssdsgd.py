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
paper = "ssdsgd"
out_dir = "reports"
tracking_uri = None
scale = None


# %%
# ruff: noqa: E402 - a notebook imports after its parameters cell
import matplotlib.pyplot as plt
import seaborn as sns
from IPython.display import display

from commlab.report.claims_ssdsgd import METRICS, describe
from commlab.report.figures import curves
from commlab.report.notebook import nothing, open_report, show, show_claims
from commlab.report.tables import wide_history

rep = open_report(paper, out_dir, tracking_uri, scale, METRICS)
show_claims(rep)  # declared in commlab.report.claims_ssdsgd
runs, long = rep.table(describe), rep.history  # runs with the share of time blocked on communication


# %% [markdown]
# ## Figures
# Test accuracy against wall-clock time (the papers' x-axis for speed), against samples processed
# (same data, so the curves show per-sample efficiency), and the share of wall-clock time blocked
# on communication.


# %%
history = wide_history(long)
if history.empty or "test_accuracy" not in history:
    nothing("No history to plot.")
else:
    # Accuracy exists only at evaluations: keep those rows (wall-clock and samples forward-filled
    # from the last logged step), one line per seed on the wall-clock axis (seeds differ in time).
    evals = long[long["metric"] == "test_accuracy"][["run_id", "step"]]
    at_eval = history.merge(evals, on=["run_id", "step"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    sns.lineplot(data=at_eval, x="wall_seconds", y="test_accuracy", hue="name", units="seed",
                 estimator=None, marker="o", ax=axes[0])
    axes[0].set(xlabel="wall-clock time of the training loop (s)", ylabel="test accuracy (%)",
                title="accuracy vs wall-clock (loopback, one line per seed)")
    curves(at_eval, "samples", "test_accuracy", ax=axes[1], title="accuracy vs samples")
    curves(history, "samples", "train_loss", ax=axes[2], title="training loss (local replica)")
    for ax in axes[1:]:
        if ax.get_legend():
            ax.get_legend().remove()
    fig.tight_layout()
    show(rep, fig, "accuracy_vs_time")


# %%
if len(runs) and runs["blocked_share"].notna().any():
    fig, ax = plt.subplots(figsize=(7, 3.6))
    order = sorted(runs["name"].unique())
    sns.barplot(data=runs, x="name", y="blocked_share", order=order, errorbar="sd", ax=ax)
    ax.set_ylabel("share of wall-clock blocked on communication")
    ax.set_xlabel("")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    show(rep, fig, "blocked_share")
else:
    nothing("No runs: blocked-time share not plotted.")


# %% [markdown]
# ## Details: final accuracy, wall-clock time and time blocked on communication
# Blocked time is the time a step waits for communication: the whole of a synchronous allreduce
# (`comm_seconds`, which for asynchronous collectives holds only their launch) plus the waits on
# asynchronous ones (`blocked_seconds`).


# %%
if len(runs):
    spec = {"seeds": ("seed", "count"), "test_accuracy": ("test_accuracy", "mean"),
            "accuracy_sd": ("test_accuracy", "std"), "wall_seconds": ("wall_seconds", "mean"),
            "blocked_share": ("blocked_share", "mean")}
    for label, metric in (("staleness_mean", "algo_staleness_mean"),
                          ("refresh_distance", "algo_refresh_distance_mean"),
                          ("overlapped_seconds", "algo_overlapped_seconds")):
        if metric in runs:
            spec[label] = (metric, "mean")
    display(runs.groupby("name").agg(**spec).round(4))
else:
    nothing("No runs yet: run `commlab grid ssdsgd --run` (or the workflow) first.")


# %% [markdown]
# ## Method and scale
#
# Xu et al., *OD-SGD* (arXiv 2005.06728) and *SSD-SGD* (arXiv 2012.05396).
# Every rank keeps a **global replica**, updated every step by synchronous SGD on the
# allreduce-averaged gradients (the allreduce overlaps the next steps' compute), and a **local
# replica** that computes gradients and moves with the worker's own gradient through a local rule
# at 4x the global learning rate; every k steps (OD-SGD: k = 1) the local replica is overwritten
# by the global one. The first steps are synchronous (warm-up). Local rules: `sgd` (plain local
# SGD), `dcasgd` (DC-ASGD delay compensation), `glu` (global gradient for local update; our
# reconstruction: mix the own gradient with the latest averaged gradient).
#
# **What is trimmed at laptop scale** (the default pipeline has a 45-minute budget on 2 cores):
# 2 seeds instead of 3, 9,600 training samples, 2 epochs (150 steps at 4 workers x 32), warm-up
# scaled to the short run (10 steps for OD-SGD, 25 for SSD-SGD instead of 200/500), and five variants
# (SSGD, OD-SGD+GLU, SSD-SGD k=2+GLU, and k=5 with GLU and plain local SGD) instead of the full
# 3 x 3 grid. `--scale laptop_full` runs the full grid (3 seeds, all of Fashion-MNIST, every local
# rule for OD-SGD and SSD-SGD k = 2, 5, and SSD-SGD without warm-up).
#
# **Learning-rate schedule.** Laptop runs keep the project's constant learning rate. A cosine
# schedule over 187 steps (12,000 samples) was tried once (2 seeds): SSGD 82.6%, OD-SGD 80.1%, SSD-SGD
# k=2 80.2%, k=5 77.9% (GLU), i.e. the delayed methods, slower in the first steps after warm-up,
# are annealed before they catch up; with a constant rate OD-SGD ends level with SSGD. The papers'
# step schedules decay only after many epochs (80 of 160 on CIFAR-10).
#
# **Speed.** The training runs below are on loopback: 4 worker processes on a 2-core machine, where
# an allreduce of the 220k-parameter CNN costs little next to compute, and there is no idle core for
# the overlapped allreduce to run on (its CPU work competes with compute). The papers' speed-ups
# come from slow networks (parameter servers over 1-10 Gbit/s): the speed claims are judged on
# emulated 1 Gbit/s and 100 Mbit/s links, from the throughput benchmark (`snakemake bench`,
# reports/bench/throughput.json) when it has run; the loopback numbers are shown beside them.
