"""Each benchmark runs with tiny sizes and writes valid JSON (with its ratio fields) and markdown."""

import json
import os
import shutil

import pytest
import torch

from commlab.registry import BENCHMARKS

TINY_RUN = ["--workers", "2", "--dataset", "synthetic", "--model", "mlp", "--batch-size", "16"]


def _read(path):
    data = json.loads(path.read_text())
    assert path.with_suffix(".md").exists()
    assert data["environment"]["torch"]
    return data


def test_registered():
    for name in ("collectives", "throughput", "time_to_accuracy", "scaling", "wire", "loader", "selection", "syncs"):
        assert name in BENCHMARKS.names()


def test_help_exits_cleanly(capsys):
    for name in ("collectives", "throughput", "time_to_accuracy", "scaling", "wire", "loader", "selection", "syncs"):
        with pytest.raises(SystemExit) as exc:
            BENCHMARKS.get(name)(["--help"], None)
        assert exc.value.code == 0
        assert "usage" in capsys.readouterr().out


def test_collectives_tiny(tmp_path):
    out = tmp_path / "collectives.json"
    assert BENCHMARKS.get("collectives")(["--workers", "2", "--sizes", "1K", "4K", "--repeats", "2",
                                          "--warmup", "1", "--check-mbit", "0"], str(out)) == 0
    data = _read(out)
    assert [r["elements"] for r in data["sizes"]] == [1024, 4096]
    for row in data["sizes"]:
        assert row["ratio"] == pytest.approx(row["communicator_ms"] / row["raw_ms"])
        assert row["raw_samples"] == row["communicator_samples"] == 2
        assert row["ratio_paired"] > 0 and row["bookkeeping_pct"] > 0
    assert data["bookkeeping_us_per_call"] > 0
    assert "skipped" in data["network_check"]
    for row in data["sizes"]:  # the Communicator's own record of each measured call (host time here)
        assert row["clock_samples"] == 2 and 0 < row["clock_ms"]
        assert row["clock_over_completion"] == pytest.approx(row["clock_ms"] / row["communicator_ms"])


def test_collectives_flags_a_shaped_allreduce_far_above_its_ring_bound():
    """The ceiling on measured / ring bound is the benchmark's to report (a loaded machine can
    break it; no test asserts it): at most 2x reads as link-limited, above it is flagged."""
    from commlab.bench.collectives import BOUND_CEILING, bound_line

    assert BOUND_CEILING == 2.0
    check = {"bound_ceiling": 2.0}
    within = bound_line({**check, "measured_over_bound": 1.068, "bandwidth_limited": True})
    assert "1.07" in within and "within 2x" in within and "FLAG" not in within
    above = bound_line({**check, "measured_over_bound": 2.5, "bandwidth_limited": False})
    assert above.startswith("FLAG:") and "2.50" in above and "above 2x" in above


