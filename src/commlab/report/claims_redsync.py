"""RedSync's claims (Fang, Fu, Yang, Hsieh, "RedSync: Reducing Synchronization Traffic for
Distributed Deep Learning", arXiv 1808.04357; abstract and the selection cost analysis): messages
of about 0.1% of the gradient with accuracy near dense SGD, selectors faster than exact top-k on
large layers, and the end-to-end gain largest for the model with the highest
communication-to-computation ratio.

Per model (a compute-heavy ResNet-20 and a communication-heavy wide MLP): the fractions the
compressor logs (``algo_sent_fraction``, ``algo_selected_fraction``), selection timings per layer
size (``algo_select_ms_<selector>_n<size>``, and ``commlab bench selection``), and the throughput
benchmark per model (the report's ``bench/throughput_<model>.json``); the message claim quotes the
bytes the emulated links carried for RedSync's accounted ones (``commlab bench wire``,
``bench/wire.json``). The accuracy claim pairs the plain redsync run with ssgd over seeds and judges
the gap only once both have converged (:func:`commlab.report.tables.parity`). Accuracy is the task's
metric: test accuracy for the image models, perplexity for the LSTM language models (lower is
better; :mod:`commlab.report.metrics`).
"""

from __future__ import annotations

import re

import pandas as pd

from commlab.report.bench import provenance, strongest_dense_note, throughput_ratios
from commlab.report.claims import Declared, Evidence, NotMeasured, Source
from commlab.report.metrics import TASK_METRICS, task_metric
from commlab.report.rules import AccuracyMatch, Consistency, Largest, Share, Unmeasurable
from commlab.report.tables import bytes_per_step, link_mbit, param, parity
from commlab.report.wire_volume import wire_note

METRICS = [*TASK_METRICS, "bytes_sent", "samples", "wall_seconds"]
PAPER_DENSITY = 0.001  # the paper's message: about 0.1% of the gradient
MESSAGE_SLACK = 2.5  # "about 0.1%": at most 2.5x the density in values sent per step
LARGE_LAYER = 250_000  # layers at least this big count as "large" for the selection claim
BENCH_LAYER = 1_000_000  # the selection benchmark's sizes that decide: the paper's large-layer regime
MODELS = ["resnet20", "wide_mlp"]  # the grid's models, named while no run exists
#: The benchmark results the claims read (the workflow builds them before this report).
BENCH = ["selection", *(f"throughput_{m}" for m in MODELS), "wire"]
COMM_HEAVY = "wide_mlp"  # the model with the highest communication-to-computation ratio
SELECT_KEY = re.compile(r"^algo_select_ms_(?P<selector>[a-z_]+)_n(?P<n>\d+)$")


def describe(ev: Evidence) -> pd.DataFrame:
    """One row per run: model, steps, bytes per step and the compressor's own metrics."""
    runs = ev.runs
    if runs.empty:
        return runs.assign(model=[], steps=[], bytes_per_step=[], emulated_link=[])
    df = runs.copy()
    df["model"] = param(df, "model", numeric=False).fillna(df.model)
    df["steps"] = pd.to_numeric(df.get("samples"), errors="coerce") / (df["workers"] * param(df, "train.batch_size"))
    df["bytes_per_step"] = [bytes_per_step(ev.history, r) for r in df.run_id]
    df["emulated_link"] = df.network.notna() | link_mbit(df).notna()
    return df


def model_names(ev: Evidence) -> list[str]:
    info = ev.table(describe)
    return sorted(set(info.model.dropna())) if not info.empty else []


def runs_of(ev: Evidence, method: str, model: str) -> pd.DataFrame:
    info = ev.table(describe)
    return info if info.empty else info[(info.method == method) & (info.model == model)]


def compressed_share(runs: pd.DataFrame) -> float:
    """Fraction of the parameters in compressed layers, from the two fractions the runs log
    (selected / compressed elements and values sent / all parameters) and the dense remainder:
    sent = share * selected_fraction + (1 - share)."""
    sent = runs.algo_sent_fraction.astype(float).mean()
    selected = runs.algo_selected_fraction.astype(float).mean()
    return (1 - sent) / (1 - selected) if selected < 1 else 1.0


