"""K-step averaging's descendants in the K-step report (commlab.report.descendants) on hand-made
runs and benchmark files: the section's table (reductions, bytes, largest allreduce, blocked time on
an emulated link) and each claim with a case for every verdict it can reach."""

from __future__ import annotations

import pytest

from commlab.report import claims_kstep as kstep
from commlab.report import descendants
from evidence import claims, evidence, per_seed, runs, settled, throughput, write_bench

DILOCO = "DiLoCo reaches synchronous training's accuracy with H times fewer communications"
OUTER = "DiLoCo's outer Nesterov optimizer beats plain averaging (K-step, FedAvg) at the same communication"
STREAMING = "Streaming DiLoCo reaches DiLoCo's accuracy"
PEAK = "Synchronising one fragment at a time lowers the peak bandwidth F times"
CNN = {"0": 164_832, "1": 52_874}  # the laptop CNN's 4 layers in 2 strided fragments
DILOCO_PARAMS = {"param.method_params.period": "64", "param.schedule.period": "64",
                 "param.method_params.outer_optimizer": "nesterov", "param.method_params.outer_lr": "0.7",
                 "param.method_params.outer_momentum": "0.9"}


def section(accuracies: dict[str, list[float]], fragments: dict[str, int] | None = None) -> tuple:
    """The laptop grid's runs of the section, 3 seeds each, settled evaluations, with the params such
    runs log (kstep's ``k`` is logged as ``period``; every one logs ``schedule.period``); run name ->
    accuracies per seed."""
    common = {"param.model_parameters": "217706", "workers": 6}
    spec = {
        "ssgd_msgd": {"method": "ssgd", "reductions_global": 279.0, "bytes_sent": 2.5e8},
        "kstep_msgd_k64": {"method": "kstep", "reductions_global": 5.0, "bytes_sent": 4.5e6,
                           "param.method_params.period": "64", "param.method_params.momentum": "0.0",
                           "param.schedule.period": "64"},
        "kstepmom_msgd_k64": {"method": "kstep", "reductions_global": 5.0, "bytes_sent": 4.5e6,
                              "param.method_params.period": "64", "param.method_params.momentum": "0.5",
                              "param.method_params.block_lr": "1.0", "param.schedule.period": "64"},
        "diloco_msgd_k64": {"method": "diloco", "reductions_global": 5.0, "bytes_sent": 4.5e6, **DILOCO_PARAMS},
        "sdiloco_msgd_k64": {"method": "streaming_diloco", "reductions_global": 9.0, "bytes_sent": 2.3e6,
                             **DILOCO_PARAMS, "param.method_params.fragments": "2",
                             "param.method_params.outer_precision": "bf16", "param.method_params.delay": "1",
                             "param.method_params.alpha": "0.5", "param.method_params.fragment_pattern": "strided",
                             **{f"param.fragment.{f}.numel": str(n) for f, n in (fragments or CNN).items()}},
    }
    rows = [row for name, acc in accuracies.items() for row in per_seed(name, acc, **spec[name], **common)]
    frame = runs(rows)
    return frame, settled(frame)


EVEN = [84.0, 84.5, 83.8]


def test_the_sections_table_counts_reductions_bytes_and_the_time_they_block(tmp_path):
    write_bench(tmp_path, "throughput", throughput([("loopback", "ssgd", 1.0), ("100Mbit", "ssgd", 1.0),
                                                    ("100Mbit", "kstep", 1.4), ("100Mbit", "streaming_diloco", 1.6)]))
    payload = (tmp_path / "bench" / "throughput.json").read_text()
    import json

    bench = json.loads(payload)
    for row in bench["summary"]:  # one reduction every 8 steps (kstep), a fragment every 4 (streaming)
        row["reductions_per_step"] = {"kstep": 0.125, "streaming_diloco": 0.25}.get(row["method"], 1.0)
        row["comm_s"] = {"kstep": 0.02, "streaming_diloco": 0.005}.get(row["method"], row["comm_s"])
    (tmp_path / "bench" / "throughput.json").write_text(json.dumps(bench))
    frame, points = section({name: EVEN for name in ("ssgd_msgd", "kstep_msgd_k64", "kstepmom_msgd_k64",
                                                     "diloco_msgd_k64", "sdiloco_msgd_k64")})
    table = descendants.descendants_table(evidence(frame, points, out_dir=tmp_path))
    assert list(table.index) == ["kstep_msgd_k64", "kstepmom_msgd_k64", "diloco_msgd_k64", "sdiloco_msgd_k64"]
    assert table.outer.to_dict() == {
        "kstep_msgd_k64": "average", "kstepmom_msgd_k64": "block momentum 0.5, block lr 1.0",
        "diloco_msgd_k64": "outer nesterov lr 0.7 momentum 0.9",
        "sdiloco_msgd_k64": "outer nesterov lr 0.7 momentum 0.9; 2 fragments (strided), tau 1, alpha 0.5, bf16"}
    assert table.model_syncs.tolist() == [5.0, 5.0, 5.0, 4.5]
    assert table.largest_allreduce_bytes.tolist() == [4 * 217_706] * 3 + [2 * 164_832]
    # 0.16 s per reduction (0.02 s per step over 0.125 reductions per step); DiLoCo's message is K-step's
    assert table["blocked_s_per_reduction_100Mbit"].tolist() == pytest.approx([0.16, 0.16, 0.16, 0.02])
    assert table["blocked_s_100Mbit"].tolist() == pytest.approx([0.8, 0.8, 0.8, 0.18])


