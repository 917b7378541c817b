"""SSD-SGD's and OD-SGD's claims (Xu et al., "OD-SGD: One-step Delay Stochastic Gradient Descent
for Distributed Training", arXiv 2005.06728, and "SSD-SGD: communication sparsification for
distributed deep learning training", arXiv 2012.05396; abstracts, evaluations and the ablations
of the local update and the warm-up): faster than synchronous SGD at about its accuracy, GLU
needed, the gain from overlap not volume, and the synchronous warm-up needed.

Accuracy and blocked time come from the runs (paired by seed with ``ssgd``); speed from the
throughput benchmark's emulated links when it has run (reports/bench/throughput.json), else from
the runs' wall time on loopback.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from commlab.report.bench import dense_comm_share, provenance, throughput_ratios
from commlab.report.claims import Declared, Evidence, Source, mean_sd
from commlab.report.rules import AccuracyMatch, Conditions, Gain, Reaches, SpeedTrend
from commlab.report.tables import at_evaluations

METRICS = ["test_accuracy", "wall_seconds", "samples", "train_loss"]
BENCH = ["throughput"]  # the benchmark results the claims read (built before this report)
LOOPBACK_FASTER = 1.05  # "faster" on loopback: at least this speed-up on every seed
MIN_GAIN = 0.5  # accuracy points a needed component (GLU, warm-up) must add on average
SSD = "ssd_k5_glu"  # the papers' setting: k = 5 with GLU
DELAYED = ["odsgd_glu", "ssd_k2_glu", "ssd_k5_glu"]
SSD_PAPER = "SSD-SGD abstract and evaluation: CIFAR-10 ResNet-20, ImageNet ResNet-50, k = 5, GLU"
LOOPBACK = ("Measured on loopback (4 processes on 2 CPU cores), where communication is a small part "
            "of a step; the papers' speed-ups come from slow parameter-server links: `snakemake bench` "
            "measures every method on emulated links and this report then judges speed from it.")
EMULATED_FASTER = " Faster = a higher throughput on every emulated link, most on the slowest."
LOOPBACK_RULE = " Faster = at least 1.05x on every seed."
ASGD_RULE = (" Against ASGD (a parameter server on rank 0, workers pushing gradients and pulling weights in "
             "arrival order, its lr divided by the workers: docs/asgd.md): the wall-clock time each needs to reach "
             "the test accuracy both reach, read at their evaluations (epoch ends, so a coarse clock at laptop "
             "scale); faster = less time on every seed.")


def _col(frame: pd.DataFrame, name: str) -> pd.Series:
    return frame[name] if name in frame else pd.Series(np.nan, index=frame.index)


def describe(ev: Evidence) -> pd.DataFrame:
    """The runs with the share of wall-clock time blocked on communication: synchronous collectives
    (``comm_seconds``) plus the waits on asynchronous ones (``blocked_seconds``)."""
    runs = ev.runs
    if not len(runs):
        return runs
    return runs.assign(blocked_share=(_col(runs, "comm_seconds").fillna(0) + _col(runs, "blocked_seconds").fillna(0))
                       / _col(runs, "wall_seconds"))


def values(ev: Evidence, name: str, metric: str) -> pd.Series:
    """Per-seed values of a metric for one run name, indexed by seed."""
    runs = ev.table(describe)
    if not len(runs) or metric not in runs:
        return pd.Series(dtype=float)
    return runs[runs["name"] == name].set_index("seed")[metric].dropna().astype(float)


def paired(ev: Evidence, a: str, b: str, metric: str) -> tuple[pd.Series, pd.Series]:
    """The seeds both run names have, in the same order."""
    va, vb = values(ev, a, metric), values(ev, b, metric)
    common = va.index.intersection(vb.index)
    return va.loc[common], vb.loc[common]


def speed_and_accuracy(ev: Evidence, fast: str, base: str = "ssgd") -> dict | None:
    """Speed-up (wall of base / wall of fast, per seed; the smallest judged) and accuracy beside
    ``base`` on the seeds both have; None without paired runs."""
    wall_f, wall_b = paired(ev, fast, base, "wall_seconds")
    acc_f, acc_b = paired(ev, fast, base, "test_accuracy")
    if wall_f.empty or acc_f.empty:
        return None
    speedup = wall_b / wall_f
    return {"speed": f"{fast} vs {base}: speed-up {mean_sd(speedup)} (wall {wall_b.mean():.1f} s -> "
                     f"{wall_f.mean():.1f} s)",
            "accuracy": f"{fast} vs {base}: accuracy {acc_f.mean():.2f}% vs {acc_b.mean():.2f}%, "
                        f"difference {mean_sd(acc_f - acc_b)} points",
            "speedup": float(speedup.min()), "acc": acc_f, "reference": acc_b}


def _with_k2(ev: Evidence, key: str) -> str:
    """SSD-SGD with k = 2 beside the judged k = 5 (shown, not judged)."""
    k2 = speed_and_accuracy(ev, "ssd_k2_glu")
    return f". With k = 2: {k2[key]}" if k2 else ""


def emulated_speed(method: str):
    """A measurement of ``method``'s throughput over ssgd per emulated link (the throughput
    benchmark), the loopback runs' speed beside it."""
    def measure(ev: Evidence) -> dict | None:
        bench = ev.bench("throughput")
        table = throughput_ratios(bench) if bench else pd.DataFrame()
        if method not in table:
            return None
        loopback = speed_and_accuracy(ev, fast_run(method))
        return {"ratios": table[method], "method": method,
                "emulated": f"On emulated links: {provenance(bench)}; dense SGD's communication share of a step: "
                            f"{dense_comm_share(bench)}.",
                "loopback": f"; loopback runs {loopback['speed'] if loopback else 'no runs'}",
                "k2": _with_k2(ev, "speed") if loopback and method == "ssdsgd" else ""}
    return measure


