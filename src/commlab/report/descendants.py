"""K-step averaging's descendants in the K-step report: K-step with reduction momentum, DiLoCo and
Streaming DiLoCo at the same global period (docs/diloco.md; Douillard et al., "DiLoCo", arXiv
2311.08105, and "Streaming DiLoCo with overlapping communication", arXiv 2501.18512).

The runs (config/papers/kstep.yaml, laptop: ``kstepmom_msgd_k64``, ``diloco_msgd_k64``,
``sdiloco_msgd_k64``) take kstep_msgd_k64's inner momentum-SGD steps and its global period H = 64.
What each does at a reduction is where they differ, and where they coincide (docs/diloco.md):
DiLoCo's outer SGD at lr 1 without momentum is K-step averaging; its outer heavy ball is K-step's
block momentum with ``block_lr`` = the outer lr; Streaming DiLoCo with one fragment, tau = 0 and
alpha = 0 in fp32 is DiLoCo.

Per run name (:func:`descendants_table`): accuracy, global reductions (a Streaming DiLoCo
fragment's outer step is one; ``model_syncs`` counts whole models), bytes sent per rank, the
largest allreduce (elements and wire bytes per element, from the run's params), and the time a
reduction blocks on the throughput benchmark's slowest emulated link (its ``comm_s`` per step over
its reductions per step; DiLoCo's message is K-step's, the same float32 allreduce of the model,
so K-step's figure stands in where DiLoCo has no row) times the run's reductions.

What is judged, at this scale (the claims' notes say it too): DiLoCo's "as good as synchronous
training with H times less communication" (accuracy paired by seed, at convergence; the count of
reductions beside it); DiLoCo's outer Nesterov against plain averaging (K-step) at the same
reductions, paired by seed; Streaming DiLoCo's "DiLoCo's quality" (paired with DiLoCo); and its
peak bandwidth F times lower, which needs fragments of equal size: a model of layers is split at
layer boundaries, so the largest fragment bounds the cut (out of reach by construction where one
layer holds most of the parameters).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from commlab.report.bench import link_mbit
from commlab.report.claims import Declared, Evidence, NotMeasured, Source, mean_sd, seeds_of
from commlab.report.metrics import ACCURACY
from commlab.report.rules import AccuracyMatch, Gain, Reaches
from commlab.report.tables import by_seed, param, parity

WIRE_BYTES = {"fp32": 4, "bf16": 2}  # bytes per element of a pseudo-gradient on the wire
OUTER = ("diloco", "streaming_diloco")
#: Methods whose reductions block the same way as another's when that one has no benchmark row.
SAME_MESSAGE = {"diloco": "kstep"}
DILOCO_PAPER = "DiLoCo (Douillard et al., arXiv 2311.08105), abstract: 8 workers, H = 500"
STREAMING_PAPER = "Streaming DiLoCo (Douillard et al., arXiv 2501.18512), abstract"
SCALE_NOTE = ("At this scale 4 outer steps come before the last (the paper: H = 500 over about 88,000 steps), the "
              "inner optimizer is momentum SGD (the paper's is AdamW) so that K-step's inner steps are the same")


def descendants_runs(ev: Evidence) -> pd.DataFrame:
    """The runs of the section: K-step (with or without reduction momentum), DiLoCo and Streaming
    DiLoCo, with their period, fragments, wire precision and what a reduction does (``outer``)."""
    runs = ev.runs
    if not len(runs):
        return runs
    mine = runs[runs.method.isin(["kstep", *OUTER])].copy()
    if mine.empty:
        return mine
    mine["period"] = param(mine, "schedule.period")  # the family's global period, H = K
    mine["fragments"] = param(mine, "method_params.fragments", 1).where(mine.method == "streaming_diloco", 1)
    mine["precision"] = param(mine, "method_params.outer_precision", "fp32", numeric=False).where(
        mine.method == "streaming_diloco", "fp32")
    mine["outer"] = [_outer(r) for _, r in mine.iterrows()]
    return mine


def _outer(run: pd.Series) -> str:
    """What a run does at a reduction, in words."""
    def value(key: str, default: str = "?") -> str:
        return str(run.get(f"param.method_params.{key}", default))

    if run.method == "kstep":
        momentum = float(value("momentum", "0") or 0)
        return "average" if momentum == 0 else f"block momentum {momentum:g}, block lr {value('block_lr')}"
    outer = f"outer {value('outer_optimizer')} lr {value('outer_lr')} momentum {value('outer_momentum')}"
    if run.method == "streaming_diloco":
        outer += (f"; {value('fragments')} fragments ({value('fragment_pattern')}), tau {value('delay')}, "
                  f"alpha {value('alpha')}, {value('outer_precision')}")
    return outer


def largest_message(runs: pd.DataFrame) -> tuple[float, float]:
    """(elements, bytes) of a run's largest allreduce: the model in float32, or Streaming DiLoCo's
    largest fragment in its wire precision (run params ``model_parameters``, ``fragment.<f>.numel``)."""
    first = runs.iloc[0]
    model = float(first.get("param.model_parameters", np.nan))
    if first.method != "streaming_diloco":
        return model, 4 * model
    sizes = [float(first[c]) for c in runs.columns if c.startswith("param.fragment.") and c.endswith(".numel")
             and pd.notna(first[c])]
    largest = max(sizes) if sizes else np.nan
    return largest, WIRE_BYTES.get(str(first.precision), 4) * largest


def blocked_per_reduction(ev: Evidence) -> tuple[dict[str, float], str]:
    """Per method, the seconds one global reduction blocks on the throughput benchmark's slowest
    emulated link (comm_s per step over reductions per step), and that link ('' without one)."""
    bench = ev.bench("throughput")
    rows = [r for r in (bench or {}).get("summary", []) if "error" not in r and np.isfinite(link_mbit(r["network"]))]
    if not rows:
        return {}, ""
    link = min((r["network"] for r in rows), key=link_mbit)
    found = {r["method"]: r["comm_s"] / r["reductions_per_step"] for r in rows
             if r["network"] == link and r.get("comm_s") is not None and r.get("reductions_per_step")}
    for method, stand_in in SAME_MESSAGE.items():
        if method not in found and stand_in in found:
            found[method] = found[stand_in]
    return found, link


def descendants_table(ev: Evidence) -> pd.DataFrame:
    """Per run name of the section, and synchronous SGD beside them: seeds, accuracy, global
    reductions, whole-model syncs, MB sent per rank, the largest allreduce, and the seconds the
    reductions block on the benchmark's slowest emulated link (NaN: not measured)."""
    runs = ev.table(descendants_runs)
    if not len(runs):
        return pd.DataFrame()
    blocked, link = blocked_per_reduction(ev)
    rows = []
    for name, g in runs.groupby("name", sort=False):
        first = g.iloc[0]
        reductions = float(g.reductions_global.mean())
        elements, message = largest_message(g)
        per_reduction = blocked.get(first.method, np.nan)
        rows.append({"name": name, "method": first.method, "outer": first.outer, "period": first.period,
                     "seeds": g.seed.nunique(), "accuracy": mean_sd(g.test_accuracy), "reductions": reductions,
                     "model_syncs": reductions / first.fragments, "MB_sent": g.bytes_sent.mean() / 1e6,
                     "largest_allreduce": elements, "largest_allreduce_bytes": message,
                     f"blocked_s_per_reduction_{link or 'link'}": per_reduction,
                     f"blocked_s_{link or 'link'}": per_reduction * reductions})
    return pd.DataFrame(rows).set_index("name")


