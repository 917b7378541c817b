"""Emulated networks: shaping is effective, and nothing (namespace, link, process) outlives a run.

Needs root and iproute2; skipped otherwise (the checks of the error messages run everywhere).
The allreduce check asserts the physical floor of the bandwidth-limited time only: no load can
make an allreduce beat its link, while a loaded machine can slow it down at will. How close it
comes to that floor is measured, printed and flagged by ``commlab bench collectives``.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml

from commlab.launch import launch, netem, run_in_network, wire_logs
from commlab.launch.netem import EmulatedNetwork, NetemError, NetworkSpec

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network emulation needs root and iproute2")
pytestmark = pytest.mark.netem


def host_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent has not reaped it yet).
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_spec_validation_names_the_bad_key():
    assert NetworkSpec.from_config(None) is None
    assert NetworkSpec.from_config({"bandwidth_mbit": 100}).bandwidth_mbit == 100
    with pytest.raises(ValueError, match="bandwidth_mbit"):
        NetworkSpec.from_config({"bandwidth_mbit": -1})
    with pytest.raises(ValueError, match="latency_ms"):
        NetworkSpec.from_config({"latency_ms": -2})
    with pytest.raises(ValueError, match="unknown key"):
        NetworkSpec.from_config({"bandwith": 100})


def test_preflight_messages(monkeypatch):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    with pytest.raises(NetemError, match="needs root"):
        netem.preflight()
    monkeypatch.setattr(netem.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(NetemError, match="iproute2 \\(tc not found\\)"):
        netem.preflight()


@needs_root
def test_network_is_shaped_verified_and_removed():
    before = host_links()
    net = EmulatedNetwork(3, NetworkSpec(bandwidth_mbit=200, latency_ms=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = net.up()
    try:
        assert set(net.namespaces()) <= set(netem.list_namespaces())
        assert host_links() == before  # every link lives inside the run's namespaces
        qdiscs = subprocess.run(["tc", "-n", net.namespace(1), "qdisc", "show", "dev", "eth0"],
                                capture_output=True, text=True).stdout
        assert "tbf" in qdiscs and "rate 200Mbit" in qdiscs
        # Verified, not assumed: the measured point-to-point rate cannot beat the configured one.
        assert 0 < params["network_measured_mbit"] <= 200 * 1.2
        if params["network_latency_emulated"]:
            assert "netem" in qdiscs
        else:  # this kernel has no sch_netem: the run says so and still shapes bandwidth
            assert any("NOT emulated" in str(w.message) for w in caught)
            assert "not emulated" in params["network_latency_note"]
    finally:
        net.down()
    assert not set(net.namespaces()) & set(netem.list_namespaces())
    assert host_links() == before


@needs_root
def test_failing_worker_stops_the_others_and_names_its_rank(capsys):
    net = EmulatedNetwork(3, NetworkSpec(bandwidth_mbit=1000, verify=False))
    net.up()
    code = ("import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.5); "
            "sys.exit(3) if r == 1 else time.sleep(120)")
    t0 = time.monotonic()
    try:
        rc = run_in_network(net, ["-c", code], fail_grace_s=2.0)
        pids = [p for ns in net.namespaces() for p in netem.namespace_pids(ns)]
    finally:
        net.down()
    assert rc == 3 and time.monotonic() - t0 < 30
    assert "worker rank 1 failed (exit code 3)" in capsys.readouterr().err
    assert pids == []  # the sleeping ranks were stopped before the network went down
    assert not set(net.namespaces()) & set(netem.list_namespaces())


def _config(tmp_path: Path, **extra) -> Path:
    config = {"method": "ssgd", "dataset": "synthetic", "model": "mlp", "workers": 2, "timeout_s": 60,
              "output_dir": str(tmp_path / "out"), "tracking": {"enabled": False},
              "train": {"epochs": 1, "batch_size": 16, "lr": 0.05, "max_steps": 4, "log_every": 2,
                        "test_subset": 128}, **extra}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@needs_root
def test_launch_normal_end_and_failing_run_leave_nothing(tmp_path):
    before_ns, before_links = set(netem.list_namespaces()), host_links()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = _config(tmp_path, network={"bandwidth_mbit": 1000},
                  tracking={"enabled": True, "uri": uri, "experiment": "netem"})
    assert launch(str(cfg), str(tmp_path / "sentinel.json")) == 0
    run_id = json.loads((tmp_path / "sentinel.json").read_text())["run_id"]
    # The link's numbers (setting and measured throughput) are metrics of the MLflow run, to chart.
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(run_id)
    assert run.data.metrics["network.bandwidth_mbit"] == run.data.metrics["network_bandwidth_mbit"] == 1000
    assert run.data.metrics["network_measured_mbit"] > 0 and "network_measured_mbit" not in run.data.params
    assert run.data.params["network_emulated"] == "True" and run.data.tags["network"].startswith("emulated")
    # The link's counters beside the accounting: rank 0's as metrics, every rank's summed by the launcher.
    assert run.data.metrics["wire_tx_bytes"] > run.data.metrics["bytes_sent"] > 0
    summary = json.loads((tmp_path / "out" / "wire" / "summary.json").read_text())
    assert len(summary["per_rank"]) == 2 and summary["sum"]["bytes_sent"] > 0
    assert summary["sum"]["wire_tx_payload"] == pytest.approx(summary["sum"]["bytes_sent"], rel=0.1)
    assert set(netem.list_namespaces()) <= before_ns and host_links() == before_links
    bad = _config(tmp_path, data_dir=str(tmp_path / "missing"), dataset="fashion_mnist")
    assert launch(str(bad), network_mbit=100) != 0  # every worker fails: no dataset
    assert set(netem.list_namespaces()) <= before_ns and host_links() == before_links


@needs_root
def test_sigterm_to_the_launcher_leaves_nothing(tmp_path):
    before_links = host_links()
    cfg = _config(tmp_path, network={"bandwidth_mbit": 1000})
    cfg_long = yaml.safe_load(cfg.read_text())
    cfg_long["train"].update(max_steps=100000, epochs=100)
    cfg.write_text(yaml.safe_dump(cfg_long))
    proc = subprocess.Popen([sys.executable, "-m", "commlab.launch", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefix = f"{netem.PREFIX}-{proc.pid}x"
    workers: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(workers) < 2:
        ours = [n for n in netem.list_namespaces() if n.startswith(prefix) and not n.endswith("-hub")]
        workers = [p for n in ours for p in netem.namespace_pids(n)]
        time.sleep(0.2)
    assert len(workers) == 2, "the workers did not start"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    assert not [n for n in netem.list_namespaces() if n.startswith(prefix)]
    assert not [p for p in workers if alive(p)]
    assert host_links() == before_links


@needs_root
def test_a_shaped_allreduce_never_beats_its_link(tmp_path):
    """10M floats, 4 ranks, 1 Gbit/s links: the ring moves 2(P-1)/P n floats through each link,
    so the allreduce cannot take less than that at the link's rate (less the token bucket's burst:
    the 0.8). Its ratio to the bound has no ceiling here (BOUND_CEILING in the benchmark)."""
    from commlab.bench.collectives import _measure_in

    n, workers, mbit = 10 * 2**20, 4, 1000.0
    with EmulatedNetwork(workers, NetworkSpec(bandwidth_mbit=mbit)) as net:
        row = _measure_in(net, workers, n, repeats=2, warmup=1, scratch=str(tmp_path))
    bound_s = 2 * (workers - 1) / workers * n * 4 / (mbit * 1e6 / 8)
    ratio = row["raw_ms"] / 1e3 / bound_s
    assert 0.8 <= ratio, f"measured {row['raw_ms']:.0f} ms vs bound {bound_s * 1e3:.0f} ms"


# One worker of the allreduce check below: the Communicator's accounting and the link's counters
# (sampled by CommStats.totals(), as at a log point) around R allreduces of N floats.
_ALLREDUCE_WORKER = """
import json, sys, time, torch
from commlab.core import Communicator, init_runtime, shutdown_runtime
n, repeats, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rt = init_runtime("gloo", 60)
comm = Communicator()
x = torch.ones(n)
comm.all_reduce(x)  # connections up, buffers warm
time.sleep(0.5)     # both ranks done, the last acknowledgements sent
a = comm.stats.totals()
for _ in range(repeats):
    comm.all_reduce(x)
