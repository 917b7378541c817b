"""Every method ranked by its time to a shared accuracy target on each emulated link: the index's
ranking tables (docs/reports.md, "The index's ranking").

A run's speed on a slow link is two measurements made apart: how many samples it needs to reach an
accuracy (its accuracy history, from its grid's run on loopback) and how many samples per second
its method trains on that link (the throughput benchmark, which runs every method side by side on
emulated links). Their quotient is the run's time to the accuracy on that link.

* **Task**: one throughput benchmark file (``<out>/bench/throughput*.json``) measures one setting:
  its model on its dataset with its workers. The runs of that model and dataset are the task's
  runs; those on another number of workers are listed, not timed (the rate was measured on the
  benchmark's). Runs on generated data are left out (their accuracy means nothing).
* **Target**: per task, the highest value of the task's metric that every compared run reaches:
  the lowest of the run names' best seed-mean evaluations (for a perplexity, the highest of their
  lowest). Compared runs are the task's runs with the benchmark's workers whose method has a rate
  on some emulated link of that file.
* **Samples to the target**: per run name (paper and name), the samples processed at the first
  evaluation whose seed-mean value reaches the target (seed means over the seeds evaluated at that
  step).
* **Time**: samples to the target over the method's median samples/s on that link
  (``samples_per_s`` of the benchmark's summary). A run whose method has no rate there, or that
  trained on other workers, is listed as not measured, with the reason.

Invariants: a missing rate or history is "not measured", never 0; the target is one number per
task, the same on every link; the tables rank the timed runs fastest first, the others after.

    evaluations = load_evaluations(out)         # every report's evaluations.csv
    tables = rank_by_link(evaluations, bench)   # {link: DataFrame} for one throughput file
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from commlab.report.bench import link_mbit, throughput_ratios
from commlab.report.metrics import ACCURACY, TASK_METRICS

#: One row per evaluation of a run, as each report writes it (<out>/<paper>/evaluations.csv).
EVALUATION_COLUMNS = ["paper", "name", "method", "seed", "workers", "model", "dataset", "step", "samples", "metric",
                      "value"]
#: Datasets of generated samples (commlab.data: synthetic, synthetic_tokens).
GENERATED = ("synthetic", "synthetic_tokens")
COLUMNS = ["rank", "paper", "name", "method", "seeds", "workers", "samples_to_target", "samples_per_s", "seconds",
           "over_fastest", "note"]


def evaluations_table(history: pd.DataFrame, runs: pd.DataFrame, paper: str) -> pd.DataFrame:
    """A report's evaluations in :data:`EVALUATION_COLUMNS`: each evaluation of a task metric with
    the samples processed at its step (interpolated between the logged counters, which start at 0),
    from the long history (run_id, metric, step, value) and the runs (tags)."""
    from commlab.report.tables import at_evaluations

    # numbers, whatever the frames concatenated into it (an empty history has object columns)
    history = history.assign(step=pd.to_numeric(history.step), value=pd.to_numeric(history.value))
    frames = []
    for metric in TASK_METRICS:
        if history.empty or not (history.metric == metric).any():
            continue
        evals = at_evaluations(history, axes=("samples",), metric=metric)
        frames.append(evals.rename(columns={metric: "value"}).assign(metric=metric))
    if not frames:
        return pd.DataFrame(columns=EVALUATION_COLUMNS)
    evals = pd.concat(frames, ignore_index=True).drop(columns=["name", "method", "seed"], errors="ignore")
    tags = runs[["run_id", "name", "method", "seed", "workers", "model", "dataset"]]
    return evals.merge(tags, on="run_id").assign(paper=paper).reindex(columns=EVALUATION_COLUMNS)


def load_evaluations(out: Path) -> pd.DataFrame:
    """Every report's evaluations.csv under ``out``, one row per evaluation."""
    frames = [pd.read_csv(p) for p in sorted(Path(out).glob("*/evaluations.csv")) if p.stat().st_size]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=EVALUATION_COLUMNS)


def throughput_files(out: Path) -> list[dict]:
    """Every throughput benchmark beside the reports (``<out>/bench/throughput*.json``), each with
    the path it was read from as ``file``."""
    paths = sorted((Path(out) / "bench").glob("throughput*.json"))
    return [{**json.loads(p.read_text()), "file": str(p)} for p in paths]


def emulated_rates(bench: dict) -> pd.DataFrame:
    """Median samples/s per (method, emulated link) of a throughput benchmark: one column per link,
    slowest last; loopback and failed rows left out."""
    rates = throughput_ratios(bench, "samples_per_s")  # one row per network, fastest first
    emulated = [net for net in rates.index if np.isfinite(link_mbit(net))]
    return rates.loc[emulated].T if emulated else pd.DataFrame()


