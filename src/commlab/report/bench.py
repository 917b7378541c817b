"""Benchmark results for the claims tables: speed on emulated links from ``commlab bench``.

A paper's speed claims ("faster than dense SGD, more so as bandwidth falls") need runs whose
workers talk over shaped links. The throughput benchmark (:mod:`commlab.bench.throughput`)
measures exactly that, every method beside dense ``ssgd`` in one invocation, at loopback and at
emulated 1 Gbit/s and 100 Mbit/s; the scaling benchmark extrapolates the measured volumes with
the alpha-beta cost model. The claims (``commlab.report.claims_<paper>``) read those JSON files
from the report's own folder (``<out_dir>/bench/``, never the working directory's) when MLflow
holds no run with a ``network`` setting, and name the file they read.

    bench = load_bench("throughput", out_dir)       # with bench["file"]: the path read
    table = throughput_ratios(bench)                # network x method: ratio to ssgd on that link
    dense_comm_share(bench)                         # 'loopback 30%, 100Mbit 80% (ssgd's collectives ...)'

The claims judge such ratios with :class:`commlab.report.rules.SpeedTrend`. The communication
share of a step is (collectives' own time + waits on asynchronous ones) / step, the benchmark's
``comm_s / step_s``, the same for every method (:data:`commlab.bench.common.TIMING_FIELDS`).

A verdict stays about the paper's claim against the paper's own baseline. Every speed claim's
note also sets the method beside the strongest dense baseline on the same link
(:func:`strongest_dense_note`): the fastest of ``ssgd``, ``ddp`` and ``ddp_bf16`` measured there
(Agarwal et al., MLSys'22: a 16-bit, overlapped DDP is the baseline compression has to beat).

    strongest_dense_note(bench, "oktopk")   # 'throughput over the strongest dense baseline on the same link ...'
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from commlab.bench.throughput import DENSE_BASELINES
from commlab.bench.throughput import strongest_dense as fastest_dense_entry


def load_bench(name: str, out_dir: str | Path) -> dict | None:
    """``<out_dir>/bench/<name>.json`` with the path it was read from as ``file``, or None when
    that benchmark did not run for this report."""
    path = Path(out_dir) / "bench" / f"{name}.json"
    if not path.exists():
        return None
    return {**json.loads(path.read_text()), "file": str(path)}


def link_mbit(network: str) -> float:
    """Link rate of a benchmark's network name ('100Mbit' -> 100; loopback -> infinity)."""
    return float(network.removesuffix("Mbit")) if network.endswith("Mbit") else float("inf")


def throughput_ratios(bench: dict, value: str = "ratio_to_ssgd") -> pd.DataFrame:
    """One row per network (fastest link first), one column per method: ``value`` of the summary
    (the median samples/s over repeats divided by ssgd's on the same link, by default)."""
    rows = [e for e in bench.get("summary", []) if "error" not in e and e.get(value) is not None]
    if not rows:
        return pd.DataFrame()
    table = pd.DataFrame(rows).pivot_table(index="network", columns="method", values=value)
    return table.loc[sorted(table.index, key=link_mbit, reverse=True)]


def slowest_link_repeats(bench: dict | None, method: str, over: tuple[str, ...] = ("ssgd",)) -> list[float]:
    """``method``'s samples/s over the fastest of ``over`` in each repeat on the slowest emulated link
    the benchmark measured it on (repeats are interleaved: the i-th of every method ran in the same
    round). Empty without such a link or its runs: a claim then has no spread to judge noise by."""
    runs = [r for r in (bench or {}).get("runs", []) if "error" not in r and r.get("samples_per_s")]
    links = sorted({r["network"] for r in runs if r["method"] == method and link_mbit(r["network"]) < float("inf")},
                   key=link_mbit)
    if not links:
        return []
    mine = {r["repeat"]: r["samples_per_s"] for r in runs if r["method"] == method and r["network"] == links[0]}
    ratios = []
    for repeat, rate in sorted(mine.items()):
        others = [r["samples_per_s"] for r in runs
                  if r["method"] in over and r["network"] == links[0] and r["repeat"] == repeat]
        if others:
            ratios.append(rate / max(others))
    return ratios


def dense_comm_share(bench: dict) -> str:
    """'loopback 30%, 100Mbit 80% (ssgd's collectives ...)': per network, the share of dense SGD's step spent
    communicating, its collectives' own time plus the waits on its asynchronous allreduces
    (``comm_s / step_s``; what bounds any communication-saving method's gain there). A file without
    ``collective_s`` predates that meaning of ``comm_s``: not measured."""
    rows = [r for r in bench.get("summary", []) if r.get("method") == "ssgd" and "error" not in r]
    if not rows:
        return "not measured (no ssgd row in the throughput benchmark)"
    if any("collective_s" not in r for r in rows):
        return ("not measured (the throughput benchmark's file predates comm_s = collectives + blocked time: "
                "rerun commlab bench throughput)")
    rows.sort(key=lambda r: link_mbit(r["network"]), reverse=True)
    shares = [f"{r['network']} " + (f"{100 * r['comm_s'] / r['step_s']:.0f}%" if r.get("comm_s") is not None
                                    and r.get("step_s") else "not measured") for r in rows]
    return ", ".join(shares) + " (ssgd's collectives' own time plus its waits on asynchronous allreduces, " \
                               "over its step)"


