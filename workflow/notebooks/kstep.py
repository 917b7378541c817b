# Report: K-step averaging, local reductions and reduction momentum (Cong, Yang, Zhou, ICPP'19 workshops).
# Executed by `commlab report --paper kstep`; the prologue is commlab.report.notebook.

# %% tags=["parameters"]
paper = "kstep"
out_dir = "reports"
tracking_uri = None
scale = None


# %%
# ruff: noqa: E402 - a notebook imports after its parameters cell
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from IPython.display import display

from commlab.report.claims_kstep import METRICS, describe, evaluations
from commlab.report.descendants import descendants_table
from commlab.report.figures import AXIS_LABELS, curves
from commlab.report.notebook import nothing, open_report, show, show_claims
from commlab.report.tables import wide_history

rep = open_report(paper, out_dir, tracking_uri, scale, METRICS)
runs, history = rep.runs, rep.history
show_claims(rep)  # declared in commlab.report.claims_kstep
info, evals = rep.table(describe), rep.table(evaluations)
train = wide_history(history).dropna(subset=["train_loss"]) if not history.empty else pd.DataFrame()


# %% [markdown]
# ## Test accuracy against global reductions and against samples
# Mean over seeds (band: one s.d.); global reductions on a symmetric-log axis (K = 256 reduces
# once or not at all before some evaluations).


# %%
def panel(frame: pd.DataFrame, x: str, ax, title: str) -> None:
    """Test accuracy against ``x``, one line per run name: at each evaluation the mean over seeds
    of x and accuracy, bars one s.d. of accuracy (several evaluations may share one x value: a
    K = 256 run evaluates twice before its first global reduction)."""
    for name, g in frame.groupby("name"):
        m = g.groupby("step").agg(x=(x, "mean"), acc=("test_accuracy", "mean"), sd=("test_accuracy", "std"))
        ax.errorbar(m.x, m.acc, yerr=m.sd.fillna(0), marker="o", markersize=4, capsize=3, label=name)
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS["test_accuracy"])
    ax.set_title(title, fontsize=10)
    if x == "reductions_global":
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(0, max(2.0, 1.5 * float(frame[x].max())) if len(frame) else 2.0)
    if len(frame):
        ax.legend(fontsize=8)


if evals.empty:
    nothing("No finished runs yet: nothing to plot.")
else:
    groups = [
        ("momentum SGD: synchronous vs K-step",
         (evals.optimizer == "sgd") & evals.family.isin(["synchronous", "K-step"])),
        ("Adam: synchronous vs K-step (momentum-SGD synchronous for reference)",
         (evals.optimizer == "adam") | ((evals.optimizer == "sgd") & (evals.family == "synchronous"))),
        ("K-step vs local+global (+ momentum) at the same K_g",
         (evals.family.str.startswith("local+global")) | ((evals.family == "K-step")
          & evals.k_global.isin(evals.loc[evals.family.str.startswith("local+global"), "k_global"].unique()))),
    ]
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 4.2 * len(groups)), squeeze=False)
    for i, (title, mask) in enumerate(groups):
        panel(evals[mask], "reductions_global", axes[i][0], title)
        panel(evals[mask], "samples", axes[i][1], title)
    fig.tight_layout()
    show(rep, fig, "accuracy_vs_reductions")


# %% [markdown]
# ## Final test accuracy against K, and training loss against samples


# %%
if runs.empty:
    nothing("No finished runs yet: nothing to plot.")
else:
    sweep = info[info.family.isin(["synchronous", "K-step"])]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for opt, g in sweep.groupby("optimizer"):
        m = g.groupby("k_global")["test_accuracy"].agg(["mean", "std"]).reset_index()
        axes[0].errorbar(m.k_global, m["mean"], yerr=m["std"].fillna(0), marker="o", capsize=3, label=opt)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("K: steps per global reduction (1 = synchronous SGD)")
    axes[0].set_ylabel("final test accuracy (%)")
    axes[0].legend(title="local optimizer")
    if not train.empty:
        smooth = train.sort_values(["run_id", "step"]).copy()
        smooth["train_loss"] = smooth.groupby("run_id")["train_loss"].transform(lambda v: v.rolling(8, 1).mean())
        curves(smooth, "samples", "train_loss", ax=axes[1], title="training loss (running mean of 8 points)")
    fig.tight_layout()
    show(rep, fig, "accuracy_vs_k")


