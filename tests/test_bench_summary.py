"""The benchmarks' per-step figures on hand-made log points (commlab.bench.common.step_summary,
commlab.bench.throughput.summarise, commlab.bench.scaling's validation and profiles): one meaning
of each timing field for every method, a counter the run did not log is None, never 0."""

from __future__ import annotations

import json

import pytest

from commlab.bench import scaling, throughput
from commlab.bench.common import TIMING_FIELDS, step_summary


def points(collective: float, blocked: float, compute: float, step_s: float, steps=(0, 10, 20)) -> list[dict]:
    """Cumulative counters at log points, growing by the given seconds per step."""
    return [{"step": s, "wall_seconds": 5.0 + step_s * s, "compute_seconds": compute * s,
             "comm_seconds": collective * s, "blocked_seconds": blocked * s, "selection_seconds": 0.0,
             "bytes_sent": 1000.0 * s, "collectives_global": 1.0 * s, "collectives_local": 0.0,
             "reductions_global": 1.0 * s, "samples": 128.0 * s} for s in steps]


@pytest.mark.parametrize(("collective", "blocked"), [
    (0.0300, 0.0),      # a synchronous allreduce: all of it in the collective's own time
    (0.0010, 0.1154),   # ssgd's asynchronous buckets at 100 Mbit/s: a launch, then the wait
    (0.0, 0.0),         # ddp: its allreduce inside backward, in compute
])
def test_comm_s_is_the_collectives_and_the_waits_for_every_method(collective, blocked):
    summary = step_summary(points(collective, blocked, 0.02, 0.1455), workers=4, batch=32, from_step=10)
    assert summary["steps_measured"] == 10 and summary["from_step"] == 10
    assert summary["step_s"] == pytest.approx(0.1455)
    assert summary["samples_per_s"] == pytest.approx(4 * 32 / 0.1455)
    assert summary["collective_s"] == pytest.approx(collective) and summary["blocked_s"] == pytest.approx(blocked)
    assert summary["comm_s"] == pytest.approx(collective + blocked)
    assert summary["compute_s"] == pytest.approx(0.02) and summary["collectives_per_step"] == pytest.approx(1.0)
    assert set(TIMING_FIELDS) <= set(summary)


def test_a_counter_not_logged_is_not_measured():
    pts = points(0.001, 0.1, 0.02, 0.15)
    for p in pts:
        del p["blocked_seconds"]
        del p["collectives_local"]
    summary = step_summary(pts, workers=4, batch=32)
    assert summary["blocked_s"] is None and summary["comm_s"] is None and summary["collectives_per_step"] is None
    assert summary["collective_s"] == pytest.approx(0.001)
    with pytest.raises(ValueError, match="need two logged points with wall_seconds from step 20, got 1"):
        step_summary(pts, workers=4, batch=32, from_step=20)


def test_the_summary_takes_medians_and_keeps_none():
    rows = [{"network": "loopback", "method": m, "repeat": r, "samples_per_s": rate, "step_s": 0.1,
             "compute_s": 0.05, "collective_s": 0.001, "blocked_s": blocked, "comm_s": None if blocked is None
             else 0.001 + blocked, "bytes_per_step": 10.0, "collectives_per_step": 1.0, "reductions_per_step": 1.0}
            for m, r, rate, blocked in (("ssgd", 0, 100.0, 0.03), ("ssgd", 1, 120.0, 0.05), ("ssgd", 2, 110.0, 0.04),
                                        ("old", 0, 90.0, None))]
    table = {e["method"]: e for e in throughput.summarise(rows, ["ssgd", "old"], ["loopback"])}
    assert table["ssgd"]["blocked_s"] == pytest.approx(0.04) and table["ssgd"]["comm_s"] == pytest.approx(0.041)
    assert table["old"]["comm_s"] is None and table["old"]["ratio_to_ssgd"] == pytest.approx(90 / 110)
    assert throughput.median_or_none([1.0, None]) is None and throughput.median_or_none([]) is None


def test_scaling_validation_counts_the_blocked_time():
    class Prediction:
        comm_s = 0.09

    measured = {"step_s": 0.1455, "comm_s": 0.1164, "blocked_s": 0.1154}
    row = scaling.measured_communication(measured, Prediction())
    assert row["emulated_comm_s"] == 0.1164 and row["emulated_blocked_s"] == 0.1154
    assert row["emulated_comm_share"] == pytest.approx(0.1164 / 0.1455)  # 80%, not the launches' 1%
    assert row["comm_error_pct"] == pytest.approx((0.09 / 0.1164 - 1) * 100)
    unlogged = scaling.measured_communication({"step_s": 0.1, "comm_s": None, "blocked_s": None}, Prediction())
    assert unlogged["emulated_comm_share"] is None and unlogged["comm_error_pct"] is None


def test_profiles_take_ssgds_compute_where_communication_hides_in_backward(tmp_path):
    summary = [{"network": "loopback", "method": "ssgd", "compute_s": 0.05, "comm_s": 0.03, "bytes_per_step": 8e5,
                "collectives_per_step": 1.0},
               {"network": "loopback", "method": "ddp", "compute_s": 0.08, "comm_s": 0.0, "bytes_per_step": 8e5,
                "collectives_per_step": 1.0}]
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps({"workers": 4, "batch_per_worker": 32, "summary": summary}))
    profiles, source = scaling.profiles_from_throughput(path, 32)
    assert source == str(path)
    assert profiles["ssgd"].compute_s == 0.05 and profiles["ddp"].compute_s == 0.05
    assert "compute from ssgd" in profiles["ddp"].source
