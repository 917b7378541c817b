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
import numpy as np
import pandas as pd
from IPython.display import display

from commlab.core.communicator import ring_allreduce_cost
from commlab.report.claims import Claim, check, mean_sd
from commlab.report.figures import curves
from commlab.report.notebook import (
    at_evaluations,
    bytes_per_step,
    mean_sd_table,
    model_parameters,
    nothing,
    open_report,
    show,
    show_claims,
    test_images,
    wide_history,
)

METRICS = ["train_loss", "test_loss", "test_accuracy", "samples", "bytes_sent", "wall_seconds"]
LOSS_TOLERANCE = 0.02  # mean |loss gap| accepted between two runs of one algorithm (float order)
BYTES_TOLERANCE = 0.01  # relative distance from the ring-allreduce volume

rep = open_report(paper, out_dir, tracking_uri, scale, METRICS)
runs, history = rep.runs, rep.history


# %%
def at_logged_steps(history: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, logged training step) with one column per metric."""
    wide = wide_history(history[~history.metric.isin(["test_accuracy", "test_loss"])], fill=False)
    return wide.dropna(subset=["train_loss"]) if "train_loss" in wide else pd.DataFrame()


train = at_logged_steps(history) if not history.empty else pd.DataFrame()
evals = at_evaluations(history) if not history.empty else pd.DataFrame()


# %%
def loss_gaps(train: pd.DataFrame) -> tuple[float, float, float, list[int]]:
    """Mean |ssgd - ddp| training loss over the logged steps of each common seed (the largest),
    the seed-to-seed spread of either method (mean |seed a - seed b| at equal steps), the gap at
    the first logged step, and the seeds compared."""
    loss = train.pivot_table(index=["seed", "step"], columns="name", values="train_loss")
    if not {"ssgd", "ddp"} <= set(loss.columns):
        return float("nan"), float("nan"), float("nan"), []
    both = loss[["ssgd", "ddp"]].dropna()
    seeds = sorted(both.index.get_level_values("seed").unique())
    gap = max(float((g["ssgd"] - g["ddp"]).abs().mean()) for _, g in both.groupby(level="seed"))
    first = max(float(abs(g["ssgd"].iloc[0] - g["ddp"].iloc[0])) for _, g in both.groupby(level="seed"))
    spreads = []
    for name in ("ssgd", "ddp"):
        per_seed = loss[name].unstack("seed").dropna()
        if per_seed.shape[1] > 1:
            spreads.append(float(per_seed.max(axis=1).sub(per_seed.min(axis=1)).mean()))
    spread = max(spreads) if spreads else float("nan")
    return gap, spread, first, seeds


def pooled_sd(*groups: pd.Series) -> float:
    """Pooled within-group standard deviation (0 when no group has two values)."""
    squares = sum(float(((g - g.mean()) ** 2).sum()) for g in groups)
    dof = sum(len(g) - 1 for g in groups)
    return float(np.sqrt(squares / dof)) if dof > 0 else 0.0


def ring_bytes(runs: pd.DataFrame) -> float:
    """One ring allreduce of every fp32 gradient on P workers, bytes sent by rank 0."""
    run = runs.iloc[0]
    return ring_allreduce_cost(model_parameters(run), int(run["workers"]), 0)[0] * 4.0


# %%
NOT_MEASURED = "needs finished ssgd and ddp runs"
claims = []
ssgd_acc = runs.loc[runs.name == "ssgd", "test_accuracy"] if len(runs) else pd.Series(dtype=float)
ddp_acc = runs.loc[runs.name == "ddp", "test_accuracy"] if len(runs) else pd.Series(dtype=float)

# 1. Same training curves on the same seeds.
gap, spread, first, seeds = loss_gaps(train) if not train.empty else (float("nan"),) * 3 + ([],)
if seeds:
    allowed = max(LOSS_TOLERANCE, spread) if np.isfinite(spread) else LOSS_TOLERANCE
    verdict = "reproduced" if gap <= allowed else ("partly reproduced" if gap <= 2 * allowed else "not reproduced")
    spread_text = f"{spread:.4f}" if np.isfinite(spread) else "n/a (one seed)"
    ours = (f"mean |loss gap| {gap:.4f} over the logged steps (first step {first:.1e}); seed-to-seed spread "
            f"{spread_text}; seeds {seeds}")
    note = f"verdict: gap <= max({LOSS_TOLERANCE}, seed spread) = {allowed:.4f}"
else:
    verdict, ours, note = "not measured", "no runs", NOT_MEASURED
claims.append(Claim("ssgd through the Communicator follows DDP's training-loss curve on the same seeds",
                    "DDP (Li et al., VLDB'20): gradient averaging by allreduce, same updates as local SGD",
                    ours, verdict, note))

# 2. Same final test accuracy: the difference of the means against what the runs can resolve,
# i.e. twice the larger of its standard error over seeds (pooled s.d.) and its standard error from
# the finite test set (binomial; two seeds give a poor s.d., so the test set sets a floor).
if len(ssgd_acc) and len(ddp_acc):
    diff = float(ssgd_acc.mean() - ddp_acc.mean())
    per_pair = 1 / len(ssgd_acc) + 1 / len(ddp_acc)
    se_seed = pooled_sd(ssgd_acc, ddp_acc) * np.sqrt(per_pair)
    n_test = test_images(runs.iloc[0])
    p = float(pd.concat([ssgd_acc, ddp_acc]).mean()) / 100
    se_test = 100 * np.sqrt(p * (1 - p) / n_test * per_pair) if n_test else 0.0
    allowed = 2 * max(se_seed, se_test)
    verdict = "reproduced" if abs(diff) <= allowed else ("partly reproduced" if abs(diff) <= 2 * allowed
                                                        else "not reproduced")
    ours = f"ssgd {mean_sd(ssgd_acc)} %, ddp {mean_sd(ddp_acc)} %; difference {diff:+.2f} pp"
    note = (f"verdict: |difference| <= 2 x max(s.e. over seeds {se_seed:.2f}, s.e. of {n_test} test images "
            f"{se_test:.2f}) = {allowed:.2f} pp")
else:
    verdict, ours, note = "not measured", "no runs", NOT_MEASURED
claims.append(Claim("ssgd and DDP reach the same final test accuracy", "DDP (Li et al., VLDB'20)",
                    ours, verdict, note))

# 3. Same communication volume: one ring allreduce of the gradient per step. Both byte counts come
# from the same formula in the Communicator: a consistency check of the accounting, not a result.
if len(ssgd_acc) and len(ddp_acc):
    expected = ring_bytes(runs)
    measured = {name: float(np.mean([bytes_per_step(history, r) for r in runs[runs.name == name].run_id]))
                for name in ("ssgd", "ddp")}
    worst = max(abs(v / expected - 1.0) for v in measured.values())
    holds = worst <= BYTES_TOLERANCE
    ours = (f"bytes sent per step by rank 0: ssgd {measured['ssgd']:,.0f}, ddp {measured['ddp']:,.0f}; "
            f"one ring allreduce of the gradient: {expected:,.0f}")
    note = (f"largest relative distance {worst:.2%} (tolerance {BYTES_TOLERANCE:.0%}); ssgd counts its buckets' "
            "collectives, ddp records the allreduce DDP runs inside backward")
else:
    holds, ours, note = None, "no runs", NOT_MEASURED
claims.append(check("Both send one ring allreduce of the full gradient per step: 2(P-1)/P x 4 B x parameters",
                    "ring allreduce cost (Patarasuk & Yuan 2009); DDP's bucketed allreduce", ours, holds, note))

show_claims(rep, claims)


# %% [markdown]
# ## Curves: loss and test accuracy against samples and against bytes sent
#
# Lines are means over seeds, bands one standard deviation. Where the two methods agree to the
# last digit only one line is visible: ssgd is drawn over ddp.


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
