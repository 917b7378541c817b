"""The SSD-SGD report's claim against ASGD: time to the test accuracy both runs reach, per seed,
read at evaluations (report/claims_ssdsgd.py), on hand-made histories; the per-seed speed-ups are
judged paired (commlab.report.rules.Gain)."""

from __future__ import annotations

import pandas as pd

from commlab.report.claims import Evidence, evaluate
from commlab.report.claims_ssdsgd import CLAIMS, time_to_shared_accuracy


def _history(curves: dict[tuple[str, int], list[tuple[int, float, float]]]) -> pd.DataFrame:
    """(name, seed) -> [(step, wall_seconds, test_accuracy)] as the long history reports read."""
    rows = []
    for (name, seed), points in curves.items():
        run_id = f"{name}-{seed}"
        for step, wall, acc in points:
            rows += [{"run_id": run_id, "name": name, "method": name.split("_")[0], "seed": seed, "step": step,
                      "metric": "wall_seconds", "value": wall},
                     {"run_id": run_id, "name": name, "method": name.split("_")[0], "seed": seed, "step": step,
                      "metric": "test_accuracy", "value": acc}]
    return pd.DataFrame(rows)


def _runs(history: pd.DataFrame) -> pd.DataFrame:
    last = history.sort_values("step").groupby(["run_id", "metric"]).tail(1)
    return last.pivot_table(index=["run_id", "name", "method", "seed"], columns="metric", values="value").reset_index()


def test_asgd_reaching_the_shared_accuracy_first_contradicts():
    history = _history({
        ("odsgd_glu", 0): [(60, 10.0, 50.0), (120, 20.0, 80.0)],
        ("asgd", 0): [(60, 9.0, 55.0), (120, 18.0, 60.0)],   # target 60%: OD-SGD 20 s, ASGD 18 s
        ("odsgd_glu", 1): [(60, 10.0, 50.0), (120, 20.0, 78.0)],
        ("asgd", 1): [(60, 9.0, 55.0), (120, 18.0, 58.0)],   # target 58%: OD-SGD 20 s, ASGD 18 s
    })
    ev = Evidence(_runs(history), history)
    found = time_to_shared_accuracy("odsgd_glu")(ev)
    assert found["seeds"] == "n=2" and list(found["speedups"]) == [9.0 / 10.0, 18.0 / 20.0]
    rows = {c.claim: c for c in evaluate(CLAIMS, ev)}
    row = rows["OD-SGD trains faster than ASGD"]
    # slower on both seeds, by the same 10%: a paired loss beyond the noise
    assert row.verdict == "contradicted" and "gain -0.10 x over 1x (paired over seeds 0, 1; s.e. 0.00" in row.note


def test_a_speed_up_on_one_seed_only_is_inconclusive():
    history = _history({
        ("odsgd_glu", 0): [(60, 10.0, 70.0), (120, 20.0, 80.0)],
        ("asgd", 0): [(60, 9.0, 40.0), (120, 18.0, 60.0)],   # ASGD tops out at 60%: OD-SGD had it at 10 s
        ("odsgd_glu", 1): [(60, 10.0, 50.0), (120, 20.0, 78.0)],
        ("asgd", 1): [(60, 9.0, 55.0), (120, 18.0, 58.0)],   # target 58%: OD-SGD 20 s, ASGD 18 s
    })
    ev = Evidence(_runs(history), history)
    assert list(time_to_shared_accuracy("odsgd_glu")(ev)["speedups"]) == [1.8, 0.9]
    row = next(c for c in evaluate(CLAIMS, ev) if c.claim == "OD-SGD trains faster than ASGD")
    assert row.verdict == "inconclusive" and "seeds would decide it" in row.note


def test_without_asgd_runs_the_claim_is_not_measured():
    history = _history({("odsgd_glu", 0): [(60, 10.0, 70.0)]})
    ev = Evidence(_runs(history), history)
    assert time_to_shared_accuracy("odsgd_glu")(ev) is None
    row = next(c for c in evaluate(CLAIMS, ev) if c.claim == "OD-SGD trains faster than ASGD")
    assert row.verdict == "not measured"


def test_faster_on_every_seed_is_reproduced():
    history = _history({
        ("odsgd_glu", s): [(60, 10.0, 70.0), (120, 20.0, 80.0)] for s in (0, 1)} | {
        ("asgd", s): [(60, 9.0, 40.0), (120, 18.0, 65.0)] for s in (0, 1)})
    ev = Evidence(_runs(history), history)
    assert list(time_to_shared_accuracy("odsgd_glu")(ev)["speedups"]) == [18.0 / 10.0] * 2
    row = next(c for c in evaluate(CLAIMS, ev) if c.claim == "OD-SGD trains faster than ASGD")
    assert row.verdict == "reproduced" and "speed-up 1.8 ± 0 (n=2)" in row.ours
