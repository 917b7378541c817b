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
paper = "adpsgd"
out_dir = "reports"
tracking_uri = None
scale = None


# %%
# ruff: noqa: E402 - a notebook imports after its parameters cell
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from IPython.display import display

from commlab.report.claims_adpsgd import METRICS, loopback_runs, lr_drops, summary_table, wide_table
from commlab.report.notebook import nothing, open_report, show, show_claims

# METRICS holds the rule's decisions at log points (algo_last_sync: the step each refers to) and,
# where the loop logged them, at their own steps (algo_sync_*).
rep = open_report(paper, out_dir, tracking_uri, scale, METRICS)
show_claims(rep)  # declared in commlab.report.claims_adpsgd
# Runs under emulated links answer the speed-up claim only; the figures show the runs on loopback.
runs, wide = rep.table(loopback_runs), rep.table(wide_table)
base_wide = wide[wide.run_id.isin(runs.run_id)]
summary = rep.table(summary_table) if not runs.empty else None


# %% [markdown]
# ## Training loss against synchronisations, bytes and time
# One line per run (seeds as separate lines, since the x-values differ between seeds). The
# wall-clock panel shows what this machine measured: on a shared 2-core machine the workers are
# CPU-bound and other load dominates the time, so only runs under emulated links (a `network`
# setting) speak to the paper's speed-up claim.


# %%
if base_wide.empty:
    nothing("No runs to plot.")