def _named(ev: Evidence, method: str) -> pd.DataFrame:
    runs = ev.table(descendants_runs)
    return runs[runs.method == method] if len(runs) else runs


def _reference(ev: Evidence, period: float) -> pd.DataFrame:
    """K-step without reduction momentum at ``period``: plain averaging."""
    runs = ev.table(descendants_runs)
    if not len(runs):
        return runs
    plain = runs[(runs.method == "kstep") & (runs.period == period)
                 & (param(runs, "method_params.momentum", 0.0) == 0)]
    return plain[plain.name == plain.name.iloc[0]] if len(plain) else plain


def _synchronous(ev: Evidence) -> pd.DataFrame:
    runs = ev.runs
    sync = runs[(runs.method == "ssgd") & (param(runs, "train.optimizer", "sgd", numeric=False) == "sgd")]
    return sync[sync.name == sync.name.iloc[0]] if len(sync) else sync


def diloco_against_synchronous(ev: Evidence) -> dict | NotMeasured | None:
    """DiLoCo's accuracy beside synchronous momentum SGD's (paired, at convergence) and how many
    fewer global reductions it made."""
    diloco, sync = _named(ev, "diloco"), _synchronous(ev)
    if not len(diloco):
        return None
    diloco = diloco[diloco.name == diloco.name.iloc[0]]
    if not len(sync):
        return NotMeasured(f"{mean_sd(diloco.test_accuracy)}; no synchronous momentum-SGD run")
    fewer = float(sync.reductions_global.mean() / diloco.reductions_global.mean())
    return {**parity(ev.history, diloco, sync, ACCURACY), "name": diloco.name.iloc[0], "sync": sync.name.iloc[0],
            "period": int(diloco.period.iloc[0]), "fewer": fewer,
            "reductions": f"{diloco.reductions_global.mean():.0f} vs {sync.reductions_global.mean():.0f}"}


