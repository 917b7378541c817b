"""The baseline's claims: ssgd through the Communicator does what PyTorch DDP does (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB'20, sections 3-4: gradient
averaging by a bucketed allreduce, the same updates as local SGD on the global batch).

Measured on the runs ``ssgd`` and ``ddp`` of config/papers/baseline.yaml (same seeds): their
training-loss curves, final test accuracies (paired by seed) and bytes sent per step, the last
against one ring allreduce of the gradient (Patarasuk & Yuan 2009).

Beside them ``ddp_bf16``, the strongest dense baseline (Agarwal et al., "On the utility of gradient
compression in distributed training systems", MLSys'22: a 16-bit, overlapped DDP is what gradient
compression has to beat): its accuracy against ssgd's, paired by seed and judged at convergence
(:func:`commlab.report.tables.parity`), and its bytes per step, half of ssgd's by construction (2
bytes per element on the wire instead of 4).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from commlab.report.claims import Declared, Evidence, NotMeasured, Source, mean_sd
from commlab.report.metrics import ACCURACY
from commlab.report.paired import difference
from commlab.report.rules import AccuracyMatch, Consistency, Within
from commlab.report.tables import by_seed, bytes_per_step, parity, wide_history

METRICS = ["train_loss", "test_loss", "test_accuracy", "samples", "bytes_sent", "wall_seconds"]
LOSS_TOLERANCE = 0.02  # mean |loss gap| accepted between two runs of one algorithm (float order)
BYTES_TOLERANCE = 0.01  # relative distance from the ring-allreduce volume
NEEDS = "needs finished ssgd and ddp runs"
STRONGEST = "ddp_bf16"  # the strongest dense baseline: DDP with its bf16 compression hook
AGARWAL = "Agarwal et al., MLSys'22: a 16-bit, overlapped DDP is the baseline to beat"


def training_curves(ev: Evidence) -> pd.DataFrame:
    """One row per (run, logged training step) with one column per metric (the figures' too)."""
    if ev.history.empty:
        return pd.DataFrame()
    wide = wide_history(ev.history[~ev.history.metric.isin(["test_accuracy", "test_loss"])], fill=False)
    return wide.dropna(subset=["train_loss"]) if "train_loss" in wide else pd.DataFrame()


def _accuracies(ev: Evidence) -> tuple[pd.Series, pd.Series]:
    """ssgd's and ddp's final test accuracies, indexed by seed."""
    runs = ev.runs
    if not len(runs):
        return pd.Series(dtype=float), pd.Series(dtype=float)
    return by_seed(runs[runs.name == "ssgd"], "test_accuracy"), by_seed(runs[runs.name == "ddp"], "test_accuracy")


def loss_gap(ev: Evidence) -> dict | None:
    """Mean |ssgd - ddp| training loss over the logged steps of each common seed (the largest),
    the seed-to-seed spread of either method (mean |seed a - seed b| at equal steps), the gap at
    the first logged step, and the seeds compared."""
    train = ev.table(training_curves)
    if train.empty:
        return None
    loss = train.pivot_table(index=["seed", "step"], columns="name", values="train_loss")
    if not {"ssgd", "ddp"} <= set(loss.columns):
        return None
    both = loss[["ssgd", "ddp"]].dropna()
    seeds = sorted(both.index.get_level_values("seed").unique())
    if not seeds:
        return None
    gap = max(float((g["ssgd"] - g["ddp"]).abs().mean()) for _, g in both.groupby(level="seed"))
    first = max(float(abs(g["ssgd"].iloc[0] - g["ddp"].iloc[0])) for _, g in both.groupby(level="seed"))
    spreads = []
    for name in ("ssgd", "ddp"):
        per_seed = loss[name].unstack("seed").dropna()
        if per_seed.shape[1] > 1:
            spreads.append(float(per_seed.max(axis=1).sub(per_seed.min(axis=1)).mean()))
    spread = max(spreads) if spreads else float("nan")
    allowed = max(LOSS_TOLERANCE, spread) if np.isfinite(spread) else LOSS_TOLERANCE
    return {"gap": gap, "first": first, "seeds_compared": [int(s) for s in seeds], "allowed": allowed,
            "spread_text": f"{spread:.4f}" if np.isfinite(spread) else "n/a (one seed)",
            "tolerance": LOSS_TOLERANCE}


def test_images(run) -> int | None:
    """How many test images a run evaluated on, from its params: ``test_images`` where the run
    logged it, else its ``train.test_subset`` (None: the whole test set, whose size the run did
    not log)."""
    for key in ("param.test_images", "param.train.test_subset"):
        value = str(run.get(key, "None"))
        if value.isdigit():
            return int(value)
    return None


def accuracy_difference(ev: Evidence) -> dict | None:
    """The difference of the final accuracies, paired by seed (:mod:`commlab.report.paired`),
    against what the runs can resolve: twice the larger of its standard error over seeds and its
    standard error from the finite test set (binomial; a few seeds give a poor s.d., so the test
    set sets a floor)."""
    ssgd, ddp = _accuracies(ev)
    diff = difference(ssgd, ddp)
    if diff is None:
        return None
    se_seed = diff.se if diff.n >= 2 else 0.0
    n_test = test_images(ev.runs.iloc[0])
    p = float(pd.concat([ssgd, ddp]).mean()) / 100
    se_test = 100 * np.sqrt(p * (1 - p) / n_test * 2 / diff.n) if n_test else 0.0
    return {"ssgd": mean_sd(ssgd), "ddp": mean_sd(ddp), "diff": diff.mean, "abs_diff": abs(diff.mean),
            "se_seed": se_seed, "n_test": n_test, "se_test": se_test, "allowed": 2 * max(se_seed, se_test),
            "paired": diff.describe("pp")}


def ring_allreduce_bytes(parameters: int, workers: int) -> float:
    """Bytes rank 0 sends in one ring allreduce of ``parameters`` fp32 values on ``workers`` ranks:
    the tensor in ``workers`` chunks (the first ``parameters % workers`` one element longer), every
    chunk but its own sent once in the reduce-scatter and once in the allgather, less the one it
    receives last in each (Patarasuk & Yuan 2009)."""
    if workers == 1:
        return 0.0
    chunk = [parameters // workers + (1 if j < parameters % workers else 0) for j in range(workers)]
    return 4.0 * (2 * parameters - chunk[1 % workers] - chunk[2 % workers])


def bytes_against_ring(ev: Evidence) -> dict | NotMeasured | None:
    """Bytes sent per step by rank 0 for ssgd and ddp beside one ring allreduce of the gradient
    (the model's size from the ``model_parameters`` every run logs)."""
    ssgd, ddp = _accuracies(ev)
    if not len(ssgd) or not len(ddp):
        return None
    run = ev.runs.iloc[0]
    if pd.isna(run.get("param.model_parameters")):
        return NotMeasured("not measured: the runs logged no model_parameters", NEEDS)
    expected = ring_allreduce_bytes(int(float(run["param.model_parameters"])), int(run["workers"]))
    measured = {name: float(np.mean([bytes_per_step(ev.history, r) for r in ev.runs[ev.runs.name == name].run_id]))
                for name in ("ssgd", "ddp")}
    if any(np.isnan(v) for v in measured.values()):
        return NotMeasured("not measured: no bytes_sent history of two logged steps", NEEDS)
    worst = max(abs(v / expected - 1.0) for v in measured.values())
    return {"ssgd": measured["ssgd"], "ddp": measured["ddp"], "expected": expected, "worst": worst,
            "holds": worst <= BYTES_TOLERANCE, "tolerance": BYTES_TOLERANCE}


def mean_bytes_per_step(ev: Evidence, name: str) -> float:
    """Bytes rank 0 sent per step, mean over the seeds of run ``name`` (NaN without a history)."""
    ids = ev.runs[ev.runs.name == name].run_id if len(ev.runs) else []
    values = [bytes_per_step(ev.history, r) for r in ids]
    return float(np.mean(values)) if values else float("nan")


def strongest_accuracy(ev: Evidence) -> dict | None:
    """ddp_bf16's final test accuracy beside ssgd's, paired by seed, with both over their
    evaluations (judged at convergence)."""
    runs = ev.runs
    mine = runs[runs.name == STRONGEST] if len(runs) else runs
    dense = runs[runs.name == "ssgd"] if len(runs) else runs
    if not len(mine) or not len(dense) or "test_accuracy" not in runs:
        return None
    return parity(ev.history, mine, dense, ACCURACY)


def strongest_bytes(ev: Evidence) -> dict | NotMeasured | None:
    """ddp_bf16's bytes per step over ssgd's: half, within ``BYTES_TOLERANCE``, by construction."""
    names = set(ev.runs.name) if len(ev.runs) else set()
    if not {STRONGEST, "ssgd"} <= names:
        return None
    ours, dense = mean_bytes_per_step(ev, STRONGEST), mean_bytes_per_step(ev, "ssgd")
    if not np.isfinite(ours) or not np.isfinite(dense):
        return NotMeasured("not measured: no bytes_sent history of two logged steps",
                           "needs finished ssgd and ddp_bf16 runs")
    ratio = ours / dense
    return {"ours": ours, "dense": dense, "ratio": ratio, "holds": abs(ratio / 0.5 - 1) <= BYTES_TOLERANCE,
            "tolerance": BYTES_TOLERANCE}


CLAIMS = [
    Declared(
        claim="ssgd through the Communicator follows DDP's training-loss curve on the same seeds",
        paper="DDP (Li et al., VLDB'20): gradient averaging by allreduce, same updates as local SGD",
        sources=(Source(loss_gap, Within("gap", bound="allowed", partly=2),
                        ours="mean |loss gap| {gap:.4f} over the logged steps (first step {first:.1e}); seed-to-seed "
                             "spread {spread_text}; seeds {seeds_compared}",
                        note="verdict: gap <= max({tolerance}, seed spread) = {allowed:.4f}"),),
        needs=NEEDS),
    Declared(
        claim="ssgd and DDP reach the same final test accuracy",
        paper="DDP (Li et al., VLDB'20)",
        sources=(Source(accuracy_difference, Within("abs_diff", bound="allowed", partly=2),
                        ours="ssgd {ssgd} %, ddp {ddp} %; difference {paired}",
                        note="verdict: |difference| <= 2 x max(s.e. over seeds {se_seed:.2f}, s.e. of {n_test} test "
                             "images {se_test:.2f}) = {allowed:.2f} pp"),),
        needs=NEEDS),
    Declared(
        claim="Both send one ring allreduce of the full gradient per step: 2(P-1)/P x 4 B x parameters",
        paper="ring allreduce cost (Patarasuk & Yuan 2009); DDP's bucketed allreduce",
        sources=(Source(bytes_against_ring, Consistency("holds"),
                        ours="bytes sent per step by rank 0: ssgd {ssgd:,.0f}, ddp {ddp:,.0f}; one ring allreduce of "
                             "the gradient: {expected:,.0f}",
                        note="largest relative distance {worst:.2%} (tolerance {tolerance:.0%}); ssgd counts its "
                             "buckets' collectives, ddp records the allreduce DDP runs inside backward"),),
        needs=NEEDS, check=True),
    Declared(
        claim="ddp_bf16, the strongest dense baseline, reaches ssgd's test accuracy",
        paper=AGARWAL,
        sources=(Source(strongest_accuracy, AccuracyMatch("acc", "dense", margin="margin", trend="trend"),
                        ours="ddp_bf16 {acc_text} % vs ssgd {dense_text} %",
                        note="{why}; within a point of ssgd, the gap paired over seeds and judged at convergence "
                             "(commlab.report.rules.accuracy_match); {trend_text}; the gradients travel in bfloat16 "
                             "(torch's bf16_compress_hook arithmetic)"),),
        needs="needs finished ssgd and ddp_bf16 runs",
        to_test="runs until ssgd and the gap settle between the last two evaluations: the whole training set (scale "
                "laptop_full of config/papers/baseline.yaml)"),
    Declared(
        claim="ddp_bf16 sends half of ssgd's bytes per step (2 bytes per gradient element instead of 4)",
        paper=AGARWAL, check=True,
        sources=(Source(strongest_bytes, Consistency("holds"),
                        ours="bytes sent per step by rank 0: ddp_bf16 {ours:,.0f}, ssgd {dense:,.0f}; "
                             "ratio {ratio:.4f}",
                        note="0.5 within {tolerance:.0%} relative; both count one allreduce of the whole gradient per "
                             "step, ddp_bf16 in bfloat16"),),
        needs="needs finished ssgd and ddp_bf16 runs"),
]