else:
    data = base_wide.dropna(subset=["train_loss"]).assign(MB_sent=lambda d: d.bytes_sent / 1e6)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for ax, x, label in zip(axes, ["reductions_global", "MB_sent", "wall_seconds"],
                            ["synchronisations (global reductions)", "data sent per rank (MB)",
                             "wall-clock time on loopback (s)"], strict=True):
        part = data if x == "wall_seconds" else data[data[x] > 0]
        sns.lineplot(data=part, x=x, y="train_loss", hue="name", units="seed", estimator=None,
                     ax=ax, linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("training loss")
        if x != "wall_seconds":
            ax.set_xscale("log")
        if ax is not axes[-1] and ax.get_legend():
            ax.get_legend().remove()
    fig.tight_layout()
    show(rep, fig, "loss_vs_communication")


# %% [markdown]
# ## The rule's decisions: period against V
# Each ADPSGD synchronisation, per seed: the period the rule chose and the period in force after
# the budget line, crosses where the budget deferred the rule's synchronisation (left); the
# variance V it measured, the rule's target and, crosses, the target a deferral raised to what
# the budget affords (right, log scale; CPSGD's V at its fixed period in grey). Where a run
# logged its decisions at their own steps (`algo_sync_*`) those are drawn; otherwise each log
# point's last decision at the step of its synchronisation (`algo_last_sync`: of two
# synchronisations within one log window, the later), without the budget's deferrals. Decisions
# without a target are the calibration's. Dotted lines mark learning-rate decays, at the first
# step whose learning rate dropped.


# %%
DECIDED = {"variance": "V", "target": "target", "rule_period": "chosen by the rule", "period": "in force",
           "deferred": "deferred", "budget_target": "budget's target"}


def sync_decisions(history: pd.DataFrame) -> pd.DataFrame:
    """One row per ADPSGD decision (run, seed, step, V, target, periods) and per CPSGD log point."""
    keys, frames = ["run_id", "name", "method", "seed", "step"], []
    for _, g in history[history.method.isin(["cpsgd", "adpsgd"])].groupby("run_id"):
        own = g[g.metric.str.startswith("algo_sync_")]
        if not own.empty:  # logged at the synchronisation's own step
            wide = own.pivot_table(index=keys, columns="metric", values="value").reset_index()
            wide.columns = [c.removeprefix("algo_sync_") for c in wide.columns]
        else:
            logged = g[g.metric.isin([f"algo_{k}" for k in DECIDED] + ["algo_last_sync"])]
            if logged.empty:
                continue
            wide = logged.pivot_table(index=keys, columns="metric", values="value").reset_index()
            wide.columns = [c.removeprefix("algo_") for c in wide.columns]
            if "last_sync" in wide:  # ADPSGD: at the step of the decision
                wide = (wide.dropna(subset=["last_sync"]).assign(step=lambda d: d.last_sync.astype(int))
                        .drop_duplicates("step", keep="last"))
        frames.append(wide)
    return pd.concat(frames, ignore_index=True).rename(columns=DECIDED) if frames else pd.DataFrame()


decided = sync_decisions(rep.history[rep.history.run_id.isin(runs.run_id)]) if not runs.empty else pd.DataFrame()
if decided.empty or "adpsgd" not in set(decided.method):
    nothing("No adpsgd runs with logged decisions to plot.")
else:
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.4))
    for k, (_, g) in enumerate(decided[decided.method == "cpsgd"].groupby("run_id")):
        axes[1].plot(g.step, g.V, color="0.75", linewidth=0.8, label="cpsgd V" if k == 0 else None)
    colours = sns.color_palette(n_colors=max(3, decided[decided.method == "adpsgd"].run_id.nunique()))
    for colour, ((name, seed), g) in zip(colours, decided[decided.method == "adpsgd"].groupby(["name", "seed"]),
                                         strict=False):
        g = g.sort_values("step")
        label = f"{name} seed {seed}"
        # NaN targets (calibrating) break the dashed line instead of bridging the calibration.
        axes[0].step(g.step, g["chosen by the rule"], where="post", color=colour, label=f"{label}: chosen by the rule")
        axes[0].step(g.step, g["in force"], where="post", color=colour, linestyle="--", label=f"{label}: in force")
        if "deferred" in g:  # logged apart from the rule's decisions
            held = g[g.deferred > 0]
            axes[0].scatter(held.step, held["in force"], color=colour, marker="x", label=f"{label}: deferred")
        if "budget's target" in g:
            axes[1].scatter(g.step, g["budget's target"], color=colour, marker="x", label=f"{label}: budget's target")
        axes[1].plot(g.step, g.V, color=colour, marker="o", markersize=4, linewidth=1, label=f"{label}: V")
        if "target" in g:
            axes[1].step(g.step, g.target, where="post", color=colour, linestyle="--", linewidth=1,
                         label=f"{label}: target")
    axes[0].set_ylabel("period (steps)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("V = mean_i ||x_i - x̄||²")
    decays = sorted({step for run_id in decided.run_id.unique() for step in lr_drops(rep.history, run_id)})
    for ax in axes:
        ax.set_xlabel("training step")
        ax.legend(fontsize=7)
        for step in decays:
            ax.axvline(step, color="grey", linestyle=":")
    fig.tight_layout()
    show(rep, fig, "period_and_variance")


# %% [markdown]
# ## Test accuracy and communication per method


# %%
if runs.empty:
    nothing("No runs.")
else:
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    order = summary.index.tolist()
    sns.barplot(data=runs, x="name", y="test_accuracy", order=order, errorbar="sd", ax=axes[0])
    lo = runs.test_accuracy.min()
    axes[0].set_ylim(max(0, lo - 3), min(100, runs.test_accuracy.max() + 1))
    axes[0].set_ylabel("final test accuracy (%)")
    sns.barplot(data=runs.assign(MB=runs.bytes_sent / 1e6), x="name", y="MB", order=order,
                errorbar="sd", ax=axes[1])
    axes[1].set_yscale("log")
    axes[1].set_ylabel("MB sent per rank")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    show(rep, fig, "accuracy_and_bytes")


# %% [markdown]
# ## Details: measured quantities per run variant
# *Final training loss* is the mean of the logged training losses (each itself the mean over the
# logging window and all workers) over the last 10% of the steps, to damp mini-batch noise.
# *Communication* is what the Communicator recorded: bytes sent per rank and global reductions
# (one per synchronisation; ADPSGD's and CPSGD's variance scalar rides in the same reduction).


# %%
if runs.empty:
    nothing("No finished runs yet.")
else:
    display(summary.round(4))


# %% [markdown]
# ## Method and scale
#
# Periodic parameter averaging with a constant period (`cpsgd`) against the adaptive period of
# `adpsgd`, full-communication SGD (`ssgd`) and quantised SGD (`qsgd`, stochastic rounding with
# a bucket norm; `fp16` at the full scale). No code was released: the period rule is our
# reconstruction of the paper's principle (module docstring of `commlab.algorithms.adpsgd`, which
# lists what is ours). At each synchronisation ADPSGD measures V = mean_i ||x_i - x̄||² and the
# rate at which it grew over the interval; the next period is the longest at which V is predicted
# to stay under a target. The target comes from a short calibration at half the budget's period
# (two synchronisations after the momentum's warm-up), moves with lr², and is calibrated again
# after each learning-rate decay, where the period resets. The run never exceeds the number of
# synchronisations of the CPSGD run it is compared with (`budget_period`): a budget line lets it
# spend at most a quarter of that budget ahead of the uniform pace, and when the line holds a
# synchronisation back the target rises to the variance this budget affords, from which the rule
# lengthens the period as V falls.
#
# **Scale.** The default (laptop) grid is trimmed to fit the whole pipeline on a 2-core machine:
# Fashion-MNIST CNN, 4 gloo workers, 8,192 training samples, 3 epochs with a ×0.1 decay after
# epoch 2, 3 seeds, one CPSGD period (**16**, and ADPSGD with that budget), 8-bit QSGD and rank-2
# PowerSGD only, no fp16. The scale `laptop_full` holds the untrimmed grid (3 seeds, the whole training
# set, periods 2-32, 4- and 8-bit QSGD, fp16) and `paper` the CIFAR-10 ResNet-20 setting for
# GPU clusters. At this size differences between methods are small next to the seed spread:
# the claims table gives both.