def outer_against_averaging(ev: Evidence) -> dict | NotMeasured | None:
    """DiLoCo's accuracy minus K-step's (plain averaging) at the same period, per seed."""
    diloco = _named(ev, "diloco")
    if not len(diloco):
        return None
    diloco = diloco[diloco.name == diloco.name.iloc[0]]
    plain = _reference(ev, diloco.period.iloc[0])
    if not len(plain):
        return NotMeasured(f"{mean_sd(diloco.test_accuracy)}; no K-step run at period {diloco.period.iloc[0]:g}")
    gain = by_seed(diloco, "test_accuracy").sub(by_seed(plain, "test_accuracy")).dropna()
    momentum = _named(ev, "kstep")
    momentum = momentum[param(momentum, "method_params.momentum", 0.0) > 0] if len(momentum) else momentum
    beside = "; ".join(f"{n} {mean_sd(g.test_accuracy)}" for n, g in momentum.groupby("name"))
    return {"gain": gain, "name": diloco.name.iloc[0], "plain": plain.name.iloc[0],
            "acc": mean_sd(diloco.test_accuracy), "plain_acc": mean_sd(plain.test_accuracy),
            "reductions": f"{diloco.reductions_global.mean():.0f} vs {plain.reductions_global.mean():.0f}",
            "momentum": f"; beside them, reduction momentum: {beside}" if beside else "",
            "seeds": seeds_of(pd.concat([diloco, plain]))}


def streaming_against_diloco(ev: Evidence) -> dict | NotMeasured | None:
    """Streaming DiLoCo's accuracy beside DiLoCo's at the same period (paired, at convergence)."""
    streaming, diloco = _named(ev, "streaming_diloco"), _named(ev, "diloco")
    if not len(streaming):
        return None
    streaming = streaming[streaming.name == streaming.name.iloc[0]]
    if not len(diloco):
        return NotMeasured(f"{mean_sd(streaming.test_accuracy)}; no DiLoCo run")
    diloco = diloco[diloco.name == diloco.name.iloc[0]]
    return {**parity(ev.history, streaming, diloco, ACCURACY), "name": streaming.name.iloc[0],
            "diloco": diloco.name.iloc[0], "outer": streaming.outer.iloc[0],
            "reductions": f"{streaming.reductions_global.mean():.0f} vs {diloco.reductions_global.mean():.0f}"}