def environment_note(bench: dict | None) -> str:
    """'2 CPUs, load average 9.1': the machine a benchmark measured on, from its environment block
    ('' without one)."""
    env = (bench or {}).get("environment") or {}
    parts = [f"{env['cpus']} CPUs" if env.get("cpus") else "",
             f"load average {env['load_average'][0]:g}" if env.get("load_average") else ""]
    return ", ".join(p for p in parts if p)


def provenance(bench: dict) -> str:
    """Where benchmark numbers come from, for a claim's note: the file read, what it ran, its links,
    machine and commit."""
    env = bench.get("environment", {})
    links = ", ".join(f"{r['network']} measured {r['measured_link_mbit']:g} Mbit/s"
                      for r in bench.get("summary", []) if r.get("method") == "ssgd" and r.get("measured_link_mbit"))
    what = (f"{bench.get('model', '?')} on {bench.get('dataset', '?')}, {bench.get('workers', '?')} workers x batch "
            f"{bench.get('batch_per_worker', '?')}, {bench.get('max_steps', '?')} steps, median of "
            f"{bench.get('repeats', 1)}, "
            + ("the paper grids' method options" if bench.get("options") == "grid" else "method defaults")
            + (", no warm-up" if bench.get("warmup_steps_zero") else ", measured after the dense warm-up"))
    machine = environment_note(bench)
    return (f"{bench.get('file', 'a benchmark file of unknown path')} ({what}; {links or 'no emulated link'}; "
            + (f"{machine}; " if machine else "")
            + f"commit {str(env.get('git_commit', '?'))[:12]}, {env.get('time', '?')})")


def modelled_speedups(scaling: dict, methods: list[str], link: str, key: str = "predictions_laptop") -> pd.DataFrame:
    """Cost-model speed-ups over dense SGD by worker count (rows) and method (columns) on ``link``
    from the scaling benchmark: a model, not a measurement."""
    rows = [r for r in scaling.get(key, []) if r.get("link") == link and r.get("method") in methods]
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).pivot_table(index="workers", columns="method", values="speedup_vs_dense")


def strongest_dense(bench: dict) -> pd.DataFrame:
    """Per network (fastest link first): the fastest dense baseline measured there (``method``) and
    its samples/s (``rate``), as the benchmark picks it (:func:`commlab.bench.throughput.strongest_dense`);
    a network without one is left out."""
    summary = [e for e in bench.get("summary", []) if "error" not in e]
    networks = sorted({e["network"] for e in summary}, key=link_mbit, reverse=True)
    fastest = {net: entry for net in networks if (entry := fastest_dense_entry(summary, net))}
    return pd.DataFrame({"method": [e["method"] for e in fastest.values()],
                         "rate": [float(e["samples_per_s"]) for e in fastest.values()]},
                        index=pd.Index(list(fastest), name="network"))


def strongest_dense_note(bench: dict | None, method: str) -> str:
    """'throughput over the strongest dense baseline on the same link (the fastest of ssgd, ddp,
    ddp_bf16 measured there): loopback 0.93x (ddp), 100Mbit 1.12x (ddp_bf16)': ``method``'s samples/s
    over it per network of the throughput benchmark, for a speed claim's note. Says what is missing
    instead: no benchmark, no row of the method, a dense baseline not measured."""
    head = ("throughput over the strongest dense baseline on the same link (the fastest of "
            + ", ".join(DENSE_BASELINES) + " measured there)")
    if not bench:
        return head + ": not measured (no throughput benchmark)"
    rates, strongest = throughput_ratios(bench, "samples_per_s"), strongest_dense(bench)
    if method not in rates or strongest.empty:
        return head + f": not measured (no {method} or dense row in the throughput benchmark)"
    ratios = [f"{net} {rates.loc[net, method] / row.rate:.2f}x ({row.method})" for net, row in strongest.iterrows()
              if net in rates.index and pd.notna(rates.loc[net, method])]
    absent = [m for m in DENSE_BASELINES if m not in rates]
    return (head + ": " + (", ".join(ratios) or "not measured")
            + (f" ({', '.join(absent)} not measured)" if absent else ""))


def speed_over_ssgd(bench: dict | None, method: str) -> dict | None:
    """What a speed claim against ssgd reads from the throughput benchmark: ``method``'s ratio to
    ssgd per link (``ratios``), its repeats on the slowest link (``repeats``), the file read
    (``provenance``), dense SGD's communication share (``share``) and the strongest dense baseline
    beside it (``strongest``). None where the benchmark did not measure ``method``."""
    table = throughput_ratios(bench) if bench else pd.DataFrame()
    if method not in table:
        return None
    return {"ratios": table[method], "repeats": slowest_link_repeats(bench, method), "provenance": provenance(bench),
            "share": dense_comm_share(bench), "strongest": strongest_dense_note(bench, method)}