time.sleep(0.5)
b = comm.stats.totals()
json.dump({k: b[k] - a[k] for k in b}, open(f"{out}/rank{rt.rank}.json", "w"))
shutdown_runtime()
"""


@needs_root
def test_allreduce_on_the_wire_is_the_accounted_formula_plus_headers(tmp_path):
    """2 emulated workers, 4 allreduces of 250k floats: each rank's link carries the accounted
    bytes (gloo's ring: n floats sent per rank at P = 2), gloo's framing per message and one set
    of Ethernet/IP/TCP headers per frame, nothing more."""
    from commlab.core.costs import GLOO_FRAMING_BYTES, ring_allreduce_cost, ring_allreduce_messages

    n, repeats = 250_000, 4
    with EmulatedNetwork(2, NetworkSpec(verify=False)) as net:
        before = net.counters()
        rc = run_in_network(net, ["-c", _ALLREDUCE_WORKER, str(n), str(repeats), str(tmp_path)],
                            log=str(tmp_path / "workers.log"))
        after = net.counters()
    assert rc == 0, (tmp_path / "workers.log").read_text()[-2000:]
    for rank in range(2):
        d = json.loads((tmp_path / f"rank{rank}.json").read_text())
        accounted = repeats * 4 * ring_allreduce_cost(n, 2, rank)[0]
        assert d["bytes_sent"] == accounted == repeats * 4 * n
        assert d["messages_sent"] == repeats * ring_allreduce_messages(n, 2, rank) == repeats * 4
        framing = GLOO_FRAMING_BYTES * d["messages_sent"]  # symmetric ring: as many received as sent
        headers = netem.FRAME_HEADER_BYTES * d["wire_tx_packets"]
        assert accounted < d["wire_tx_bytes"] <= accounted + framing + headers + 0.002 * accounted
        assert abs(wire_logs.payload(d) - accounted - framing) <= 0.002 * accounted
    # From outside, the namespaces' counters see the same link: what rank 0 sent, rank 1 received.
    whole = wire_logs.counters_delta(before, after)["per_rank"]
    assert whole[0]["wire_tx_bytes"] == pytest.approx(whole[1]["wire_rx_bytes"], rel=0.01)
    assert whole[0]["wire_tx_bytes"] > repeats * 4 * n


def test_wire_windows_per_rank_and_summed(tmp_path):
    def line(point, sent, tx, packets, ops):
        return {"point": point, "bytes_sent": sent, "bytes_recv": sent, "messages_sent": point * 2,
                "wire_tx_bytes": tx, "wire_rx_bytes": tx, "wire_tx_packets": packets, "wire_rx_packets": packets,
                "by_op": ops}

    for rank in range(2):
        lines = [line(0, 0, 500, 5, {}),
                 line(1, 1000 * (rank + 1), 2000 + 1000 * (rank + 1), 10, {"all_reduce": {"bytes_sent": 1000,
                                                                                          "messages_sent": 2}}),
                 line(2, 3000 * (rank + 1), 6000 * (rank + 1), 25, {"all_reduce": {"bytes_sent": 3000,
                                                                                   "messages_sent": 4}})]
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    logs = wire_logs.read_logs(tmp_path, 2)
    w = wire_logs.window(logs, 1, 2, steps=4)
    assert w["log_points"] == 1 and w["steps"] == 4
    assert [r["bytes_sent"] for r in w["per_rank"]] == [500, 1000]  # (3000 - 1000) / 4, (6000 - 2000) / 4
    assert w["per_rank"][0]["wire_tx_payload"] == (6000 - 3000 - 15 * netem.FRAME_HEADER_BYTES) / 4
    assert w["sum"]["bytes_sent"] == 1500 and w["sum"]["messages_sent"] == 1
    assert w["sum"]["by_op"] == {"all_reduce": {"bytes_sent": 1000, "messages_sent": 1}}
    assert w["sum"]["payload_over_accounted"] == pytest.approx(w["sum"]["wire_tx_payload"] / 1500)
    summary = json.loads(wire_logs.write_summary(tmp_path, 2).read_text())
    assert summary["log_points"] == 2 and summary["sum"]["bytes_sent"] == 3000 + 6000
    with pytest.raises(ValueError, match="rank 0 logged 3 points"):
        wire_logs.window(logs, 0, 3, steps=1)
    with pytest.raises(FileNotFoundError, match="rank 2"):
        wire_logs.read_logs(tmp_path, 3)


def test_the_launcher_and_the_workers_name_the_same_variables():
    from commlab.core import stats

    assert (netem.WIRE_INTERFACE_ENV, netem.WIRE_LOG_ENV) == (stats.INTERFACE_ENV, stats.WIRE_LOG_ENV)
    net = EmulatedNetwork(2, NetworkSpec())
    assert net.env(1)[stats.INTERFACE_ENV] == netem.INTERFACE