def loopback_speed(method: str):
    """A measurement of the loopback runs' speed-up over ssgd (no benchmark)."""
    def measure(ev: Evidence) -> dict | None:
        found = speed_and_accuracy(ev, fast_run(method))
        if found is None:
            return None
        return {**found, "k2": _with_k2(ev, "speed") if method == "ssdsgd" else ""}
    return measure


def fast_run(method: str) -> str:
    """The run name judged for a method: k = 5 with GLU for SSD-SGD, GLU for OD-SGD."""
    return {"ssdsgd": SSD, "odsgd": "odsgd_glu"}[method]


def accuracy_beside_ssgd(name: str, k2: bool = False):
    """A measurement of run ``name``'s final accuracy beside ssgd's on the same seeds."""
    def measure(ev: Evidence) -> dict | None:
        found = speed_and_accuracy(ev, name)
        if found is None:
            return None
        return {**found, "k2": _with_k2(ev, "accuracy") if k2 else ""}
    return measure


def glu_gain(ev: Evidence) -> dict | None:
    """GLU's accuracy gain over plain local SGD in SSD-SGD k = 5, per seed, beside the seed spread."""
    acc_glu, acc_sgd = paired(ev, SSD, "ssd_k5_sgd", "test_accuracy")
    if acc_glu.empty:
        return None
    gain = acc_glu - acc_sgd
    spread = float(np.nansum([values(ev, n, "test_accuracy").std(ddof=1) for n in (SSD, "ssd_k5_sgd")]))
    dc = values(ev, "ssd_k5_dcasgd", "test_accuracy")
    return {"gain": gain, "spread": spread, "glu": acc_glu.mean(), "sgd": acc_sgd.mean(), "gain_text": mean_sd(gain),
            "dcasgd": f", DC-ASGD {dc.mean():.2f}%" if not dc.empty else "",
            "within_spread": "" if gain.mean() > spread else " The difference is within the seed spread."}


