"""K-step averaging's claims (Cong, Yang, Zhou, "Reducing global reductions in large-scale
distributed training", ICPP 2019 Workshops; abstract): far fewer global reductions than
synchronous SGD at matched accuracy, Adam's generalisation gap closed, fewer still with local
reductions and reduction momentum, and one global reduction per 102K samples at scale. Then K-step
averaging's descendants, DiLoCo and Streaming DiLoCo, at K-step's period (their claims:
:mod:`commlab.report.descendants`).

Every count is the Communicator's (``reductions_global``, ``reductions_local``), not derived from
the schedule. Which period a run has comes from :func:`periods` alone. Accuracies are compared
paired by seed (:mod:`commlab.report.paired`). A saving or a period the paper reports is testable
only where a run can show it while keeping ``MIN_REDUCTIONS`` global reductions: fewer is one-shot
averaging of models trained apart, not periodic averaging, and the claim is not testable at this
scale (the note says which grid would test it).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from commlab.report.claims import Declared, Evidence, NotMeasured, Source, mean_sd, seeds_of
from commlab.report.descendants import DECLARED as DESCENDANTS
from commlab.report.paired import Difference, difference
from commlab.report.rules import ClosesGap, NotTestable, Reaches
from commlab.report.tables import at_evaluations, by_seed, param

METRICS = ["train_loss", "test_accuracy", "samples", "reductions_global", "reductions_local", "bytes_sent",
           "wall_seconds"]
BENCH = ["throughput"]  # the descendants' blocked time on an emulated link (commlab.report.descendants)
ACCURACY_TOLERANCE = 0.5  # percentage points: "matched accuracy" is not this far below beyond the noise
PAPER_SAVING = 0.99  # claim 1: more than 99% fewer global reductions
PARTLY_SAVING = 0.9  # claim 1: partly with more than 90% at matched accuracy
PAPER_HIER_SAVING = 0.62  # claim 3: up to 62% fewer global reductions than K-step
PAPER_SAMPLES = 102_000  # claim 4: samples per global reduction at 400 GPUs
COUNTERS = ("samples", "reductions_global", "reductions_local")
MIN_REDUCTIONS = 10  # global reductions a run must keep for its period to be periodic averaging
PERIODIC = ["kstep", "kstep_hier", "diloco", "streaming_diloco"]  # methods whose schedule.period is K


def periods(runs: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(global period K, local period K_l) per run from the schedule every periodic-family run logs
    (``schedule.period``, ``schedule.local_period``): K = 1 for synchronous SGD, K_l only for
    hierarchical runs (NaN elsewhere)."""
    period, local = param(runs, "schedule.period"), param(runs, "schedule.local_period")
    k_global = np.where(runs.method.isin(PERIODIC), period, 1).astype(int)
    return pd.Series(k_global, index=runs.index), pd.Series(np.where(runs.method == "kstep_hier", local, np.nan),
                                                           index=runs.index)


def describe(ev: Evidence) -> pd.DataFrame:
    """One row per run with what the claims need: optimizer, K (global period; 1 for synchronous
    SGD), K_l, block momentum and the family, from the method options every run logs."""
    runs = ev.runs
    if runs.empty:
        return runs.assign(optimizer=[], k_global=[], k_local=[], block_momentum=[], family=[])
    df = runs.copy()
    df["optimizer"] = param(df, "train.optimizer", "sgd", numeric=False)
    df["k_global"], df["k_local"] = periods(df)
    df["block_momentum"] = np.where(df.method.isin(["kstep", "kstep_hier"]), param(df, "method_params.momentum", 0.0),
                                    0.0)
    nesterov = param(df, "method_params.nesterov", "", numeric=False).astype(str).str.lower() == "true"
    df["family"] = np.select(
        [df.method == "ssgd", (df.method == "kstep") & (df.block_momentum == 0), df.method == "kstep",
         (df.method == "kstep_hier") & (df.block_momentum == 0), df.method == "kstep_hier", df.method == "diloco",
         df.method == "streaming_diloco"],
        ["synchronous", "K-step", "K-step+momentum", "local+global", "local+global+momentum", "DiLoCo",
         "Streaming DiLoCo"], "other")
    df.loc[nesterov & (df.block_momentum > 0), "family"] += " (Nesterov)"
    return df


def evaluations(ev: Evidence) -> pd.DataFrame:
    """Every evaluation with the counters at its step and the run's description (the figures' too)."""
    return at_evaluations(ev.history, COUNTERS, info=ev.table(describe),
                          columns=("optimizer", "k_global", "k_local", "block_momentum", "family"))


def acc_stats(frame: pd.DataFrame) -> tuple[float, float, int]:
    s = frame["test_accuracy"].dropna()
    return (float(s.mean()) if len(s) else float("nan"), float(s.std(ddof=1)) if len(s) > 1 else 0.0, len(s))


