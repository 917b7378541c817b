# Report: dense synchronous SGD through the Communicator against PyTorch DDP (baseline).
# Executed by `commlab report --paper baseline`; the prologue is commlab.report.notebook.

# %% tags=["parameters"]
paper = "baseline"
out_dir = "reports"
tracking_uri = None
scale = None


# %%
# ruff: noqa: E402 - a notebook imports after its parameters cell
import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display

from commlab.report.claims_baseline import METRICS, training_curves
from commlab.report.figures import curves
from commlab.report.notebook import nothing, open_report, show, show_claims
from commlab.report.tables import at_evaluations, mean_sd_table

rep = open_report(paper, out_dir, tracking_uri, scale, METRICS)
runs, history = rep.runs, rep.history
show_claims(rep)  # declared in commlab.report.claims_baseline
train = rep.table(training_curves)
evals = at_evaluations(history) if not history.empty else pd.DataFrame()


# %% [markdown]
# ## Curves: loss and test accuracy against samples and against bytes sent
#
# Lines are means over seeds, bands one standard deviation. Where ssgd and ddp agree to the last
# digit only one line is visible: ssgd is drawn over ddp. ddp_bf16, the strongest dense baseline
# (DDP with gradients in bfloat16 on the wire), sends half their bytes per step: its curves against
# bytes sit at half the x.


# %%
if train.empty:
    nothing("No finished runs yet: nothing to plot.")
else:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    curves(train, "samples", "train_loss", ax=axes[0][0], title="training loss")
    curves(train, "bytes_sent", "train_loss", ax=axes[0][1], title="training loss")
    curves(evals, "samples", "test_accuracy", ax=axes[1][0], title="test accuracy")
    curves(evals, "bytes_sent", "test_accuracy", ax=axes[1][1], title="test accuracy")
    fig.tight_layout()
    show(rep, fig, "curves")


# %% [markdown]
# ## Per-seed gap between the two methods
#
# The training loss of ssgd minus that of ddp at every logged step, one line per seed, beside
# the gap between two seeds of the same method: identical updates start at a gap of zero; float
# rounding (the sums run in another order) then lets the trajectories drift apart, which should
# stay within the seed-to-seed variation.


# %%
if train.empty or not {"ssgd", "ddp"} <= set(train["name"]):
    nothing("Needs finished ssgd and ddp runs.")
else:
    loss = train.pivot_table(index=["seed", "samples"], columns="name", values="train_loss")
    gaps = (loss["ssgd"] - loss["ddp"]).dropna().rename("gap").reset_index()
    gaps["pair"] = "ssgd - ddp, seed " + gaps["seed"].astype(str)
    by_seed = loss["ddp"].unstack("seed").dropna()
    if by_seed.shape[1] > 1:
        first, second = by_seed.columns[:2]
        reference = (by_seed[second] - by_seed[first]).rename("gap").reset_index()
        reference["pair"] = f"ddp seed {second} - ddp seed {first}"
        gaps = pd.concat([gaps, reference], ignore_index=True)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for pair, g in gaps.groupby("pair"):
        ax.plot(g["samples"], g["gap"], label=pair, linestyle="--" if pair.startswith("ddp") else "-")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("samples processed")
    ax.set_ylabel("training-loss difference")
    ax.legend()
    fig.tight_layout()
    show(rep, fig, "loss_gap")


# %% [markdown]
# ## Details: final numbers per run and over seeds


# %%
FINAL = ["test_accuracy", "test_loss", "train_loss", "bytes_sent", "wall_seconds"]
if runs.empty:
    nothing("No finished runs yet.")
else:
    final = runs[["name", "method", "seed", "workers"] + [c for c in FINAL if c in runs]].sort_values(["name", "seed"])
    display(final.reset_index(drop=True))

    display(mean_sd_table(final, "name", {c: c for c in FINAL}))