def peak_bandwidth(ev: Evidence) -> dict | None:
    """Streaming DiLoCo's largest allreduce against DiLoCo's: the cut the fragments alone give (the
    model's elements over the largest fragment's, ``factor``: at most F, F with fragments of equal
    size), and with the wire precision (bytes)."""
    streaming = _named(ev, "streaming_diloco")
    if not len(streaming):
        return None
    streaming = streaming[streaming.name == streaming.name.iloc[0]]
    elements, message = largest_message(streaming)
    model = float(streaming.iloc[0].get("param.model_parameters", np.nan))
    fragments = int(streaming.fragments.iloc[0])
    return {"name": streaming.name.iloc[0], "fragments": fragments, "factor": model / elements,
            "bytes_factor": 4 * model / message, "largest": elements, "model": model,
            "share": elements / model, "precision": streaming.precision.iloc[0]}


ACCURACY_RULE = ("within a point, the gap paired over seeds and judged at convergence "
                 "(commlab.report.rules.accuracy_match)")


def _parity(claim: str, paper: str, measure, ours: str, note: str, what: str) -> Declared:
    """An accuracy-parity claim of the section (paired by seed, judged at convergence); ``what``
    names the runs that would measure it."""
    return Declared(claim=claim, paper=paper,
                    sources=(Source(measure, AccuracyMatch("acc", "dense", margin="margin", trend="trend"), ours=ours,
                                    note="{why}; " + ACCURACY_RULE + "; {trend_text}" + note),),
                    missing=f"no {what} run at this scale",
                    needs=f"the laptop grid of config/papers/kstep.yaml runs {what}",
                    to_test=f"runs long enough for the outer optimizer to take many steps: the whole training set "
                            f"(scale laptop_full) with {what} runs, or the paper's language models")


DECLARED = [
    _parity("DiLoCo reaches synchronous training's accuracy with H times fewer communications", DILOCO_PAPER,
            diloco_against_synchronous,
            ours="{name} {acc_text} % vs {sync} {dense_text} %; global reductions {reductions} ({fewer:.0f}x fewer "
                 "at H = {period})",
            note=". " + SCALE_NOTE, what="DiLoCo"),
    Declared(
        claim="DiLoCo's outer Nesterov optimizer beats plain averaging (K-step, FedAvg) at the same communication",
        paper="DiLoCo (arXiv 2311.08105): the ablation of the outer optimizer",
        sources=(Source(outer_against_averaging, Gain("gain", min_gain=0.5),
                        ours="{name} {acc} % vs {plain} {plain_acc} %; global reductions {reductions}{momentum}",
                        note="DiLoCo - K-step: {why}; reproduced when the per-seed gain is above 0 beyond the noise "
                             "and at least half a point on average. " + SCALE_NOTE),),
        missing="no DiLoCo run at this scale",
        needs="the laptop grid of config/papers/kstep.yaml runs diloco_msgd_k64 beside kstep_msgd_k64"),
    _parity("Streaming DiLoCo reaches DiLoCo's accuracy", STREAMING_PAPER, streaming_against_diloco,
            ours="{name} {acc_text} % vs {diloco} {dense_text} %; global reductions {reductions} (one per fragment)",
            note="; {outer}", what="Streaming DiLoCo and DiLoCo"),
    Declared(
        claim="Synchronising one fragment at a time lowers the peak bandwidth F times",
        paper=STREAMING_PAPER,
        sources=(Source(peak_bandwidth, Reaches("factor", "fragments", reachable="factor"),
                        ours="{name}: largest allreduce {largest:,.0f} of {model:,.0f} elements ({share:.0%}, F = "
                             "{fragments}); with {precision} on the wire {bytes_factor:.2f}x fewer bytes than DiLoCo's "
                             "float32 model",
                        note="{why}; fragments are made of whole layers (commlab.algorithms.streaming_diloco), so "
                             "the largest fragment bounds the cut: F-fold needs layers of about equal size (a "
                             "transformer's blocks); the precision's cut (bf16: 2x) is apart from it"),),
        missing="no Streaming DiLoCo run at this scale"),
]