def matched(diff: Difference | None, tolerance: float = ACCURACY_TOLERANCE) -> bool:
    """Whether a run's accuracy matches the reference's: its paired gap (run - reference) is not
    more than ``tolerance`` below 0 beyond the noise (with one seed: its mean is not)."""
    if diff is None:
        return False
    noise = diff.half_width if diff.n >= 2 else 0.0
    return -diff.mean - noise <= tolerance


def _family(ev: Evidence, family: str, optimizer: str) -> pd.DataFrame:
    info = ev.table(describe)
    return info[(info.family == family) & (info.optimizer == optimizer)] if len(info) else info


def saving_at_matched_accuracy(ev: Evidence) -> dict | None:
    """Per K: K-step momentum SGD's accuracy, paired by seed with synchronous SGD's, and its saving
    of global reductions; the best saving among the K whose accuracy matches (:func:`matched`),
    the best among those within twice the tolerance (``near``), and the largest saving a run of
    this length can show while keeping ``MIN_REDUCTIONS`` global reductions (``reachable``)."""
    sync, kstep = _family(ev, "synchronous", "sgd"), _family(ev, "K-step", "sgd")
    if not len(sync) or not len(kstep):
        return None
    a0, _, n0 = acc_stats(sync)
    r0 = float(sync.reductions_global.mean())
    reference = by_seed(sync, "test_accuracy")
    rows = []
    for name, g in kstep.groupby("name"):
        diff = difference(by_seed(g, "test_accuracy"), reference)
        rows.append((name, int(g.k_global.iloc[0]), acc_stats(g)[0], diff, 1 - float(g.reductions_global.mean()) / r0))
    table = pd.DataFrame(rows, columns=["name", "k", "acc", "diff", "saving"]).sort_values("k")
    table["matched"] = [matched(d) for d in table["diff"]]
    table["near"] = [matched(d, 2 * ACCURACY_TOLERANCE) for d in table["diff"]]
    best = table[table.matched].saving.max() if table.matched.any() else float("nan")
    near = table[table.near].saving.max() if table.near.any() else float("nan")
    return {"a0": a0, "r0": r0, "n0": n0, "best": best, "near": near,
            "reachable": 1 - MIN_REDUCTIONS / r0 if r0 > 0 else float("nan"),
            "min_steps": int(np.ceil(MIN_REDUCTIONS / (1 - PAPER_SAVING))), "min_reductions": MIN_REDUCTIONS,
            "per_k": "; ".join(f"K={r.k}: {r.acc:.2f}% ({r.saving:.1%} fewer; gap "
                               + (r.diff.describe("pp") if r.diff is not None else "not measured") + ")"
                               for r in table.itertuples()),
            "best_text": f"best saving at matched accuracy: {best:.2%}" if np.isfinite(best)
            else "no K-step run within tolerance",
            "tolerance": ACCURACY_TOLERANCE, "seeds": seeds_of(pd.concat([sync, kstep]))}


def adam_gap(ev: Evidence) -> dict | None:
    """Synchronous Adam's gap to momentum SGD, and what remains of it with K-step Adam at its
    best K of the grid, both paired by seed (momentum SGD minus the other: positive is a gap).
    Without K-step Adam runs the premise alone is measured (``remaining`` None)."""
    sync, adam, kstep_adam = (_family(ev, "synchronous", "sgd"), _family(ev, "synchronous", "adam"),
                              _family(ev, "K-step", "adam"))
    if not len(sync) or not len(adam):
        return None
    reference = by_seed(sync, "test_accuracy")
    gap = difference(reference, by_seed(adam, "test_accuracy"))
    best_k, remaining, per_k = "", None, []
    if len(kstep_adam):
        per_k = sorted((int(g.k_global.iloc[0]), acc_stats(g)[0], name) for name, g in kstep_adam.groupby("name"))
        k, _, best_name = max(per_k, key=lambda r: r[1])
        best_k = f" (K={k})"
        remaining = difference(reference, by_seed(kstep_adam[kstep_adam.name == best_name], "test_accuracy"))
    return {"gap": gap, "remaining": remaining, "tolerance": ACCURACY_TOLERANCE, "best_k": best_k,
            "sgd": mean_sd(sync.test_accuracy), "adam": mean_sd(adam.test_accuracy),
            "gap_text": gap.describe("pp") if gap else "not measured",
            "remaining_text": remaining.describe("pp") if remaining else "not measured",
            "per_k": (", ".join(f"K={k}: {a:.2f}%" for k, a, _ in per_k) if per_k
                      else "no runs at this scale (laptop_full has them)")}