@pytest.mark.netem
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="emulated links need root and iproute2")
def test_collectives_network_check_reports_the_ratio_to_the_ring_bound(tmp_path):
    """On emulated links the check records and prints the shaped allreduce over its ring bound
    (2(P-1)/P n floats of 4 bytes at the nominal rate), whatever the machine's load makes of it."""
    out = tmp_path / "collectives.json"
    assert BENCHMARKS.get("collectives")(["--workers", "2", "--sizes", "1K", "--repeats", "1", "--warmup", "0",
                                          "--check-mbit", "1000", "--check-elements", "256K",
                                          "--check-repeats", "1"], str(out)) == 0
    check = _read(out)["network_check"]
    shaped = check["rows"][-1]
    bound_ms = 2 * (2 - 1) / 2 * 2**18 * 4 / (1000 * 1e6 / 8) * 1e3
    assert shaped["network"] == "1000Mbit" and shaped["predicted_nominal_ms"] == pytest.approx(bound_ms)
    assert check["measured_over_bound"] == pytest.approx(shaped["raw_ms"] / bound_ms)
    assert check["bandwidth_limited"] == (check["measured_over_bound"] <= 2.0)
    assert f"ring bound (nominal rate): {check['measured_over_bound']:.2f}" in out.with_suffix(".md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_collectives_on_nccl_skips_without_cuda(tmp_path, capsys):
    out = tmp_path / "collectives.json"
    assert BENCHMARKS.get("collectives")(["--backend", "nccl", "--sizes", "1K"], str(out)) == 0
    data = _read(out)
    assert (data["backend"], data["skipped"]) == ("nccl", "no CUDA device on this machine (NCCL runs on GPUs)")
    assert "sizes" not in data
    assert "--backend nccl skipped: no CUDA device" in capsys.readouterr().out


@pytest.fixture(scope="module")
def throughput_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "throughput.json"
    rc = BENCHMARKS.get("throughput")([*TINY_RUN, "--methods", "ssgd", "ddp", "--networks", "loopback",
                                       "--max-steps", "6", "--log-every", "2"], str(out))
    assert rc == 0
    return out


def test_throughput_tiny(throughput_json):
    data = _read(throughput_json)
    summary = {(r["network"], r["method"]): r for r in data["summary"]}
    assert summary[("loopback", "ssgd")]["ratio_to_ssgd"] == pytest.approx(1.0)
    ddp = summary[("loopback", "ddp")]
    assert ddp["ratio_to_ssgd"] == pytest.approx(ddp["samples_per_s"] / summary[("loopback", "ssgd")]["samples_per_s"])
    assert data["ssgd_over_ddp"]["loopback"] == pytest.approx(1 / ddp["ratio_to_ssgd"])
    # Both methods move one dense allreduce of the same model per step (rank 0 of 2: n elements sent).
    assert ddp["bytes_per_step"] == pytest.approx(summary[("loopback", "ssgd")]["bytes_per_step"])
    assert summary[("loopback", "ssgd")]["collectives_per_step"] == pytest.approx(1.0)
    # ddp_bf16 runs beside them, the strongest dense baseline: half of ssgd's bytes (2 per element)
    assert data["methods"] == ["ssgd", "ddp", "ddp_bf16"]
    bf16 = summary[("loopback", "ddp_bf16")]
    assert bf16["bytes_per_step"] == pytest.approx(summary[("loopback", "ssgd")]["bytes_per_step"] / 2)
    fastest = max(("ssgd", "ddp", "ddp_bf16"), key=lambda m: summary[("loopback", m)]["samples_per_s"])
    for entry in summary.values():
        assert entry["strongest_dense"] == fastest
        assert entry["ratio_to_strongest_dense"] == pytest.approx(
            entry["samples_per_s"] / summary[("loopback", fastest)]["samples_per_s"])


def test_throughput_counterbalances_the_order_and_keeps_each_repeats_ratio(monkeypatch):
    """Odd repeats run the methods in reverse; every ratio within a repeat divides by the same
    repeat's ssgd (fake runs whose samples/s is fixed per method and repeat)."""
    import commlab.bench.throughput as throughput

    rates = {("ssgd", 0): 100.0, ("ddp", 0): 125.0, ("oktopk", 0): 150.0,
             ("ssgd", 1): 80.0, ("ddp", 1): 80.0, ("oktopk", 1): 60.0,
             ("ssgd", 2): 90.0, ("ddp", 2): 100.0, ("oktopk", 2): 99.0}
    order = []

    def fake_run(config, workdir, net=None):
        method = config["method"]
        rate = rates[method, order.count(method)]
        order.append(method)
        return {"seconds": 1.0, "points": [rate], "final": {}}

    monkeypatch.setattr(throughput, "run_training", fake_run)
    monkeypatch.setattr(throughput, "steady_config", lambda args, method, workers: ({"method": method, "train": {}}, 0))
    keys = ("step_s", "compute_s", "collective_s", "blocked_s", "comm_s", "bytes_per_step", "collectives_per_step",
            "reductions_per_step")
    monkeypatch.setattr(throughput, "step_summary",
                        lambda points, *a, **k: {"samples_per_s": points[0], **dict.fromkeys(keys, 1.0)})
    args = type("Args", (), {"repeats": 3, "test_subset": 10, "batch_size": 16})()
    rows, skipped = throughput.measure_methods(args, ["ssgd", "ddp", "oktopk"], ["loopback"], 4, workdir=None)
    assert not skipped
    assert order == ["ssgd", "ddp", "oktopk", "oktopk", "ddp", "ssgd", "ssgd", "ddp", "oktopk"]
    assert [(r["method"], r["repeat"]) for r in rows[3:6]] == [("oktopk", 1), ("ddp", 1), ("ssgd", 1)]
    table = {e["method"]: e for e in throughput.summarise(rows, ["ssgd", "ddp", "oktopk"], ["loopback"])}
    assert table["oktopk"]["ratio_per_repeat"] == pytest.approx([1.5, 0.75, 1.1])
    assert table["oktopk"]["ratio_to_ssgd"] == pytest.approx(99.0 / 90.0)  # the ratio of the medians
    assert table["ssgd"]["ratio_per_repeat"] == [1.0, 1.0, 1.0]
    assert throughput.per_repeat_ratios(rows, "loopback", "ssgd", reference="ddp") == pytest.approx([0.8, 1.0, 0.9])


def test_throughput_names_the_strongest_dense_baseline_per_network():
    """The fastest of ssgd, ddp and ddp_bf16 on each network, and every method's rate over it."""
    import commlab.bench.throughput as throughput

    assert throughput.with_dense_baselines(["ssgd", "oktopk"]) == ["ssgd", "ddp", "ddp_bf16", "oktopk"]
    assert throughput.with_dense_baselines(["ssgd", "ddp_bf16", "kstep"]) == ["ssgd", "ddp", "ddp_bf16", "kstep"]
    rates = {("loopback", "ssgd"): 100.0, ("loopback", "ddp"): 110.0, ("loopback", "ddp_bf16"): 105.0,
             ("loopback", "oktopk"): 90.0, ("100Mbit", "ssgd"): 20.0, ("100Mbit", "ddp"): 21.0,
             ("100Mbit", "ddp_bf16"): 35.0, ("100Mbit", "oktopk"): 42.0}
    rows = [{"network": net, "method": method, "repeat": 0, "samples_per_s": rate}
            for (net, method), rate in rates.items()]
    methods = ["ssgd", "ddp", "ddp_bf16", "oktopk"]
    table = {(e["network"], e["method"]): e for e in throughput.summarise(rows, methods, ["loopback", "100Mbit"])}
    assert {net: table[net, "oktopk"]["strongest_dense"] for net in ("loopback", "100Mbit")} == {
        "loopback": "ddp", "100Mbit": "ddp_bf16"}
    assert table["loopback", "oktopk"]["ratio_to_strongest_dense"] == pytest.approx(90 / 110)
    assert table["100Mbit", "oktopk"]["ratio_to_strongest_dense"] == pytest.approx(42 / 35)
    assert table["100Mbit", "oktopk"]["ratio_to_ssgd"] == pytest.approx(42 / 20)


def test_time_to_accuracy_against_the_strongest_dense_baseline():
    from commlab.bench.time_to_accuracy import add_speedups

    results = [{"method": "ssgd", "reached": True, "seconds": 100.0},
               {"method": "ddp_bf16", "reached": True, "seconds": 80.0},
               {"method": "ddp", "reached": False, "seconds": None},
               {"method": "kstep", "reached": True, "seconds": 40.0},
               {"method": "oktopk", "reached": False, "seconds": None}]
    add_speedups(results)
    by = {r["method"]: r for r in results}
    assert by["kstep"]["speedup_vs_ssgd"] == pytest.approx(2.5)
    assert (by["kstep"]["strongest_dense"], by["kstep"]["speedup_vs_strongest_dense"]) == ("ddp_bf16", 2.0)
    assert "speedup_vs_strongest_dense" not in by["oktopk"] and "speedup_vs_ssgd" not in by["ddp"]


def test_scaling_from_throughput(throughput_json, tmp_path):
    out = tmp_path / "scaling.json"
    rc = BENCHMARKS.get("scaling")(["--profiles", str(throughput_json), "--no-validate",
                                    "--workers-list", "4", "64", "1024", "--links", "1Gbit", "10Gbit"], str(out))
    assert rc == 0
    data = _read(out)
    assert "model" in data["label"]
    preds = data["predictions_laptop"]
    assert {(p["method"], p["workers"], p["link"]) for p in preds} >= {("ssgd", 1024, "10Gbit"), ("ddp", 4, "1Gbit")}
    for p in preds:
        assert p["kind"] == "model" and p["step_s"] == pytest.approx(p["compute_s"] + p["comm_s"])
        if p["method"] == "ssgd":
            assert p["speedup_vs_dense"] == pytest.approx(1.0)
    assert data["ratio_matching"] and all(r["matching_mbit"] > 0 for r in data["ratio_matching"])
    assert "skipped" in data["gpu"] or data["gpu"]["models"]


def test_time_to_accuracy_tiny(tmp_path):
    out = tmp_path / "tta.json"
    rc = BENCHMARKS.get("time_to_accuracy")([*TINY_RUN, "--methods", "ssgd", "--network", "loopback",
                                             "--train-subset", "256", "--test-subset", "128", "--epochs", "2",
                                             "--target", "0"], str(out))
    assert rc == 0
    data = _read(out)
    (ssgd,) = data["results"]
    assert ssgd["reached"] and ssgd["step"] == 8, ssgd  # 256 / (2 x 16) steps: the first evaluation
    assert ssgd["speedup_vs_ssgd"] == pytest.approx(1.0)
    assert (ssgd["strongest_dense"], data["strongest_dense"]) == ("ssgd", "ssgd")  # the only dense baseline run
    assert [c["step"] for c in ssgd["curve"]] == [8, 16]


def _wire_run(method, accounted, payload, messages, log_points=2, steps=8, workers=2, ops=None):
    per_rank = {"bytes_sent": accounted / workers, "messages_sent": messages / workers,
                "wire_tx_payload": payload / workers, "wire_tx_bytes": payload / workers + 660}
    return {"network": "unshaped", "method": method, "workers": workers, "repeat": 0,
            "wire": {"steps": steps, "log_points": log_points, "per_rank": [per_rank] * workers,
                     "sum": {"bytes_sent": accounted, "messages_sent": messages, "wire_tx_payload": payload,
                             "wire_tx_bytes": payload + 660 * workers,
                             "by_op": ops or {"all_reduce": {"bytes_sent": accounted, "messages_sent": messages}}},
                     "run": {"sum": {"wire_tx_bytes": 5e6}}}}


def test_wire_table_explains_each_gap_by_name():
    from commlab.bench.wire_vs_accounted import CONTROL, GLOO_FRAMING_BYTES, SPARSE_METRICS, allreduce_wire, table

    control = allreduce_wire(CONTROL[1], CONTROL[2], 2) * 2 / 8  # 2 log points over 8 steps, all ranks
    metrics = allreduce_wire(SPARSE_METRICS[1], SPARSE_METRICS[2], 2) * 2 / 8  # a sparse method's own
    sources = [{"model": "mlp", "runs": [
        # dense: 1 MB accounted, the wire adds framing and the control allreduce only
        _wire_run("ssgd", 1e6, 1e6 + GLOO_FRAMING_BYTES * 8 + control, 8),
        # small messages: framing is 40% of the payload, named; nothing unexplained
        _wire_run("gtopk", 2000, 2000 + GLOO_FRAMING_BYTES * 6 + control + metrics, 6,
                  ops={"send": {"bytes_sent": 1500, "messages_sent": 4}, "broadcast": {"bytes_sent": 500,
                                                                                      "messages_sent": 2}}),
        # the wire carries twice the accounting: flagged
        _wire_run("qsgd", 1e5, 2e5, 4),
    ]}]
    rows = {r["method"]: r for r in table(sources, ["ssgd", "gtopk", "qsgd", "kstep"])}
    ssgd = rows["ssgd"]
    assert ssgd["within_tolerance"] and ssgd["payload_over_expected"] == pytest.approx(1.0)
    assert ssgd["accounted"] == 5e5 and ssgd["algorithms"] == "ring allreduce 100%"  # per worker
    gtopk = rows["gtopk"]
    assert not gtopk["within_tolerance"] and gtopk["payload_over_expected"] == pytest.approx(1.0)
    assert "gloo framing 3.0 msgs x 144 B" in gtopk["note"] and "the loop's control allreduce" in gtopk["note"]
    assert "UNEXPLAINED" not in gtopk["note"] and gtopk["algorithms"] == "point-to-point 75%, binomial tree 25%"
    assert "metrics allreduce" in gtopk["note"]  # a sparse method: its metrics allreduce is named too
    assert rows["qsgd"]["payload_over_accounted"] == pytest.approx(2.0) and "UNEXPLAINED" in rows["qsgd"]["note"]
    assert rows["kstep"]["note"].startswith("not measured") and ssgd["workers"] == 2
    why = table(sources, ["kstep"], {"kstep": "not measured: emulated links unavailable (not root)"})
    assert why == [{"method": "kstep", "note": "not measured: emulated links unavailable (not root)"}]


def test_wire_without_emulated_links_still_writes_the_table(tmp_path, monkeypatch):
    """--run-missing where no link can be emulated: the files' methods are tabled, the others say
    why they are not measured, and nothing fails."""
    import commlab.bench.wire_vs_accounted as wire

    monkeypatch.setattr(wire, "emulation_unavailable", lambda: "not root")
    source = tmp_path / "throughput.json"
    source.write_text(json.dumps({"model": "mlp", "runs": [_wire_run("ssgd", 1e6, 1.01e6, 8)]}))
    out = tmp_path / "wire.json"
    assert BENCHMARKS.get("wire")(["--from", str(source), "--run-missing", "--methods", "ssgd", "kstep"],
                                  str(out)) == 0
    rows = {r["method"]: r for r in _read(out)["rows"]}
    assert rows["ssgd"]["within_tolerance"] and rows["ssgd"]["model"] == "mlp"
    assert rows["kstep"]["note"] == "not measured: emulated links unavailable (not root)"


@pytest.mark.netem
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="emulated links need root and iproute2")
def test_wire_on_emulated_links(tmp_path):
    """Two workers on an unshaped emulated link: dense SGD's wire payload is its accounted volume
    plus what the table names, within 10%."""
    out = tmp_path / "wire.json"
    assert BENCHMARKS.get("wire")([*TINY_RUN, "--methods", "ssgd", "--max-steps", "6", "--log-every", "2"],
                                  str(out)) == 0
    data = _read(out)
    (row,) = data["rows"]
    assert row["method"] == "ssgd" and row["network"] == "unshaped" and row["within_tolerance"]
    assert row["payload_over_accounted"] == pytest.approx(1.0, abs=0.1)
    assert row["payload_over_expected"] == pytest.approx(1.0, abs=0.02)
    assert row["raw"] > row["payload"] > row["accounted"] > 0


