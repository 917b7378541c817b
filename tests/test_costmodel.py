"""The alpha-beta cost model's formulas against hand-computed values and the Communicator's costs."""

import math

import pytest

from commlab.bench import costmodel as cm
from commlab.core.communicator import ring_allreduce_cost

LINK = cm.Link("test", 1.0, 1e-5)  # 1 Gbit/s: beta = 8e-9 s/byte; alpha = 10 us


def test_link_beta():
    assert LINK.beta == pytest.approx(8e-9)
    assert cm.LINKS["10Gbit"].beta == pytest.approx(8e-10)


def test_named_formulas_by_hand():
    n = 1e6
    # 2(P-1)a + 2(P-1)/P n b = 6e-5 + 1.5e6 * 8e-9
    assert cm.ring_allreduce_time(n, 4, LINK) == pytest.approx(6e-5 + 0.012)
    # (P-1)a + (P-1) m b
    assert cm.allgather_time(n, 4, LINK) == pytest.approx(3e-5 + 0.024)
    # (P-1)a + (P-1)/P n b
    assert cm.split_and_reduce_time(n, 4, LINK) == pytest.approx(3e-5 + 0.006)
    # 2 ceil(log2 P) (a + n b): P=4 -> 4 rounds, P=5 -> 6 rounds
    assert cm.tree_allreduce_time(n, 4, LINK) == pytest.approx(4 * (1e-5 + 0.008))
    assert cm.tree_allreduce_time(n, 5, LINK) == pytest.approx(6 * (1e-5 + 0.008))
    # periodic averaging every 8 steps: one ring allreduce / 8
    assert cm.periodic_averaging_time(n, 4, 8, LINK) == pytest.approx((6e-5 + 0.012) / 8)
    # Ok-Topk's bound: (2P-1+2log2P)a + 3(P-1)/P n b = 11a + 2.25e6 b
    assert cm.PATTERNS["oktopk"].time(n, 4, LINK) == pytest.approx(11e-5 + 0.018)
    # ... for the whole step: its 6 counted collectives do not multiply the latency term again,
    # while an allgather-based method pays (P-1)a per counted collective.
    assert cm.PATTERNS["oktopk"].time(n, 4, LINK, collectives=6) == pytest.approx(11e-5 + 0.018)
    assert cm.PATTERNS["allgather"].time(n, 4, LINK, collectives=4) == pytest.approx(4 * 3e-5 + 0.024)
    for name in cm.PATTERNS:
        assert cm.PATTERNS[name].time(n, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="period"):
        cm.periodic_averaging_time(n, 4, 0, LINK)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_volume_equals_the_communicators_standard_cost(p):
    n = 4096 * p  # divisible by P: every rank sends exactly 2(P-1)/P n
    sent, _ = ring_allreduce_cost(n, p, 0)
    assert sent == pytest.approx(cm.PATTERNS["ring_allreduce"].sent_volume(p) * n)


def test_prediction_from_a_measured_profile():
    # Dense: 1.5e6 bytes/step measured at P=4 -> payload 1e6 bytes; 1 collective/step; 50 ms compute.
    dense = cm.MethodProfile("ssgd", 0.05, 1.5e6, 1.0, 4, "ring_allreduce", batch_per_worker=32)
    assert dense.payload_bytes == pytest.approx(1e6)
    pred = cm.predict(dense, 8, LINK)
    comm = 14 * 1e-5 + 2 * 7 / 8 * 1e6 * 8e-9
    assert pred.comm_s == pytest.approx(comm)
    assert pred.step_s == pytest.approx(0.05 + comm)
    assert pred.samples_per_s == pytest.approx(8 * 32 / (0.05 + comm))
    assert pred.kind == "model" and "model" in pred.label
    # Allgather of 1e4 bytes per rank: measured 3e4 bytes at P=4; 2 collectives per step.
    sparse = cm.MethodProfile("topk_allgather", 0.06, 3e4, 2.0, 4, "allgather")
    pred = cm.predict(sparse, 8, LINK, dense=dense)
    comm_sparse = 2 * 7 * 1e-5 + 7 * 1e4 * 8e-9
    assert pred.step_s == pytest.approx(0.06 + comm_sparse)
    assert pred.speedup_vs_dense == pytest.approx((0.05 + comm) / (0.06 + comm_sparse))


def test_infer_pattern_from_volume_growth():
    n = 1e6
    for name in ("ring_allreduce", "allgather", "tree"):
        pat = cm.PATTERNS[name]
        assert cm.infer_pattern({4: pat.sent_volume(4) * n, 8: pat.sent_volume(8) * n}) == name
    with pytest.raises(ValueError, match="two or more"):
        cm.infer_pattern({4: 1.0})


def test_profile_from_metric_points():
    points = [{"step": 5, "compute_seconds": 0.5, "bytes_sent": 1000.0, "collectives_global": 5},
              {"step": 15, "compute_seconds": 1.5, "bytes_sent": 21000.0, "collectives_global": 15,
               "collectives_local": 10}]
    prof = cm.profile_from_metrics("ssgd", points, 4, 32)
    assert prof.compute_s == pytest.approx(0.1)
    assert prof.bytes_per_step == pytest.approx(2000.0)
    assert prof.collectives_per_step == pytest.approx(2.0)
    assert prof.pattern == "ring_allreduce" and prof.pattern_source == "declared by the method class"
    with pytest.raises(ValueError, match="two different steps"):
        cm.profile_from_metrics("ssgd", points[:1], 4, 32)
    with pytest.raises(ValueError, match="unknown pattern"):
        cm.MethodProfile("x", 0.1, 1.0, 1.0, 4, "butterfly")


def test_cluster_ratio_and_matching_bandwidth():
    v100 = cm.CLUSTERS["V100x16@10Gbit"]
    comm = 30 * 25e-6 + 2 * 15 / 16 * 25_557_032 * 4 * 8e-10
    assert v100.comm_s == pytest.approx(comm)
    assert v100.compute_s == pytest.approx(64 / 330)
    assert v100.ratio == pytest.approx(comm / (64 / 330))
    # local: 1e6-byte gradient, 0.1 s compute, P=4 -> 1.5e6 bytes / (ratio * 0.1 s), in Mbit/s
    expected = 1.5e6 / (v100.ratio * 0.1) * 8 / 1e6
    assert cm.matching_bandwidth_mbit(1e6, 0.1, 4, v100) == pytest.approx(expected)
    assert math.isclose(v100.ratio, 0.79, rel_tol=0.02)
    with pytest.raises(ValueError):
        cm.matching_bandwidth_mbit(1e6, 0.0, 4, v100)


def test_every_registered_method_declares_a_pattern_the_cost_model_finds():
    from commlab.registry import ALGORITHMS

    for name in ALGORITHMS.package_names():
        cls = ALGORITHMS.get(name)
        assert "comm_pattern" in vars(cls), f"{name}: declare comm_pattern on {cls.__name__} itself"
        assert cls.comm_pattern in cm.PATTERNS, (name, cls.comm_pattern)
        assert cm.pattern_for(name, cls) == (cls.comm_pattern, "declared by the method class")

    class Undeclared:
        comm_pattern = None

    class Wrong:
        comm_pattern = "butterfly"

    assert cm.pattern_for("x", Undeclared) == ("ring_allreduce", "assumed (the method declares no comm_pattern)")
    with pytest.raises(ValueError, match="butterfly"):
        cm.pattern_for("x", Wrong)