def time_to_shared_accuracy(fast: str, slow: str = "asgd"):
    """A measurement of ``fast``'s speed over ``slow`` in time to accuracy: per seed, the target is the
    lower of the two runs' best evaluated test accuracies (one both reach), and each run's time is
    its wall clock at its first evaluation at or above it; the smallest speed-up over seeds is judged."""
    def measure(ev: Evidence) -> dict | None:
        if ev.history.empty:
            return None
        evals = at_evaluations(ev.history, axes=("wall_seconds",))
        evals = evals[evals.name.isin([fast, slow])].dropna(subset=["wall_seconds"])
        speedups, targets = [], []
        for _, runs in evals.groupby("seed"):
            by_name = {name: g.sort_values("step") for name, g in runs.groupby("name")}
            if set(by_name) != {fast, slow}:
                continue
            target = min(g.test_accuracy.max() for g in by_name.values())
            first = {name: g[g.test_accuracy >= target].wall_seconds.iloc[0] for name, g in by_name.items()}
            speedups.append(first[slow] / first[fast])
            targets.append(target)
        if not speedups:
            return None
        acc_f, acc_s = paired(ev, fast, slow, "test_accuracy")
        return {"speedup": float(min(speedups)), "seeds": len(speedups),
                "speed": f"{fast} vs {slow}: time to {np.mean(targets):.1f}% accuracy, speed-up "
                         f"{mean_sd(pd.Series(speedups))} (final accuracy {acc_f.mean():.2f}% vs {acc_s.mean():.2f}%)"}
    return measure


def blocked_time(ev: Evidence) -> dict | None:
    """Share of wall-clock time blocked on communication, delayed methods against ssgd, and whether
    they send the same bytes."""
    share_ssgd = values(ev, "ssgd", "blocked_share")
    if share_ssgd.empty or all(values(ev, n, "blocked_share").empty for n in DELAYED):
        return None
    parts, lower, same_bytes = [f"ssgd {share_ssgd.mean():.1%}"], True, True
    for n in DELAYED:
        share = values(ev, n, "blocked_share")
        if share.empty:
            continue
        parts.append(f"{n} {share.mean():.1%}")
        lower &= share.mean() < share_ssgd.mean()
        b_n, b_s = paired(ev, n, "ssgd", "bytes_sent")
        same_bytes &= bool(len(b_n)) and bool(((b_n - b_s).abs() <= 0.01 * b_s).all())
    return {"parts": ", ".join(parts), "lower": lower, "same_bytes": same_bytes,
            "bytes": "; bytes sent equal to SSGD's" if same_bytes else "; bytes sent differ from SSGD's"}


def warmup_gain(ev: Evidence) -> dict | None:
    """SSD-SGD k = 5 with the synchronous warm-up against without, per seed."""
    acc_w, acc_nw = paired(ev, SSD, "ssd_k5_glu_nowarmup", "test_accuracy")
    gain = acc_w - acc_nw
    return {"gain": mean_sd(gain), "mean": gain.mean()} if len(gain) else None


def _speed_claim(claim: str, paper: str, method: str, also: str) -> Declared:
    """Speed against ssgd: the throughput benchmark's emulated links when measured, else the loopback runs."""
    return Declared(
        claim=claim, paper=paper,
        sources=(Source(emulated_speed(method), SpeedTrend("ratios"),
                        ours="throughput {method} / ssgd by link: {why}{loopback}{k2}",
                        note="{emulated}" + EMULATED_FASTER + also),
                 Source(loopback_speed(method), Reaches("speedup", LOOPBACK_FASTER), ours="loopback runs {speed}{k2}",
                        note=LOOPBACK + LOOPBACK_RULE + also)),
        needs=LOOPBACK + LOOPBACK_RULE + also)


