"""The baseline's measurements (commlab.report.claims_baseline) on hand-made runs and histories:
ssgd against DDP in training loss, final accuracy (paired by seed) and bytes per step, with a case
for every verdict each can reach."""

from __future__ import annotations

import math

import pytest

from commlab.report import claims_baseline as baseline
from evidence import claims, evidence, per_seed, runs

LOSS = "ssgd through the Communicator follows DDP's training-loss curve on the same seeds"
ACCURACY = "ssgd and DDP reach the same final test accuracy"
BYTES = "[consistency check] Both send one ring allreduce of the full gradient per step: 2(P-1)/P x 4 B x parameters"


def pair(ssgd_acc, ddp_acc, loss_offset=0.0, bytes_per_step=None, **fields) -> tuple:
    frame = runs([*per_seed("ssgd", ssgd_acc, **fields), *per_seed("ddp", ddp_acc, **fields)],
                 **{"param.model_parameters": "1000", "param.train.test_subset": "2000"})
    per_step = bytes_per_step or {"ssgd": 1500.0, "ddp": 1500.0}
    points = [(name, seed, metric, step, value)
              for name in ("ssgd", "ddp") for seed in range(len(ssgd_acc)) for step in (10, 20, 30)
              for metric, value in (("train_loss", 1.0 / step + seed * 0.05 + (loss_offset if name == "ssgd" else 0)),
                                    ("bytes_sent", per_step[name] * step))]
    return frame, points


@pytest.mark.parametrize(("offset", "verdict"), [(0.0, "reproduced"), (0.08, "partly reproduced"),
                                                 (0.5, "contradicted")])
def test_loss_gap_against_the_seed_spread(offset, verdict):
    frame, points = pair([84.0, 84.2], [84.0, 84.2], loss_offset=offset)
    found = baseline.loss_gap(evidence(frame, points))
    # seed 1's curve lies 0.05 above seed 0's: the spread; the gap is the offset
    assert found["gap"] == pytest.approx(offset) and found["allowed"] == pytest.approx(0.05)
    assert found["seeds_compared"] == [0, 1]
    assert claims(baseline, frame, points)[LOSS].verdict == verdict


def test_accuracy_difference_is_paired_with_a_test_set_floor():
    frame, points = pair([84.0, 86.0, 85.0], [84.1, 86.1, 85.1])
    found = baseline.accuracy_difference(evidence(frame, points))
    assert found["diff"] == pytest.approx(-0.1) and found["se_seed"] == pytest.approx(0.0, abs=1e-9)
    p = (85.0 + 85.1) / 200  # the mean accuracy, binomial over 2,000 test images, 3 paired seeds
    assert found["se_test"] == pytest.approx(100 * math.sqrt(p * (1 - p) / 2000 * 2 / 3))
    row = claims(baseline, frame, points)[ACCURACY]
    assert row.verdict == "reproduced" and "difference -0.10 pp (paired over seeds 0, 1, 2" in row.ours


def test_accuracy_far_apart_is_contradicted():
    frame, points = pair([80.0, 82.0, 81.0], [84.1, 86.1, 85.1])
    assert claims(baseline, frame, points)[ACCURACY].verdict == "contradicted"


def test_bytes_against_one_ring_allreduce():
    expected = baseline.ring_allreduce_bytes(1000, 4)
    assert expected == 4.0 * (2 * 1000 - 250 - 250)  # 4 chunks of 250; the last received of each phase not sent
    frame, points = pair([84.0, 84.2], [84.0, 84.2], bytes_per_step={"ssgd": expected, "ddp": expected})
    assert claims(baseline, frame, points)[BYTES].verdict == "consistent"
    frame, points = pair([84.0, 84.2], [84.0, 84.2], bytes_per_step={"ssgd": expected * 1.1, "ddp": expected})
    assert claims(baseline, frame, points)[BYTES].verdict == "inconsistent"


def test_bytes_without_what_they_are_measured_from_are_not_measured():
    frame, points = pair([84.0, 84.2], [84.0, 84.2])
    row = claims(baseline, frame.drop(columns="param.model_parameters"), points)[BYTES]
    assert (row.verdict, row.ours) == ("not measured", "not measured: the runs logged no model_parameters")
    row = claims(baseline, frame, [p for p in points if p[2] != "bytes_sent"])[BYTES]
    assert (row.verdict, row.ours) == ("not measured", "not measured: no bytes_sent history of two logged steps")
