"""Emulated networks: every worker in its own network namespace, joined by shaped links (docs/network.md, section 1).

On one machine over loopback communication is nearly free, so the papers' speed claims (which
appear only when the network is slow relative to compute) would go untested. Here each worker
runs in a private network namespace whose only interface is one end of a veth pair; the other
ends meet on a bridge in a hub namespace of the run::

    commlab-<run>-hub : br0 <- p0 p1 ... p{P-1}          (bridge, no address)
    commlab-<run>-r<i>: eth0 198.18.0.<10+i>/15, lo       (worker i; gloo binds eth0)

Each veth is shaped at *both* ends with ``tc tbf``: the egress of ``eth0`` is the worker's
upload, the egress of ``p<i>`` its download, so every worker has a full-duplex link of
``bandwidth_mbit`` (a ring allreduce then costs ``2(P-1)/P * n`` bytes through each link).
Latency needs ``sch_netem`` (``netem delay`` as root qdisc, tbf as its child, half the one-way
latency on each end); on kernels without it the run says so (a warning and a
``network_latency_emulated=false`` param) and shapes bandwidth only.

Nothing is created in the host's namespace: deleting the run's namespaces (after stopping the
processes inside them) removes every link. Names carry the launcher's pid and a random tag, so
parallel runs never collide and a later run can recognise and reap the leftovers of a launcher
that was SIGKILLed (its pid is dead). Teardown runs on normal exit, on an exception and on
SIGTERM/SIGINT/SIGHUP (handlers raise :class:`Terminated`, so ``finally`` blocks run).

The shaping is verified, not assumed: at start a TCP stream from worker 0 to worker 1 measures
the point-to-point throughput, returned in :attr:`EmulatedNetwork.params` for MLflow.

Every byte a worker sends or receives crosses its ``eth0``, whose kernel counters therefore
measure the run's real traffic (docs/network.md, "Bytes on the wire"): :meth:`EmulatedNetwork.counters`
reads them from outside, and each worker is told its interface (``COMMLAB_WIRE_INTERFACE``) so
that its log points carry them too (:class:`commlab.core.stats.WireMeter`).

Usage (as root)::

    spec = NetworkSpec(bandwidth_mbit=1000)
    with EmulatedNetwork(4, spec) as net:
        print(net.params)               # includes network_measured_mbit
        cmd = net.exec_prefix(0) + [sys.executable, "-m", "commlab", "train", ...]
        env = {**os.environ, **net.env(0)}

Addresses come from 198.18.0.0/15, the range reserved for network benchmarking (RFC 2544).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass

PREFIX = "commlab"
INTERFACE = "eth0"  # the worker side of each veth, inside the worker's namespace
# Bytes of headers in every frame the counters count: Ethernet 14, IPv4 20, TCP 20 + 12 of the
# timestamp option (Linux's default); a frame's payload is its length minus these. With
# segmentation offload one counted "packet" may be a larger segment, which still has one header.
FRAME_HEADER_BYTES = 66
# Name the worker's interface to its log points and the folder of every rank's log
# (commlab.core.stats.INTERFACE_ENV and WIRE_LOG_ENV; spelled out here so that the launcher does
# not import torch through commlab.core).
WIRE_INTERFACE_ENV = "COMMLAB_WIRE_INTERFACE"
WIRE_LOG_ENV = "COMMLAB_WIRE_LOG"
_NAME = re.compile(rf"^{PREFIX}-(\d+)x([0-9a-f]+)-(hub|r\d+)$")


class NetemError(RuntimeError):
    """The emulated network cannot be built (not root, iproute2 missing, a tc/ip command failed)."""


class Terminated(BaseException):  # noqa: N818 - mirrors KeyboardInterrupt, which it accompanies
    """Raised in the main thread by SIGTERM/SIGINT/SIGHUP while a network is up, so cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class NetworkSpec:
    """The run config's ``network:`` section."""

    bandwidth_mbit: float | None = None  # per-worker link rate, each direction, Mbit/s; None: unshaped
    latency_ms: float = 0.0  # one-way worker-to-worker latency in ms (needs sch_netem in the kernel)
    burst_kb: float | None = None  # tbf bucket in KiB; None: max(32 KiB, 1 ms of traffic at the rate)
    queue_ms: float = 50.0  # tbf queue length in ms of traffic (packets beyond it are dropped)
    verify: bool = True  # measure point-to-point throughput at start (logged as params)
    verify_seconds: float = 0.5  # target duration of that measurement

    def validate(self) -> None:
        if self.bandwidth_mbit is not None and not self.bandwidth_mbit > 0:
            raise ValueError(f"network.bandwidth_mbit must be positive or null, got {self.bandwidth_mbit}")
        if self.latency_ms < 0:
            raise ValueError(f"network.latency_ms must be >= 0, got {self.latency_ms}")
        if self.burst_kb is not None and not self.burst_kb > 0:
            raise ValueError(f"network.burst_kb must be positive or null, got {self.burst_kb}")
        if not self.queue_ms > 0:
            raise ValueError(f"network.queue_ms must be positive, got {self.queue_ms}")
        if not self.verify_seconds > 0:
            raise ValueError(f"network.verify_seconds must be positive, got {self.verify_seconds}")

    @classmethod
    def from_config(cls, section: dict | None) -> NetworkSpec | None:
        """Build from a config section (None or {} means: no emulation); raise ValueError naming the key."""
        if not section:
            return None
        unknown = sorted(set(section) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"network: unknown key(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        spec = cls(**section)
        spec.validate()
        return spec

    @property
    def rate_bytes_s(self) -> float | None:
        return None if self.bandwidth_mbit is None else self.bandwidth_mbit * 1e6 / 8


def preflight() -> None:
    """Fail early, with what to do, when this process cannot build namespaces."""
    if os.geteuid() != 0:
        raise NetemError("network emulation needs root (it creates network namespaces and tc qdiscs): "
                         "run as root, or remove `network:` from the run config to use loopback")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetemError(f"network emulation needs iproute2 ({' and '.join(missing)} not found): "
                         "install it (apt-get install iproute2)")


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode:
        raise NetemError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces starting with ``prefix``."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def namespace_pids(namespace: str) -> list[int]:
    out = _run(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_pids(pids: list[int], grace_s: float) -> None:
    """SIGTERM these processes, then SIGKILL whatever is still alive after ``grace_s``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def delete_namespaces(names: list[str], grace_s: float = 5.0) -> None:
    """Stop the processes inside ``names``, then delete them (workers first, hub last)."""
    names = sorted(names, key=lambda n: n.endswith("-hub"))
    pids = [pid for n in names for pid in namespace_pids(n) if pid != os.getpid()]
    if pids:
        _stop_pids(pids, grace_s)
    for name in names:
        _run(["ip", "netns", "delete", name], check=False)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and set(names) & set(list_namespaces()):
        time.sleep(0.05)


def cleanup_stale(run_id: str | None = None) -> list[str]:
    """Remove the namespaces of ``run_id`` and of every run whose launcher process is dead.

    Namespaces of live launchers (parallel runs) are never touched. Returns what was removed."""
    stale = []
    for name in list_namespaces():
        m = _NAME.match(name)
        if not m:
            continue
        owner, tag = int(m.group(1)), m.group(2)
        if f"{owner}x{tag}" == run_id or not _pid_alive(owner):
            stale.append(name)
    if stale:
        delete_namespaces(stale)
    return stale


_PROBE = r"""
import socket, sys, time
role, host, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.settimeout(30); s.bind((host, port)); s.listen(1)
    c, _ = s.accept(); c.settimeout(60)
    buf, got, t0 = bytearray(1 << 20), 0, None
    while got < nbytes:
        n = c.recv_into(buf)
        if not n:
            break
        t0 = t0 or time.perf_counter()
        got += n
    print(got, time.perf_counter() - t0, flush=True)
    c.sendall(b"k")
else:
    deadline = time.monotonic() + 20
    while True:
        try:
            c = socket.create_connection((host, port), timeout=5); break
        except OSError:
            if time.monotonic() > deadline: raise
            time.sleep(0.02)
    block, sent = bytes(1 << 20), 0
    while sent < nbytes:
        m = min(len(block), nbytes - sent); c.sendall(block[:m]); sent += m
    c.recv(1)
"""


class EmulatedNetwork:
    """Namespaces, bridge, veth links and tc shaping for ``world_size`` workers of one run."""

    def __init__(self, world_size: int, spec: NetworkSpec, run_id: str | None = None,
                 handle_signals: bool = True):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        spec.validate()
        self.world_size = world_size
        self.spec = spec
        self.run_id = run_id or f"{os.getpid()}x{secrets.token_hex(3)}"
        if not re.fullmatch(r"\d+x[0-9a-f]+", self.run_id):
            raise ValueError(f"run_id must look like <pid>x<hex>, got {self.run_id!r}")
        self.handle_signals = handle_signals
        self.params: dict = {}
        self.latency_emulated = False
        self.latency_note: str | None = None
        self._up = False
        self._closing = False
        self._previous_handlers: dict = {}

    # ------------------------------------------------------------------ names
    @property
    def hub(self) -> str:
        return f"{PREFIX}-{self.run_id}-hub"

    def namespace(self, rank: int) -> str:
        return f"{PREFIX}-{self.run_id}-r{rank}"

    def namespaces(self) -> list[str]:
        return [self.namespace(r) for r in range(self.world_size)] + [self.hub]

    def address(self, rank: int) -> str:
        host = 10 + rank
        return f"198.18.{host // 256}.{host % 256}"

    @property
    def master_addr(self) -> str:
        return self.address(0)

    def exec_prefix(self, rank: int) -> list[str]:
        """Prefix a command with this to run it inside worker ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(rank)]

    def env(self, rank: int) -> dict[str, str]:
        """Environment for worker ``rank``: gloo binds the shaped interface, rendezvous at worker 0."""
        return {"GLOO_SOCKET_IFNAME": INTERFACE, "TP_SOCKET_IFNAME": INTERFACE,
                "MASTER_ADDR": self.master_addr, WIRE_INTERFACE_ENV: INTERFACE}

    def counters(self) -> list[dict[str, int]]:
        """Every worker's interface counters now (``tx_bytes``, ``rx_bytes``, ``tx_packets``,
        ``rx_packets``, cumulative since :meth:`up`), in rank order, read from outside the workers."""
        out = []
        for rank in range(self.world_size):
            text = _run(["ip", "-n", self.namespace(rank), "-s", "-j", "link", "show", INTERFACE]).stdout
            stats = json.loads(text)[0]["stats64"]
            out.append({f"{d}_{k}": int(stats[d][k]) for d in ("tx", "rx") for k in ("bytes", "packets")})
        return out

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> EmulatedNetwork:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> dict:
        """Build the network, verify its throughput, and return the params to log."""
        preflight()
        self._install_signal_handlers()
        atexit.register(self.down)
        cleanup_stale(self.run_id)
        self._up = True
        try:
            self._build()
            self.params = self._describe()
            if self.spec.verify and self.world_size >= 2:
                self.params.update(self.verify())
        except BaseException:
            self.down()
            raise
        return self.params

    def _build(self) -> None:
        _run(["ip", "netns", "add", self.hub])
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        for rank in range(self.world_size):
            ns, port = self.namespace(rank), f"p{rank}"
            _run(["ip", "netns", "add", ns])
            # Both ends are created directly inside the namespaces: nothing ever appears on the host.
            _run(["ip", "link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", port,
                  "netns", self.hub])
            _run(["ip", "-n", self.hub, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", self.hub, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/15", "dev", INTERFACE])
            _run(["ip", "-n", ns, "link", "set", INTERFACE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._shape(ns, INTERFACE, first=rank == 0)
            self._shape(self.hub, port, first=False)

    def _shape(self, ns: str, dev: str, first: bool) -> None:
        """Shape the egress of one veth end: optional netem delay, then tbf for the rate."""
        parent = ["root"]
        if self.spec.latency_ms > 0 and (first or self.latency_emulated):
            delay = f"{self.spec.latency_ms / 2:g}ms"  # half on each end: worker-to-worker = latency_ms
            out = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", delay], check=False)
            if out.returncode == 0:
                self.latency_emulated = True
                parent = ["parent", "1:1"]
            elif first:
                message = (f"latency {self.spec.latency_ms} ms requested but NOT emulated: this kernel has no "
                           f"sch_netem ({out.stderr.strip()}); bandwidth is still shaped")
                self.latency_note = message
                warnings.warn(message, RuntimeWarning, stacklevel=3)
                print(f"[commlab netem] {message}", file=sys.stderr, flush=True)
            else:
                raise NetemError(f"netem failed on {ns}/{dev}: {out.stderr.strip()}")
        rate = self.spec.rate_bytes_s
        if rate is None:
            return
        burst = self.spec.burst_kb * 1024 if self.spec.burst_kb else max(32 * 1024, rate * 1e-3)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf",
              "rate", f"{self.spec.bandwidth_mbit:g}mbit", "burst", str(int(burst)),
              "latency", f"{self.spec.queue_ms:g}ms"])

    def _describe(self) -> dict:
        spec = self.spec
        params = {"network_emulated": True, "network_run_id": self.run_id, "network_workers": self.world_size,
                  "network_bandwidth_mbit": spec.bandwidth_mbit if spec.bandwidth_mbit else "unshaped",
                  "network_latency_ms": spec.latency_ms,
                  "network_latency_emulated": bool(self.latency_emulated),
                  "network_qdisc": ("netem+" if self.latency_emulated else "") + ("tbf" if spec.bandwidth_mbit
                                                                                   else "none")}
        label = f"emulated {spec.bandwidth_mbit:g} Mbit/s" if spec.bandwidth_mbit else "emulated unshaped"
        if spec.latency_ms > 0:
            label += f", {spec.latency_ms:g} ms" if self.latency_emulated else ", latency NOT emulated"
        params["network_label"] = label
        if spec.latency_ms > 0 and not self.latency_emulated:
            params["network_latency_note"] = "kernel lacks sch_netem: latency not emulated"
        return params

    def verify(self, src: int = 0, dst: int = 1) -> dict:
        """Measure the TCP throughput from worker ``src`` to ``dst`` through the shaped links."""
        rate = self.spec.rate_bytes_s or 500e6  # unshaped: size the probe for ~0.5 GB/s
        nbytes = int(min(256 * 2**20, max(2**20, rate * self.spec.verify_seconds)))
        port = "5201"
        server = subprocess.Popen(self.exec_prefix(dst) + [sys.executable, "-c", _PROBE, "server",
                                                            self.address(dst), port, str(nbytes)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            client = subprocess.run(self.exec_prefix(src) + [sys.executable, "-c", _PROBE, "client",
                                                             self.address(dst), port, str(nbytes)],
                                    capture_output=True, text=True, timeout=120)
            out, err = server.communicate(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        if client.returncode or server.returncode:
            raise NetemError(f"throughput check {src}->{dst} failed: {client.stderr.strip()} {err.strip()}")
        got, seconds = out.split()
        measured = int(got) / float(seconds)
        result = {"network_measured_mb_s": round(measured / 1e6, 3),
                  "network_measured_mbit": round(measured * 8 / 1e6, 2),
                  "network_probe_bytes": int(got)}
        if self.spec.rate_bytes_s:
            ratio = measured / self.spec.rate_bytes_s
            result["network_measured_over_nominal"] = round(ratio, 4)
            if ratio > 1.2:
                raise NetemError(f"shaping is not effective: measured {measured * 8 / 1e6:.0f} Mbit/s on a "
                                 f"{self.spec.bandwidth_mbit:g} Mbit/s link")
            if ratio < 0.7:
                warnings.warn(f"measured link throughput {measured * 8 / 1e6:.0f} Mbit/s is well below the "
                              f"configured {self.spec.bandwidth_mbit:g} Mbit/s (CPU-bound?)",
                              RuntimeWarning, stacklevel=2)
        return result

    def down(self) -> None:
        """Stop every process inside the run's namespaces and delete them (idempotent)."""
        if not self._up or self._closing:
            return
        self._closing = True  # signals arriving now are ignored: cleanup must finish
        try:
            delete_namespaces([n for n in self.namespaces() if n in set(list_namespaces())])
        finally:
            self._up = False
            self._closing = False
            self._restore_signal_handlers()
            atexit.unregister(self.down)

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        if self._closing:
            return
        raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    """``python -m commlab.launch.netem cleanup``: remove namespaces left by dead launchers;
    ``python -m commlab.launch.netem list``: show the namespaces of commlab runs."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m commlab.launch.netem", description=main.__doc__)
    parser.add_argument("action", choices=["cleanup", "list"])
    args = parser.parse_args(argv)
    try:
        preflight()
    except NetemError as err:
        print(f"commlab netem: {err}", file=sys.stderr)
        return 2
    if args.action == "list":
        print("\n".join(list_namespaces()))
        return 0
    removed = cleanup_stale()
    print(f"removed {len(removed)} namespace(s)" + (": " + " ".join(removed) if removed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