def _reductions_to_target(evals: pd.DataFrame, name: str, target: float) -> float:
    """Global reductions at the first evaluation where the seed-mean test accuracy reaches
    ``target`` (nan if it never does)."""
    e = evals[evals.name == name].groupby("step")[["test_accuracy", "reductions_global"]].mean().sort_index()
    hit = e[e.test_accuracy >= target - 1e-9]
    return float(hit.reductions_global.iloc[0]) if len(hit) else float("nan")


def hierarchical_saving(ev: Evidence) -> dict | NotMeasured | None:
    """Target: the final accuracy of K-step at the shortest hierarchical global period (the
    reference K); the hierarchical runs with momentum at that K_g and at longer ones (the paper's
    point: local reductions and momentum let the global period grow) count the global reductions
    they need to reach it, beside the fewest any K-step run needs. ``reachable``: the largest
    saving the evaluations can show (a hierarchical run reaching the target at its first one)."""
    info, evals = ev.table(describe), ev.table(evaluations)
    kstep = _family(ev, "K-step", "sgd")
    hier = info[info.family.str.startswith("local+global") & (info.optimizer == "sgd")] if len(info) else info
    hier_mom = hier[hier.block_momentum > 0] if len(hier) else hier
    if not len(hier_mom) or not len(kstep) or evals.empty:
        return None
    parts, savings, reachable = [], [], []
    reference_k = int(hier.k_global.min())
    for name, g in hier_mom.groupby("name"):
        same_k = kstep[kstep.k_global == reference_k]
        if same_k.empty:
            continue
        target = acc_stats(same_k)[0]
        need = {n: _reductions_to_target(evals, n, target) for n in sorted(set(kstep.name) | set(hier.name))}
        kstep_need = {n: v for n, v in need.items() if n in set(kstep.name) and np.isfinite(v)}
        best_kstep = min(kstep_need.values()) if kstep_need else float("nan")
        saving = 1 - need[name] / best_kstep if np.isfinite(need[name]) and best_kstep > 0 else float("nan")
        first = _reductions_at_first_evaluation(evals, name)
        reachable.append(1 - first / best_kstep if best_kstep > 0 else float("nan"))
        savings.append(saving)
        never = [n for n, v in need.items() if not np.isfinite(v)]
        parts.append(f"target {target:.2f}% (K-step K={reference_k}, final): {name} (K_g={int(g.k_global.iloc[0])}) "
                     f"needs {need[name]:.0f} global reductions, fewest of any K-step run {best_kstep:.0f} ("
                     + ", ".join(f"{n}: {v:.0f}" for n, v in need.items() if np.isfinite(v))
                     + (f"; never reached: {', '.join(never)}" if never else "") + f"); saving {saving:.0%}")
    if not parts:
        return NotMeasured("no K-step run at the hierarchical runs' global period", NOTE_HIER)
    return {"parts": "; ".join(parts), "best": max([s for s in savings if np.isfinite(s)], default=float("nan")),
            "reachable": max([r for r in reachable if np.isfinite(r)], default=float("nan")),
            "seeds": seeds_of(pd.concat([hier_mom, kstep]))}


def _reductions_at_first_evaluation(evals: pd.DataFrame, name: str) -> float:
    """Global reductions (seed mean) at a run name's first evaluation."""
    e = evals[evals.name == name].groupby("step").reductions_global.mean().sort_index()
    return float(e.iloc[0]) if len(e) else float("nan")


def samples_per_reduction(ev: Evidence) -> dict | NotMeasured | None:
    """Samples per global reduction: the largest of any run, and the largest among the runs whose
    accuracy matches synchronous SGD's (:func:`matched`); ``reachable``: the most a run of these
    samples can show while keeping ``MIN_REDUCTIONS`` global reductions."""
    info = ev.table(describe)
    if not len(info) or "samples" not in info:
        return None
    spr = info.assign(spr=info.samples / info.reductions_global.replace(0, np.nan)).dropna(subset=["spr"])
    if not len(spr):
        return NotMeasured("no run with a global reduction")
    top = spr.sort_values("spr", ascending=False).iloc[0]
    sync = _family(ev, "synchronous", "sgd")
    best_matched = float("nan")
    if len(sync):
        reference = by_seed(sync, "test_accuracy")
        ok = spr.groupby("name").filter(lambda g: matched(difference(by_seed(g, "test_accuracy"), reference)))
        best_matched = float(ok.spr.max()) if len(ok) else float("nan")
    per_step = int(top.workers) * int(float(top["param.train.batch_size"]))
    return {"top": top.spr, "top_name": top["name"], "workers": int(top.workers), "top_acc": top.test_accuracy,
            "matched": best_matched, "per_step": per_step, "batch": per_step // int(top.workers),
            "samples": float(info.samples.max()), "reachable": float(info.samples.max()) / MIN_REDUCTIONS,
            "min_reductions": MIN_REDUCTIONS, "k_needed": int(np.ceil(PAPER_SAMPLES / per_step)),
            "paper_samples": PAPER_SAMPLES}


