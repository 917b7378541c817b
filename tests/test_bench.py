"""Each benchmark runs with tiny sizes and writes valid JSON (with its ratio fields) and markdown."""

import json

import pytest

from commlab.registry import BENCHMARKS

TINY_RUN = ["--workers", "2", "--dataset", "synthetic", "--model", "mlp", "--batch-size", "16"]


def _read(path):
    data = json.loads(path.read_text())
    assert path.with_suffix(".md").exists()
    assert data["environment"]["torch"]
    return data


def test_registered():
    for name in ("collectives", "throughput", "time_to_accuracy", "scaling", "selection", "syncs"):
        assert name in BENCHMARKS.names()


def test_help_exits_cleanly(capsys):
    for name in ("collectives", "throughput", "time_to_accuracy", "scaling", "selection", "syncs"):
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
    # Both methods move one dense allreduce of the same model per step (rank 0 of 2: n elements sent).
    assert ddp["bytes_per_step"] == pytest.approx(summary[("loopback", "ssgd")]["bytes_per_step"])
    assert summary[("loopback", "ssgd")]["collectives_per_step"] == pytest.approx(1.0)


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
    assert [c["step"] for c in ssgd["curve"]] == [8, 16]