def test_without_a_benchmark_the_blocked_time_is_not_measured():
    frame, points = section({"kstep_msgd_k64": EVEN, "diloco_msgd_k64": EVEN})
    table = descendants.descendants_table(evidence(frame, points))
    assert table["blocked_s_link"].isna().all()


@pytest.mark.parametrize(("diloco", "sync", "verdict"), [
    ([84.1, 83.2, 85.0], [84.0, 83.5, 84.4], "reproduced"),
    ([80.5, 81.0, 80.2], [84.0, 84.3, 83.9], "contradicted"),
    ([80.0, 86.0, 83.0], [82.0, 84.0, 83.3], "inconclusive"),
])
def test_diloco_against_synchronous_training(diloco, sync, verdict):
    frame, points = section({"ssgd_msgd": sync, "diloco_msgd_k64": diloco})
    row = claims(kstep, frame, points)[DILOCO]
    assert row.verdict == verdict
    assert row.ours.endswith("; global reductions 5 vs 279 (56x fewer at H = 64)")
    assert "(paired over seeds 0, 1, 2;" in row.note and "4 outer steps come before the last" in row.note


@pytest.mark.parametrize(("diloco", "verdict"), [
    ([85.0, 85.6, 84.9], "reproduced"),
    ([84.1, 84.6, 83.9], "partly reproduced"),
    ([82.0, 82.4, 81.9], "contradicted"),
])
def test_the_outer_optimizer_against_plain_averaging_at_the_same_reductions(diloco, verdict):
    frame, points = section({"kstep_msgd_k64": EVEN, "kstepmom_msgd_k64": EVEN, "diloco_msgd_k64": diloco})
    found = descendants.outer_against_averaging(evidence(frame, points))
    assert list(found["gain"]) == pytest.approx([d - e for d, e in zip(diloco, EVEN, strict=True)])
    row = claims(kstep, frame, points)[OUTER]
    assert row.verdict == verdict
    assert row.ours.endswith("global reductions 5 vs 5; beside them, reduction momentum: kstepmom_msgd_k64 84.1 ± "
                             "0.36 (n=3)")


@pytest.mark.parametrize(("streaming", "verdict"), [([84.1, 84.3, 83.9], "reproduced"),
                                                    ([81.0, 81.4, 80.9], "contradicted")])
def test_streaming_against_diloco(streaming, verdict):
    frame, points = section({"diloco_msgd_k64": EVEN, "sdiloco_msgd_k64": streaming})
    row = claims(kstep, frame, points)[STREAMING]
    assert row.verdict == verdict
    assert row.ours.endswith("global reductions 9 vs 5 (one per fragment)")
    assert row.note.endswith("outer nesterov lr 0.7 momentum 0.9; 2 fragments (strided), tau 1, alpha 0.5, bf16")


@pytest.mark.parametrize(("fragments", "verdict", "why"), [
    (CNN, "not testable at this scale", f"this setting can show at most {217_706 / 164_832:.4g}, not at least 2"),
    ({"0": 108_853, "1": 108_853}, "reproduced", "2: at least 2"),
])
def test_the_peak_bandwidth_is_bounded_by_the_largest_fragment(fragments, verdict, why):
    frame, points = section({"sdiloco_msgd_k64": EVEN}, fragments)
    row = claims(kstep, frame, points)[PEAK]
    assert row.verdict == verdict and row.note.startswith(why)
    largest = max(fragments.values())
    assert row.ours == (f"sdiloco_msgd_k64: largest allreduce {largest:,} of 217,706 elements "
                        f"({largest / 217_706:.0%}, F = 2); with bf16 on the wire "
                        f"{4 * 217_706 / (2 * largest):.2f}x fewer bytes than DiLoCo's float32 model")


def test_without_the_runs_the_claims_are_not_measured():
    frame, points = section({"ssgd_msgd": EVEN, "kstep_msgd_k64": EVEN})
    table = claims(kstep, frame, points)
    assert {table[c].verdict for c in (DILOCO, OUTER, STREAMING, PEAK)} == {"not measured"}


def test_the_k_step_claims_know_the_descendants_period_and_keep_them_apart():
    frame, points = section({name: EVEN for name in ("ssgd_msgd", "kstep_msgd_k64", "kstepmom_msgd_k64",
                                                     "diloco_msgd_k64", "sdiloco_msgd_k64")})
    info = kstep.describe(evidence(frame, points)).groupby("name").first()
    assert info.k_global.to_dict() == {"diloco_msgd_k64": 64, "kstep_msgd_k64": 64, "kstepmom_msgd_k64": 64,
                                       "sdiloco_msgd_k64": 64, "ssgd_msgd": 1}
    assert info.family.to_dict() == {"diloco_msgd_k64": "DiLoCo", "kstep_msgd_k64": "K-step",
                                     "kstepmom_msgd_k64": "K-step+momentum", "sdiloco_msgd_k64": "Streaming DiLoCo",
                                     "ssgd_msgd": "synchronous"}