def nothing(ev: Evidence) -> dict:
    """No measurement: the claim needs another scale."""
    return {}


NOTE_HIER = ("global reductions counted at the first epoch-end evaluation whose seed-mean accuracy reaches the "
             "target (resolution: one evaluation per epoch); reproduced: saving >= 62%, partly: > 0")

CLAIMS = [
    Declared(
        claim="K-step averaging needs more than 99% fewer global reductions than synchronous SGD at matched "
              "accuracy",
        paper="CIFAR-10, 6 GPUs (abstract)",
        sources=(Source(saving_at_matched_accuracy,
                        Reaches("best", PAPER_SAVING, strict=True, floor=PARTLY_SAVING, near="near",
                                reachable="reachable"),
                        ours="synchronous SGD {a0:.2f}% with {r0:.0f} global reductions; {per_k}; {best_text}",
                        note="{why}; momentum SGD, n={n0} seed(s); matched = not more than {tolerance} pp below "
                             "synchronous SGD beyond the noise, paired by seed; partly: >90% at matched accuracy, "
                             "or >99% within twice the tolerance; a run must keep {min_reductions} global "
                             "reductions, so >99% needs a synchronous run of at least {min_steps:,} steps"),),
        needs="needs synchronous and K-step momentum-SGD runs",
        to_test="the paper scale of config/papers/kstep.yaml (200 epochs of ResNet-20 on CIFAR-10 with K up to 256, "
                "config/paper_scale.yaml)"),
    Declared(
        claim="Sparse global reductions (K-step averaging) close Adam's generalisation gap",
        paper="CIFAR-10, 6 GPUs (abstract)",
        sources=(Source(adam_gap, ClosesGap("gap", "remaining", "tolerance", baseline="synchronous Adam",
                                                    reference="momentum SGD", variant="K-step Adam{best_k}"),
                        ours="synchronous: momentum SGD {sgd} %, Adam {adam} % (momentum SGD - Adam: {gap_text}); "
                             "K-step Adam: {per_k}; remaining at best K: {remaining_text}",
                        note="{why}; verdict on the best K of the grid"),),
        needs="needs synchronous momentum-SGD and Adam runs and K-step Adam runs",
        to_test="a setting where synchronous Adam generalises worse than momentum SGD, as the paper's: 200 epochs "
                "of ResNet-20 on CIFAR-10 (scale paper of config/papers/kstep.yaml, config/paper_scale.yaml)"),
    Declared(
        claim="Local + global reductions + reduction momentum need fewer global reductions than K-step averaging "
              "for the same accuracy (up to 62%)",
        paper="ImageNet-1K ResNet-50 (abstract)",
        sources=(Source(hierarchical_saving, Reaches("best", PAPER_HIER_SAVING, floor=0.0, reachable="reachable"),
                        ours="{parts}", note="{why}; " + NOTE_HIER),),
        needs="needs local+global+momentum and K-step runs",
        to_test="evaluations fine enough to resolve a 62% saving: ImageNet-1K ResNet-50 for 90 epochs (scale "
                "paper_imagenet of config/papers/kstep.yaml, config/paper_scale_imagenet.yaml)"),
    Declared(
        claim="One global reduction per 102K samples",
        paper="400 GPUs (abstract)",
        sources=(Source(samples_per_reduction, Reaches("matched", PAPER_SAMPLES, near="top", reachable="reachable"),
                        ours="largest: {top:,.0f} samples per global reduction ({top_name}, {workers} workers, "
                             "{top_acc:.2f}%); at matched accuracy: {matched:,.0f}",
                        note="{why}; samples per global reduction = workers x batch x K = {per_step} x K here; a run "
                             "of {samples:,.0f} samples keeping {min_reductions} global reductions shows at most "
                             "{reachable:,.0f}; the paper's 102K is at 400 GPUs: at {workers} workers x {batch} it "
                             "needs K >= {k_needed}"),),
        needs="needs finished runs",
        to_test="400 GPUs x 64 samples with K = 4 (scale paper_imagenet_400 of config/papers/kstep.yaml, "
                "config/paper_scale_imagenet_400.yaml)"),
    Declared(
        claim="Global reductions halved on 32 GPUs",
        paper="32 GPUs (abstract)",
        sources=(Source(nothing, NotTestable("needs 32 workers in 4 nodes"), ours="no 32-worker runs",
                        note="{why}"),),
        to_test="scale paper_32gpu of config/papers/kstep.yaml (config/paper_scale_32gpu.yaml)"),
    *DESCENDANTS,  # K-step averaging's descendants: DiLoCo, Streaming DiLoCo (commlab.report.descendants)
]