@dataclass(frozen=True)
class Curve:
    """One run name's seed-mean evaluations: samples and values by step, and its seeds."""

    samples: np.ndarray
    values: np.ndarray
    seeds: int

    def best(self, higher_is_better: bool) -> float:
        return float(self.values.max() if higher_is_better else self.values.min())

    def samples_to(self, target: float, higher_is_better: bool) -> float:
        """Samples at the first evaluation reaching ``target`` (NaN: never)."""
        reached = self.values >= target - 1e-9 if higher_is_better else self.values <= target + 1e-9
        return float(self.samples[reached.argmax()]) if reached.any() else float("nan")


def curves(evaluations: pd.DataFrame) -> dict[tuple[str, str], Curve]:
    """Per (paper, name): its seed-mean curve over the evaluations."""
    found = {}
    for key, g in evaluations.groupby(["paper", "name"]):
        mean = g.groupby("step")[["samples", "value"]].mean().sort_index()
        found[key] = Curve(mean.samples.to_numpy(float), mean.value.to_numpy(float), int(g.seed.nunique()))
    return found


def task_runs(evaluations: pd.DataFrame, bench: dict) -> pd.DataFrame:
    """The evaluations of the benchmark's task: its model, its dataset where it names one, real
    data only, the metric most of them logged."""
    evals = evaluations[(evaluations.model.astype(str) == str(bench.get("model")))
                        & ~evaluations.dataset.astype(str).isin(GENERATED)]
    if bench.get("dataset") and bench["dataset"] not in GENERATED:
        evals = evals[evals.dataset.astype(str) == str(bench["dataset"])]
    if evals.empty:
        return evals
    return evals[evals.metric == evals.metric.value_counts().index[0]]


def shared_target(found: dict, compared: list, higher_is_better: bool) -> float:
    """The highest value every compared run name reaches: the lowest of their bests (the highest
    of their lowest for a perplexity). NaN without compared runs."""
    bests = [found[key].best(higher_is_better) for key in compared]
    if not bests:
        return float("nan")
    return min(bests) if higher_is_better else max(bests)


def rank_by_link(evaluations: pd.DataFrame, bench: dict) -> tuple[dict[str, pd.DataFrame], dict]:
    """One table per emulated link of the benchmark (:data:`COLUMNS`, fastest first, then the runs
    not measured there with the reason), and what they share: the task's ``target``, ``metric``,
    ``model``, ``dataset`` and ``workers``."""
    rates = emulated_rates(bench)
    evals = task_runs(evaluations, bench)
    if rates.empty or evals.empty:
        return {}, {}
    metric = TASK_METRICS.get(str(evals.metric.iloc[0]), ACCURACY)
    found = curves(evals)
    info = evals.groupby(["paper", "name"]).agg(method=("method", "first"), workers=("workers", "first"))
    workers = bench.get("workers")
    compared = [key for key in found if info.loc[key, "workers"] == workers and info.loc[key, "method"] in rates.index]
    target = shared_target(found, compared, metric.higher_is_better)
    tables = {}
    for link in rates.columns:
        rows = []
        for key, curve in found.items():
            method, run_workers = info.loc[key, "method"], info.loc[key, "workers"]
            rate = rates[link].get(method, np.nan)
            samples = curve.samples_to(target, metric.higher_is_better) if np.isfinite(target) else np.nan
            note = ""
            if run_workers != workers:
                note = f"not measured: trained on {run_workers} workers, the benchmark measured {workers}"
                rate = np.nan  # a rate of other workers is no rate of this run
            elif not np.isfinite(rate):
                note = f"not measured: no {method} rate on the {link} link"
            elif not np.isfinite(samples):
                note = "target not reached"
            seconds = samples / rate if not note else np.nan
            rows.append({"paper": key[0], "name": key[1], "method": method, "seeds": curve.seeds,
                         "workers": run_workers, "samples_to_target": samples,
                         "samples_per_s": rate, "seconds": seconds, "note": note})
        table = pd.DataFrame(rows, columns=COLUMNS[1:])
        table = table.sort_values(["seconds", "paper", "name"], na_position="last").reset_index(drop=True)
        timed = table.seconds.notna()
        table.insert(0, "rank", np.where(timed, np.arange(1, len(table) + 1), np.nan))
        table["over_fastest"] = table.seconds / table.seconds.min() if timed.any() else np.nan
        tables[link] = table[COLUMNS]
    shared = {"target": target, "metric": metric, "model": bench.get("model"), "dataset": bench.get("dataset"),
              "workers": workers, "file": bench.get("file", ""), "compared": len(compared)}
    return tables, shared