# %% [markdown]
# ## Today's descendants: reduction momentum, DiLoCo and Streaming DiLoCo
# Researchers now compare periodic averaging with an outer optimizer on the pseudo-gradient
# (mean over workers of anchor - replica): DiLoCo (Douillard et al., arXiv 2311.08105) and
# Streaming DiLoCo (arXiv 2501.18512), which syncs one fragment of the model at a time, overlaps
# the allreduce with the next steps and sends it in bf16. Here each runs at K-step's global period
# (H = K = 64) with K-step's inner momentum-SGD steps, so that the count of global reductions
# compares; they differ in what a reduction does. They coincide (docs/diloco.md; tested in
# tests/test_diloco.py and tests/test_streaming_diloco.py):
#
# | this | equals | when |
# |---|---|---|
# | DiLoCo, outer SGD | K-step (`momentum` 0) | outer lr 1, outer momentum 0 |
# | DiLoCo, outer heavy ball (SGD with momentum mu) | K-step's block momentum mu | `block_lr` = the outer lr |
# | DiLoCo, outer Nesterov | K-step's Nesterov block momentum | the first outer step only |
# | Streaming DiLoCo | DiLoCo, bit for bit | one fragment, tau = 0, alpha = 0, fp32 |
#
# The table gives each run's accuracy, global reductions (one per fragment for Streaming DiLoCo;
# `model_syncs` counts whole models), bytes sent per rank, largest allreduce, and the time its
# reductions block on the throughput benchmark's slowest emulated link: the benchmark's time per
# reduction (`comm_s` over reductions per step, at a period of 8 so that its 16 steps hold
# reductions, on its own 4 workers) times the run's reductions. Not measured where the benchmark
# did not run.


# %%
section = rep.table(descendants_table)
if section.empty:
    nothing("No K-step, DiLoCo or Streaming DiLoCo runs at this scale.")
else:
    display(section.drop(columns=["method", "outer", "largest_allreduce"]).round(4))
    display(section[["method", "outer"]].rename(columns={"outer": "what a reduction does"}))
    names = set(section.index) | set(info[(info.family == "synchronous") & (info.optimizer == "sgd")].name)
    mine = evals[evals.name.isin(names)] if not evals.empty else evals
    if not mine.empty:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4))
        panel(mine, "reductions_global", axes[0], "test accuracy against global reductions")
        panel(mine, "samples", axes[1], "test accuracy against samples")
        fig.tight_layout()
        show(rep, fig, "descendants")


# %% [markdown]
# ## Details: final numbers per run
# Global and local reductions as counted by the Communicator; samples per global reduction =
# samples processed by all workers / global reductions.


# %%
FINAL = ["test_accuracy", "reductions_global", "reductions_local", "samples", "bytes_sent", "wall_seconds"]
if runs.empty:
    nothing("No finished runs yet.")
else:
    final = info[["name", "family", "optimizer", "k_global", "k_local", "block_momentum", "seed"]
                 + [c for c in FINAL if c in info]].copy()
    final["samples_per_global_reduction"] = final["samples"] / final["reductions_global"].replace(0, np.nan)
    final = final.sort_values(["optimizer", "family", "k_global", "name", "seed"]).reset_index(drop=True)
    display(final)


# %% [markdown]
# ## Method and scale
#
# Workers take local optimizer steps and reduce *models* on a schedule (Cong et al., ICPP 2019 Workshops):
# `kstep` averages over the world every K steps (a **global reduction**); `kstep_hier` averages
# inside groups every K_l steps (a **local reduction**) and over the world every K_g steps,
# optionally with **reduction momentum** (block momentum on the global update). Synchronous SGD
# (`ssgd`) is the reference: one global reduction per step. Every count below is measured by the
# Communicator (`with comm.reduction():`), not derived from the schedule.
#
# **What the default (laptop) grid trims.** The paper ran CIFAR-10 on 6 GPUs. We keep the 6
# workers but, to fit the pipeline's time budget, train the small CNN on a subset of
# Fashion-MNIST for a few epochs, with fewer values of K, and evaluate at epoch ends: the table at
# the top says what ran (seeds, samples per run), `config/papers/kstep.yaml` the grid. A claim
# that such runs cannot show (a saving that would leave fewer than 10 global reductions, Adam
# behind momentum SGD where it is not) is "not testable at this scale" and its note names the
# scale that would test it: `laptop_full` is the whole laptop grid, `paper` and the other
# `paper_*` scales the paper's settings for a GPU cluster.
#
# **What is evaluated.** Each epoch-end accuracy is that of rank 0's replica, the model that
# exists at that step (`evaluate: rank0`); every K-step and hierarchical run ends with one global
# reduction after its last step (`final_reduction: true`, counted), so its final accuracy is that
# of the single averaged model. Between reductions a replica has seen only its own data since the
# last average, so intermediate K-step accuracies are conservative.