def test_loader_tiny(tmp_path):
    """Both loaders read a given folder side by side; the ratio is the quotient of their medians."""
    from commlab.bench.loader import generate_image_folder

    folder = generate_image_folder(tmp_path / "images", classes=2, per_class=8, val_per_class=1)
    out = tmp_path / "loader.json"
    assert BENCHMARKS.get("loader")(["--folder", str(folder), "--workers", "1", "--batch", "4", "--size", "32",
                                     "--warmup", "1", "--batches", "2", "--repeats", "2"], str(out)) == 0
    data = _read(out)
    rows = {r["loader"]: r for r in data["results"]}
    assert set(rows) == {"streamed", "torchvision"} and all(len(r["repeats"]) == 2 for r in rows.values())
    assert data["ratio"] == pytest.approx(rows["streamed"]["images_per_s"] / rows["torchvision"]["images_per_s"])


def test_wire_table_names_a_servers_replies_in_flight_and_no_more():
    """A parameter server's replies reach the accounting at rank 0's next step: at a window's edges
    up to one reply per remote worker, accounted / (2 steps) per worker and step, is named; a gap
    beyond it is not."""
    from commlab.bench.wire_vs_accounted import CONTROL, GLOO_FRAMING_BYTES, allreduce_wire, table

    control = allreduce_wire(CONTROL[1], CONTROL[2], 2) * 2 / 8
    edge = 5e5 / (2 * 8) * 2  # the allowance of both workers: accounted per worker (5e5) / (2 x 8 steps)
    framing = GLOO_FRAMING_BYTES * 8 + control
    near = table([{"model": "mlp", "runs": [_wire_run("asgd", 1e6, 1e6 + framing + 0.9 * edge, 8)]}], ["asgd"])[0]
    far = table([{"model": "mlp", "runs": [_wire_run("asgd", 1e6, 1e6 + framing + 3 * edge, 8)]}], ["asgd"])[0]
    assert "the server's replies in flight at the window's edges up to 6.2%" in near["note"]
    assert "UNEXPLAINED" not in near["note"] and "UNEXPLAINED" in far["note"]