def plain_run(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs of the plain variant among a model's runs of one method: the run name with the
    fewest parts (``redsync_wide``; the quantised, threshold-reuse and warm-up variants of
    laptop_full carry a further part, ``redsync_quant_wide``)."""
    if runs.empty:
        return runs
    name = min(runs.name.unique(), key=lambda n: (n.count("_"), n))
    return runs[runs.name == name]


def per_model(ev: Evidence, needs: str, with_dense: bool) -> list:
    """Per model: the plain redsync run's message sizes and, where ssgd ran the same model, its
    bytes against ssgd's and both sides in the task's metric, paired by seed and over their
    evaluations (``with_dense``: a row needs ssgd's runs); or a row saying what it ``needs`` (or
    which metric is missing)."""
    rows: list = []
    for model in model_names(ev) or MODELS:
        ours, dense = plain_run(runs_of(ev, "redsync", model)), plain_run(runs_of(ev, "ssgd", model))
        metric = task_metric(pd.concat([ours, dense]))
        labels = {"model": model, "quantity": metric.quantity}
        if ours.empty or (with_dense and dense.empty):
            absent = " and ".join(m for m, side in (("redsync", ours), ("ssgd", dense)) if side.empty)
            rows.append(NotMeasured(f"no {absent} runs of {model}", note=needs, values=labels))
            continue
        absent = [m for m in ("algo_sent_fraction", "algo_selected_fraction") if m not in ours
                  or ours[m].isna().all()]
        if absent:
            rows.append(NotMeasured(f"not measured: the redsync runs logged no {' and no '.join(absent)}",
                                    values=labels))
            continue
        frac = ours.algo_sent_fraction.astype(float).mean()  # all layers, dense ones included
        selected = ours.algo_selected_fraction.astype(float).mean()  # compressed layers: the RGC messages
        values = parity(ev.history, ours, dense, metric) if not dense.empty else {}
        bytes_text = (f"bytes per step {100 * ours.bytes_per_step.mean() / dense.bytes_per_step.mean():.3g}% of "
                      "ssgd's" if not dense.empty else "no ssgd run of this model to set its bytes beside")
        rows.append({**values, "model": model, "name": ours.name.iloc[0], "quantity": metric.quantity,
                     "measured": metric.measured, "selected": 100 * selected, "sent": 100 * frac,
                     "bytes": bytes_text, "small": selected <= MESSAGE_SLACK * PAPER_DENSITY, "slack": MESSAGE_SLACK,
                     "dense_share": 100 * (frac - selected * compressed_share(ours)),
                     "within": metric.within(values["margin"]) if values else "",
                     "wire": wire_note(ev.bench("wire"), ["redsync"], model)})
    return rows


def message_size(ev: Evidence) -> list:
    return per_model(ev, "needs finished redsync runs of this model", with_dense=False)


def accuracy_near_dense(ev: Evidence) -> list:
    return per_model(ev, "needs finished redsync and ssgd runs of this model (every seed of both: scale "
                         "laptop_full of config/papers/redsync.yaml)", with_dense=True)


def selection_table(ev: Evidence) -> pd.DataFrame:
    """Mean ms per selection call, per run, selector and layer size (from the runs' final metrics)."""
    info = ev.table(describe)
    rows = []
    keys = [(key, SELECT_KEY.match(key)) for key in info.columns]
    for _, run in info.iterrows():
        for key, m in keys:
            if m and pd.notna(run[key]):
                rows.append({"name": run["name"], "method": run["method"], "model": run["model"],
                             "seed": run["seed"], "selector": m["selector"], "n": int(m["n"]),
                             "ms": float(run[key])})
    return pd.DataFrame(rows, columns=["name", "method", "model", "seed", "selector", "n", "ms"])


def bench_table(ev: Evidence) -> pd.DataFrame:
    """Selector timings of `commlab bench selection` (median per call), when it has run."""
    df = pd.DataFrame((ev.bench("selection") or {}).get("results", []))
    if df.empty:
        return pd.DataFrame(columns=["device", "n", "selector", "ms", "ratio_topk"])
    return df.assign(n=df["elements"], ms=1000 * df["median_s"])[["device", "n", "selector", "ms", "ratio_topk"]]


def _run_pairs(ev: Evidence) -> list[tuple]:
    """(layer size, RedSync's selector, speed-up, its ms, dgc's exact top-k ms) per large layer size."""
    large = ev.table(selection_table)
    large = large[large.n >= LARGE_LAYER]
    pairs = []
    for n in sorted(set(large.n)):
        mine = large[(large.n == n) & (large.method == "redsync") & (large.selector != "exact_topk")]
        ref = large[(large.n == n) & (large.method == "dgc") & (large.selector == "exact_topk")]
        if len(mine) and len(ref):
            pairs.append((n, mine.selector.iloc[0], ref.ms.mean() / mine.ms.mean(), mine.ms.mean(), ref.ms.mean()))
    return pairs


def _runs_text(ev: Evidence) -> str:
    return "; ".join(f"n={n:,}: {s} {m:.2f} ms vs exact top-k {r:.2f} ms ({x:.2f}x)" for n, s, x, m, r in
                     _run_pairs(ev))


def selection_bench(ev: Evidence) -> dict | None:
    """The selection benchmark at the paper's large layers (1M elements and above)."""
    bench = ev.table(bench_table)
    big = bench[bench.selector.isin(["binary_search", "trimmed_topk"]) & (bench.n >= BENCH_LAYER)] \
        if len(bench) else bench
    if not len(big):
        return None
    runs_text = _runs_text(ev)
    return {"faster": list(big.ratio_topk < 1), "runs": f"; in the training runs: {runs_text}" if runs_text else "",
            "bench": ", ".join(f"{r.selector} n={r.n:,} ({r.device}) {1 / r.ratio_topk:.2f}x"
                               for r in big.itertuples())}


def selection_runs(ev: Evidence) -> dict | None:
    """RedSync's selectors against dgc's exact top-k on the same large layers of the training runs."""
    pairs = _run_pairs(ev)
    if not pairs:
        return None
    sizes = sorted(p[0] for p in pairs)
    return {"faster": [p[2] > 1 for p in pairs], "runs": _runs_text(ev),
            "sizes": f"{sizes[0]:,}" if len(sizes) == 1 else f"{sizes[0]:,}-{sizes[-1]:,}"}


def gain_runs(ev: Evidence) -> dict | None:
    """ssgd/redsync wall time per model from runs on emulated links (two models at least)."""
    speedups = {}
    for model in model_names(ev):
        d, r = runs_of(ev, "ssgd", model), runs_of(ev, "redsync", model)
        if len(d) and len(r) and d.emulated_link.any() and r.emulated_link.any():
            speedups[model] = d.wall_seconds.mean() / r.wall_seconds.mean()
    if len(speedups) < 2:
        return None
    return {"gains": speedups, "text": "; ".join(f"{m}: ssgd/redsync wall time {s:.2f}x" for m, s in speedups.items()),
            "strongest": strongest_by_model(ev)}


def gain_bench(ev: Evidence) -> dict | None:
    """RedSync's throughput over ssgd per model from the throughput benchmark per model, compared
    on each model's slowest link."""
    benches = {m: ev.bench(f"throughput_{m}") for m in MODELS}
    benches = {m: b for m, b in benches.items() if b}
    ratios = {m: throughput_ratios(b) for m, b in benches.items()}
    ratios = {m: t["redsync"] for m, t in ratios.items() if "redsync" in t}
    if len(ratios) != len(MODELS):
        return None
    link = {m: r.dropna().index[-1] for m, r in ratios.items()}
    return {"gains": {m: r.dropna().iloc[-1] for m, r in ratios.items()},
            "text": "; ".join(f"{m}: throughput redsync / ssgd " + ", ".join(f"{n} {x:.2f}x" for n, x in r.items())
                              for m, r in ratios.items()),
            "links": ", ".join(f"{m} {link[m]}" for m in link),
            "provenance": "; ".join(provenance(benches[m]) for m in ratios), "strongest": strongest_by_model(ev)}


def strongest_by_model(ev: Evidence) -> str:
    """'resnet20: throughput over the strongest dense baseline ...; wide_mlp: ...': RedSync beside the
    strongest dense baseline of each model's throughput benchmark."""
    return "; ".join(f"{m}: {strongest_dense_note(ev.bench(f'throughput_{m}'), 'redsync')}" for m in MODELS)


def loopback_gain(ev: Evidence) -> dict:
    """ssgd/redsync wall time per model on loopback (shown, not judged: communication is nearly free)."""
    text = []
    for model in model_names(ev):
        d, r = runs_of(ev, "ssgd", model), runs_of(ev, "redsync", model)
        if len(d) and len(r) and not (d.emulated_link.any() and r.emulated_link.any()):
            text.append(f"{model}: {d.wall_seconds.mean() / r.wall_seconds.mean():.2f}x")
    return {"loopback": ", ".join(text) or "no runs", "strongest": strongest_by_model(ev)}


DENSITY_PAPER = "abstract; CIFAR-10/ImageNet/LSTM at 0.1% density"
SELECTION = "selection cost analysis (trimmed top-k for 1M-4M elements, threshold binary search above 4M; GPU)"
GAIN = "End-to-end gain is largest for the model with the highest communication-to-computation ratio"
GAIN_PAPER = "abstract; 128 GPUs and an 8-GPU server"

CLAIMS = [
    # The density is an option of the method: that the selectors meet it checks our selectors and
    # accounting, it reproduces nothing.
    Declared(
        claim="RGC's messages are about 0.1% of the gradient ({model})", paper=DENSITY_PAPER, check=True,
        sources=(Source(message_size, Consistency("small"),
                        ours="compressed layers send {selected:.3g}% of their entries per step; with the layers sent "
                             "dense, {sent:.3g}% of all parameters; {bytes}",
                        note="the density is set to 0.1%: consistent when the selectors' count is within {slack}x of "
                             "it; layers of at most 1024 elements (biases, batch norm, small convs) go dense, as in "
                             "the release: {dense_share:.2g}% of the parameters every step; each value also carries "
                             "a 4-byte index; {wire}"),)),
    Declared(
        claim="RGC at 0.1% density reaches {quantity} near dense SGD ({model})", paper=DENSITY_PAPER,
        sources=(Source(accuracy_near_dense,
                        AccuracyMatch("acc", "dense", margin="margin", metric="metric", trend="trend"),
                        ours="{measured} {acc_text} vs ssgd {dense_text}",
                        note="{why}; {name}; near = within {within} of ssgd, the gap paired over seeds and judged "
                             "at convergence (commlab.report.rules.accuracy_match); {trend_text}"),),
        to_test="runs until ssgd and the gap settle between the last two evaluations: the whole training set "
                "(scale laptop_full of config/papers/redsync.yaml) or the paper's 164 epochs of ResNet-44 and "
                "VGG-16 on CIFAR-10 (scale paper, config/paper_scale.yaml)"),
    # The benchmark covers the paper's large-layer regime (1M-100M elements); the training runs only
    # laptop layers of at most 1M elements, where a selection takes milliseconds and timings on a
    # shared machine are noisy. So the benchmark decides when it exists, the runs otherwise.
    Declared(
        claim="RedSync's selectors are faster than exact top-k on large layers", paper=SELECTION,
        sources=(Source(selection_bench, Share("faster"), ours="benchmark, x faster than torch.topk: {bench}{runs}",
                        note="verdict from `commlab bench selection` at 1M elements and above; the training runs' "
                             "layers are shown for reference"),
                 Source(selection_runs, Share("faster"), ours="{runs}",
                        note="inside training runs of wide_mlp with scaled size thresholds: layers of {sizes} "
                             "elements, where a selection takes milliseconds; the paper's regime (GPU, layers above "
                             "4M) needs the selection benchmark")),
        needs="needs redsync and dgc runs of wide_mlp, or `commlab bench selection`"),
    Declared(
        claim=GAIN, paper=GAIN_PAPER,
        sources=(Source(gain_runs, Largest("gains", COMM_HEAVY), ours="{text}", note="on emulated links; {strongest}"),
                 # Without such runs in MLflow: the throughput benchmark per model (`snakemake bench`),
                 # RedSync beside dense ssgd on the same emulated links.
                 Source(gain_bench, Largest("gains", COMM_HEAVY), ours="{text}",
                        note="throughput benchmark per model, the gain compared on the slowest link ({links}); "
                             "{provenance}. RedSync's default selector thresholds (the grid's wide_mlp runs scale "
                             "them down). Beside ssgd, {strongest}"),
                 Source(loopback_gain, Unmeasurable(), ours="no runs on emulated links",
                        note="needs runs on emulated slow links or `snakemake bench` (throughput per model); on "
                             "loopback, where communication is nearly free, ssgd/redsync wall time: {loopback}; "
                             "{strongest}"))),
]
