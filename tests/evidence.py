"""Hand-made evidence for the claims modules' tests: small frames shaped like ``Evidence.runs`` (one
row per run name and seed: tags, final metrics, ``param.*``) and ``Evidence.history`` (long form:
run_id, name, method, seed, metric, step, value), and the claims they evaluate to."""

from __future__ import annotations

import pandas as pd

from commlab.report.claims import Evidence, evaluate

HISTORY_COLUMNS = ["run_id", "name", "method", "seed", "metric", "step", "value"]
RUN_COLUMNS = ["run_id", "name", "method", "seed", "workers", "network"]


def runs(rows: list[dict], **common) -> pd.DataFrame:
    """One run per row; ``common`` fills what a row leaves out; the run id is '<name>-<seed>'."""
    frame = [{"workers": 4, "network": None, **common, **row} for row in rows]
    for row in frame:
        row.setdefault("method", row["name"])
        row.setdefault("seed", 0)
        row["run_id"] = f"{row['name']}-{row['seed']}"
    return pd.DataFrame(frame) if frame else pd.DataFrame(columns=RUN_COLUMNS)


def per_seed(name: str, values: list[float], column: str = "test_accuracy", **fields) -> list[dict]:
    """Rows of one run name, one per seed 0, 1, ..., with ``column`` set to each value."""
    return [{"name": name, "seed": seed, column: value, **fields} for seed, value in enumerate(values)]


def history(points: list[tuple[str, int, str, int, float]], frame: pd.DataFrame | None = None) -> pd.DataFrame:
    """(name, seed, metric, step, value) points as a long history; the method from ``frame`` (else
    the name)."""
    methods = dict(zip(frame.name, frame.method, strict=False)) if frame is not None else {}
    return pd.DataFrame([{"run_id": f"{name}-{seed}", "name": name, "method": methods.get(name, name), "seed": seed,
                          "metric": metric, "step": step, "value": value}
                         for name, seed, metric, step, value in points], columns=HISTORY_COLUMNS)


def settled(frame: pd.DataFrame, metric: str = "test_accuracy", steps: tuple[int, ...] = (100, 200)) -> list[tuple]:
    """History points holding each run's final ``metric`` at every step of ``steps``: evaluations
    that have converged."""
    return [(r["name"], r["seed"], metric, step, r[metric]) for _, r in frame.iterrows() if pd.notna(r.get(metric))
            for step in steps]


def claims(module, frame: pd.DataFrame, points: list[tuple] | pd.DataFrame = (), out_dir=None) -> dict:
    """The module's claims evaluated on the evidence, by claim text."""
    long = points if isinstance(points, pd.DataFrame) else history(list(points), frame)
    return {c.claim: c for c in evaluate(module.CLAIMS, Evidence(frame, long, out_dir))}


def evidence(frame: pd.DataFrame, points: list[tuple] | pd.DataFrame = (), out_dir=None) -> Evidence:
    long = points if isinstance(points, pd.DataFrame) else history(list(points), frame)
    return Evidence(frame, long, out_dir)


def write_bench(out_dir, name: str, payload: dict) -> None:
    """``<out_dir>/bench/<name>.json``, as a benchmark writes it."""
    import json
    from pathlib import Path

    folder = Path(out_dir) / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(payload))


def throughput(rows: list[tuple[str, str, float]], spread: float | dict = 0.0, **fields) -> dict:
    """A throughput benchmark's payload: (network, method, ratio to ssgd) per row; ssgd's rows get
    a step of 0.1455 s, of which 0.001 s collectives and 0.1154 s waits. Each row's three interleaved
    repeats (``runs``) run at (1 - spread, 1, 1 + spread) times its rate (``spread`` a number, or
    one per method), ssgd's at its rate."""
    summary = [{"network": net, "method": method, "ratio_to_ssgd": ratio, "samples_per_s": 100 * ratio,
                "step_s": 0.1455, "collective_s": 0.001, "blocked_s": 0.1154, "comm_s": 0.1164,
                "measured_link_mbit": None if net == "loopback" else float(net.removesuffix("Mbit")) * 0.96}
               for net, method, ratio in rows]
    spreads = spread if isinstance(spread, dict) else {}

    def factors(method: str) -> tuple[float, ...]:
        width = 0.0 if method == "ssgd" else spreads.get(method, 0.0 if spreads else spread)
        return 1 - width, 1.0, 1 + width

    runs = [{"network": net, "method": method, "repeat": repeat, "samples_per_s": 100 * ratio * factor}
            for net, method, ratio in rows for repeat, factor in enumerate(factors(method))]
    fields.setdefault("runs", runs)
    return {"workers": 4, "model": "cnn", "dataset": "fashion_mnist", "batch_per_worker": 32, "max_steps": 16,
            "repeats": 3, "options": "grid", "environment": {"git_commit": "abcdef0123456789", "time": "2026-11-28",
                                                             "cpus": 2, "load_average": [8.5, 8.0, 7.0]},
            "summary": summary, **fields}