@pytest.mark.parametrize("when", ["before_the_runs", "during_a_run"])
def test_sigterm_to_a_benchmark_removes_its_scratch_folder(tmp_path, when):
    """A cancelled job's benchmark (Snakemake and SLURM send SIGTERM) exits 143 and leaves neither
    its scratch folder (runs, logs, MLflow store) nor multiprocessing's: whether the signal lands
    while the store is being made, before any worker, or while a run's workers train."""
    import signal
    import subprocess
    import sys
    import time

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    argv = [sys.executable, "-m", "commlab", "bench", "throughput", *TINY_RUN, "--methods", "ssgd",
            "--networks", "loopback", "--max-steps", "100000", "--out-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(argv, env={**os.environ, "TMPDIR": str(scratch)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready = (lambda: list(scratch.glob("commlab-bench-*"))) if when == "before_the_runs" else \
        (lambda: list(scratch.glob("commlab-bench-*/run*/train.log")))
    deadline = time.monotonic() + 120
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready(), f"the benchmark never got there (rc {proc.poll()})"
    if when == "during_a_run":
        time.sleep(2)  # the workers are forked and loading
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM: stopped" in err
    assert not list(scratch.glob("commlab-bench-*")) and not list(scratch.glob("pymp-*")), \
        sorted(p.name for p in scratch.iterdir())
