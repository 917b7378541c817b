"""Benchmark results for the claims tables: speed on emulated links from ``commlab bench``.

A paper's speed claims ("faster than dense SGD, more so as bandwidth falls") need runs whose
workers talk over shaped links. The throughput benchmark (:mod:`commlab.bench.throughput`)
measures exactly that, every method beside dense ``ssgd`` in one invocation, at loopback and at
emulated 1 Gbit/s and 100 Mbit/s; the scaling benchmark extrapolates the measured volumes with
the alpha-beta cost model. The claims (``commlab.report.claims_<paper>``) read those JSON files
(``reports/bench/``) when MLflow holds no run with a ``network`` setting, and say where the
numbers come from.

    bench = load_bench("throughput", out_dir)
    table = throughput_ratios(bench)                # network x method: ratio to ssgd on that link

The claims judge such ratios with :class:`commlab.report.rules.SpeedTrend`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def load_bench(name: str, out_dir: str | Path = "reports") -> dict | None:
    """``<out_dir>/bench/<name>.json`` (or the project's ``reports/bench``), or None when not run."""
    for candidate in (Path(out_dir) / "bench" / f"{name}.json", Path("reports/bench") / f"{name}.json"):
        if candidate.exists():
            return json.loads(candidate.read_text())
    return None


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


def dense_comm_share(bench: dict) -> str:
    """'loopback 26%, 100Mbit 69%': the share of dense SGD's step spent communicating per network
    (what bounds any communication-saving method's gain there)."""
    rows = [r for r in bench.get("summary", []) if r.get("method") == "ssgd" and r.get("step_s")]
    rows.sort(key=lambda r: link_mbit(r["network"]), reverse=True)
    return ", ".join(f"{r['network']} {100 * r['comm_s'] / r['step_s']:.0f}%" for r in rows)


def provenance(bench: dict, path: str = "reports/bench/throughput.json") -> str:
    """Where benchmark numbers come from, for a claim's note."""
    env = bench.get("environment", {})
    links = ", ".join(f"{r['network']} measured {r['measured_link_mbit']:g} Mbit/s"
                      for r in bench.get("summary", []) if r.get("method") == "ssgd" and r.get("measured_link_mbit"))
    what = (f"{bench.get('model', '?')} on {bench.get('dataset', '?')}, {bench.get('workers', '?')} workers x batch "
            f"{bench.get('batch_per_worker', '?')}, {bench.get('max_steps', '?')} steps, median of "
            f"{bench.get('repeats', 1)}, "
            + ("the paper grids' method options" if bench.get("options") == "grid" else "method defaults")
            + (", no warm-up" if bench.get("warmup_steps_zero") else ", measured after the dense warm-up"))
    return (f"{path} ({what}; {links or 'no emulated link'}; commit {str(env.get('git_commit', '?'))[:12]}, "
            f"{env.get('time', '?')})")


def modelled_speedups(scaling: dict, methods: list[str], link: str, key: str = "predictions_laptop") -> pd.DataFrame:
    """Cost-model speed-ups over dense SGD by worker count (rows) and method (columns) on ``link``
    from the scaling benchmark: a model, not a measurement."""
    rows = [r for r in scaling.get(key, []) if r.get("link") == link and r.get("method") in methods]
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows).pivot_table(index="workers", columns="method", values="speedup_vs_dense")