CLAIMS = [
    # Speed and accuracy are judged apart: speed on emulated links when measured, else loopback.
    _speed_claim("SSD-SGD trains faster than SSGD (up to 110%, i.e. 2.1x)", SSD_PAPER, "ssdsgd",
                 " The verdict uses k = 5, the papers' setting."),
    Declared(
        claim="SSD-SGD's test accuracy is within about a point of SSGD's", paper=SSD_PAPER,
        sources=(Source(accuracy_beside_ssgd(SSD, k2=True), AccuracyMatch("acc", "reference", margin=1.0),
                        ours="{accuracy} ({why}){k2}",
                        note="Within a point: the gap of the means judged with its standard error over seeds "
                             "(commlab.report.rules.accuracy_match). The verdict uses k = 5."),),
        needs="Within a point: the gap of the means judged with its standard error over seeds "
              "(commlab.report.rules.accuracy_match). The verdict uses k = 5."),
    Declared(
        claim="OD-SGD reaches accuracy similar to or slightly better than SSGD",
        paper="OD-SGD abstract and evaluation: MNIST, CIFAR-10, ImageNet",
        sources=(Source(accuracy_beside_ssgd("odsgd_glu"),
                        AccuracyMatch("acc", "reference", margin=1.0, at_least=True), ours="{accuracy} ({why})",
                        note="Similar or better = no more than one point below SSGD, the gap of the means judged with "
                             "its standard error over seeds (commlab.report.rules.accuracy_match, one-sided)."),),
        needs="Similar or better = no more than one point below SSGD, the gap of the means judged with its standard "
              "error over seeds (commlab.report.rules.accuracy_match, one-sided)."),
    _speed_claim("OD-SGD trains faster than SSGD",
                 "OD-SGD abstract; throughput figures on GPU clusters", "odsgd", ""),
    Declared(
        claim="OD-SGD trains faster than ASGD", paper="OD-SGD abstract; throughput figures on GPU clusters",
        sources=(Source(time_to_shared_accuracy("odsgd_glu"), Reaches("speedup", 1.0, strict=True),
                        ours="loopback runs {speed}", note=LOOPBACK + ASGD_RULE),),
        missing="no ASGD runs at this scale", needs=LOOPBACK + ASGD_RULE),
    Declared(
        claim="GLU is needed: plain local updates lose accuracy",
        paper="SSD-SGD ablation of the local update algorithm (CIFAR-10)",
        sources=(Source(glu_gain, Gain("gain", "spread", min_gain=MIN_GAIN),
                        ours="SSD-SGD k=5: GLU {glu:.2f}%, plain local SGD {sgd:.2f}%{dcasgd}; GLU - plain = "
                             "{gain_text} points (seed spread {spread:.2f})",
                        note="Reproduced when GLU gains at least half a point on average, on every seed, and more "
                             "than the seed spread. GLU is our reconstruction from the paper's description (the "
                             "released kernel is broken).{within_spread}"),),
        needs="Reproduced when GLU gains at least half a point on average, on every seed, and more than the seed "
              "spread. GLU is our reconstruction from the paper's description (the released kernel is broken)."),
    Declared(
        claim="The gain is overlap, not volume: the same gradients are sent every step, but steps block less on "
              "communication than SSGD's",
        paper="OD-SGD/SSD-SGD design (one allreduce per step, pulled weights overlapped with compute)",
        sources=(Source(blocked_time, Conditions("lower", also=("same_bytes",)),
                        ours="blocked share of wall-clock: {parts}{bytes}",
                        note="Blocked = synchronous collectives plus waits on asynchronous ones (warm-up steps "
                             "included). On loopback the allreduce is short, so the absolute saving is small."),),
        needs="Blocked = synchronous collectives plus waits on asynchronous ones (warm-up steps included). On loopback "
              "the allreduce is short, so the absolute saving is small."),
    Declared(
        claim="The synchronous warm-up stage is needed", paper="SSD-SGD abstract and ablation",
        sources=(Source(warmup_gain, Reaches("mean", MIN_GAIN, floor=0.0),
                        ours="SSD-SGD k=5 GLU with warm-up - without: {gain} points",
                        note="Warm-up scaled to the run length (see Method and scale below)."),),
        missing="no run without warm-up at this scale (laptop_full has one)",
        needs="Warm-up scaled to the run length (see Method and scale below)."),
]
