"""A real SLURM cluster on this machine, for testing the SLURM profile (tests/test_slurm_cluster.py).

One controller and ``nodes`` compute nodes, each daemon in its own network and UTS namespace
with its own host name, address and spool directory, all joined by a bridge in the host's
namespace (the login node, where ``sbatch``, Snakemake and the MLflow server run)::

    host  : br cmlslurm0 198.19.0.1/24          (sbatch, squeue, sacct, mlflow server)
    ctl   : commlab-slurm-ctl  eth0 198.19.0.2  (slurmctld, host name commlab-ctl)
    c<i>  : commlab-slurm-c<i> eth0 198.19.0.<10+i> (slurmd -N c<i>, host name c<i>)

Addresses come from 198.19.0.0/24, inside the RFC 2544 benchmarking range and apart from the
198.18.0.x addresses :mod:`commlab.launch.netem` gives its workers (in namespaces that never reach the
host's). Every node's ``/etc/hosts`` is its namespace's ``/etc/netns/<ns>/hosts``, bound over it in
the daemon's mount namespace, so ``c1`` resolves on every node as through a cluster's DNS; the
config directory is bound over ``/etc/slurm`` the same way. One ``munged`` with a key of its own
serves every daemon through a socket in the state directory; no system file outside
``/etc/netns/commlab-slurm-*`` is written. Accounting is real: slurmdbd on a throwaway MariaDB on
the controller, so ``sacct`` and ``sacctmgr`` answer as on a site (account ``commlab``, user root).

    python -m commlab.testing.localslurm up   [--dir /tmp/commlab-slurm] [--nodes 2]
    SLURM_CONF=/tmp/commlab-slurm/etc/slurm.conf sinfo
    python -m commlab.testing.localslurm down [--dir /tmp/commlab-slurm]

Needs root, iproute2, util-linux (unshare, nsenter) and Debian's slurmctld, slurmd, slurm-client,
slurmdbd, munge and mariadb-server (``make system-packages``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from commlab.launch.netem import delete_namespaces, list_namespaces, namespace_pids

PREFIX = "commlab-slurm"
BRIDGE = "cmlslurm0"
SUBNET = "198.19.0"  # /24, RFC 2544 benchmarking range
HOST_ADDR = f"{SUBNET}.1"
CTL_ADDR = f"{SUBNET}.2"
CTL_NAME = "commlab-ctl"
DEFAULT_DIR = "/tmp/commlab-slurm"
ACCOUNT = "commlab"  # the one SLURM account, with root as its user
DB_PORT = 3306  # MariaDB on the controller's own loopback (its namespace): cannot collide
TOOLS = ("ip", "unshare", "nsenter", "munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd",
         "sbatch", "sinfo", "scontrol", "sacct", "sacctmgr")


class ClusterError(RuntimeError):
    """The local cluster cannot be built or did not come up."""


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _run(cmd: list[str], check: bool = True, env: dict | None = None,
         timeout: float = 30) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and out.returncode:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


@dataclass
class LocalCluster:
    """A local SLURM cluster whose state lives under ``root``. ``up()`` builds it, ``down()``
    removes every namespace, daemon and file of it (also those of an earlier, killed ``up``)."""

    root: Path = Path(DEFAULT_DIR)
    nodes: int = 2
    cpus: int = 4  # per node, declared (slurmd takes the configured count: config_overrides)
    mem_mb: int = 16000  # per node, declared; memory is not a consumable (CR_Core)
    slurmd_timeout_s: int = 10  # a node whose slurmd stops answering is DOWN after this

    def __post_init__(self):
        self.root = Path(self.root)
        if not 1 <= self.nodes <= 200:
            raise ValueError(f"nodes must be between 1 and 200, got {self.nodes}")

    # ------------------------------------------------------------------ names
    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        return [f"c{i}" for i in range(1, self.nodes + 1)]

    def namespace(self, node: str) -> str:
        return f"{PREFIX}-{node}"

    def address(self, node: str) -> str:
        return CTL_ADDR if node == CTL_NAME else f"{SUBNET}.{10 + int(node[1:])}"

    @property
    def env(self) -> dict[str, str]:
        """Variables that point SLURM's commands at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ files
    def _write_config(self) -> None:
        r = self.root
        for d in ("etc", "state", "log", "munge", "db", *(f"spool/{n}" for n in self.node_names)):
            (r / d).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.address(n)} NodeHostname={n} CPUs={self.cpus} "
                          f"RealMemory={self.mem_mb} State=UNKNOWN" for n in self.node_names)
        self.conf.write_text(f"""\
# Local test cluster (commlab.testing.localslurm); every path under {r}.
ClusterName=commlab
SlurmctldHost={CTL_NAME}({CTL_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/state/slurmctld.pid
SlurmdPidFile={r}/spool/%n/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
# no cgroups here: processes are tracked through /proc
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={CTL_ADDR}
# for slurmdbd, "Pass" names munge's socket
AccountingStoragePass={r}/munge/munge.socket
# sacct shows the comment Snakemake's plugin gives every job (rule and wildcards)
AccountingStoreFlags=job_comment
MinJobAge=300
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout_s}
InactiveLimit=0
KillWait=30
{nodes}
PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
""")
        (r / "etc" / "plugstack.conf").write_text("")
        dbd = r / "etc" / "slurmdbd.conf"  # slurmdbd reads it beside slurm.conf; it must be private
        dbd.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.socket
DbdHost={CTL_NAME}
DbdAddr={CTL_ADDR}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={DB_PORT}
StorageUser=root
StorageLoc=slurm_acct_db
PidFile={r}/state/slurmdbd.pid
LogFile={r}/log/slurmdbd.log
""")
        dbd.chmod(0o600)
        # slurmd loads a cgroup plugin even when nothing is tracked through cgroups
        (r / "etc" / "cgroup.conf").write_text("CgroupPlugin=autodetect\nCgroupMountpoint=/sys/fs/cgroup\n")
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o600)
        everyone = [(CTL_NAME, CTL_ADDR), *((n, self.address(n)) for n in self.node_names)]
        for name in [CTL_NAME, *self.node_names]:
            d = Path("/etc/netns") / self.namespace("ctl" if name == CTL_NAME else name)
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in everyone))

    # ------------------------------------------------------------------ network
    def _build_network(self) -> None:
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{HOST_ADDR}/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        for i, name in enumerate([CTL_NAME, *self.node_names]):
            ns = self.namespace("ctl" if name == CTL_NAME else name)
            port = f"{BRIDGE}p{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", port, "master", BRIDGE, "up"])
            for cmd in (["addr", "add", f"{self.address(name)}/24", "dev", "eth0"], ["link", "set", "lo", "up"],
                        ["link", "set", "eth0", "up"], ["route", "add", "default", "via", HOST_ADDR]):
                _run(["ip", "-n", ns, *cmd])

    def _start(self, ns: str, hostname: str, cmd: list[str], log: str) -> None:
        """Start ``cmd`` inside ``ns`` with its own host name (a UTS namespace), detached."""
        # nsenter rather than `ip netns exec`, which remounts /sys and so hides the cgroup
        # hierarchy slurmd needs; the namespace's hosts file is bound over /etc/hosts by hand.
        # The config directory is bound over /etc/slurm, the default path: the SLURM executor
        # drops SLURM_* variables (SLURM_CONF too) before its `srun`, as it would on a site.
        etc = self.root / "etc"
        inner = (f'mount --bind /etc/netns/{ns}/hosts /etc/hosts && mkdir -p /etc/slurm && '
                 f'mount --bind {etc} /etc/slurm && hostname {hostname} && exec "$@"')
        with open(self.root / "log" / log, "ab") as out:
            subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "sh", "-c", inner,
                              "sh", *cmd],
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, **self.env})

    # ------------------------------------------------------------------ life cycle
    def up(self, timeout: float = 60) -> LocalCluster:
        """Build the network, start MariaDB, slurmdbd, slurmctld and one slurmd per node; wait
        until every node is idle. Refuses while another local cluster is up (names are fixed)."""
        if os.geteuid() != 0:
            raise ClusterError("the local SLURM cluster needs root (network and UTS namespaces)")
        if missing := missing_tools():
            raise ClusterError(f"the local SLURM cluster needs {', '.join(missing)}: run `make system-packages` "
                               "as root (Debian: slurmctld slurmd slurm-client munge iproute2 util-linux)")
        clear_stopped_cluster()
        try:
            self._write_config()
            self._build_network()
            m = self.root / "munge"
            _run(["munged", "--force", f"--key-file={m}/munge.key", f"--socket={m}/munge.socket",
                  f"--pid-file={m}/munged.pid", f"--log-file={self.root}/log/munged.log",
                  f"--seed-file={m}/munge.seed"])
            self._start_accounting(timeout)
            self._start(self.namespace("ctl"), CTL_NAME, ["slurmctld", "-D", "-i", "-f", str(self.conf)],
                        "slurmctld.out")
            for node in self.node_names:
                self.start_node(node)
            self.wait_idle(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _start_accounting(self, timeout: float) -> None:
        """MariaDB (a throwaway database: no grant tables) and slurmdbd on the controller, then the
        cluster, its account and root as its user, as ``sacctmgr`` would set them up on a site."""
        db = self.root / "db"
        _run(["mariadb-install-db", "--no-defaults", f"--datadir={db}/data", "--skip-test-db", "--user=root",
              "--auth-root-authentication-method=normal"], timeout=120)
        ctl = self.namespace("ctl")
        self._start(ctl, CTL_NAME, ["mariadbd", "--no-defaults", f"--datadir={db}/data", f"--socket={db}/mysqld.sock",
                                    f"--port={DB_PORT}", "--bind-address=127.0.0.1", "--user=root",
                                    "--skip-grant-tables", f"--pid-file={db}/mysqld.pid"], "mariadb.out")
        deadline = time.monotonic() + timeout
        while not (db / "mysqld.sock").exists():  # else slurmdbd retries only every 5 s
            if time.monotonic() > deadline:
                self._fail(f"MariaDB did not start within {timeout:.0f} s")
            time.sleep(0.2)
        self._start(ctl, CTL_NAME, ["slurmdbd", "-D"], "slurmdbd.out")
        while self.slurm("sacctmgr", "-n", "list", "cluster", check=False, timeout=10) is None:
            if time.monotonic() > deadline:
                self._fail(f"slurmdbd did not answer within {timeout:.0f} s")
            time.sleep(0.5)
        for what in (["cluster", "commlab"], ["account", ACCOUNT], ["user", "root", f"account={ACCOUNT}"]):
            self.slurm("sacctmgr", "-i", "add", *what)

    def _fail(self, why: str) -> None:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((self.root / "log").glob("*")))
        raise ClusterError(f"{why}\n{logs}")

    def start_node(self, node: str) -> None:
        """Start (or restart, after :meth:`kill_node`) the slurmd of ``node``."""
        self._start(self.namespace(node), node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)],
                    f"slurmd-{node}.out")

    def kill_node(self, node: str) -> list[int]:
        """A node failure: SIGKILL every process of ``node`` (slurmd, its job steps, their
        workers). Returns the pids killed."""
        pids = namespace_pids(self.namespace(node))
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        return pids

    def slurm(self, *args: str, check: bool = True, timeout: float = 30) -> str | None:
        """Run a SLURM command against this cluster: its stdout (None when it failed, unchecked)."""
        out = _run(list(args), check=check, env={**os.environ, **self.env}, timeout=timeout)
        return out.stdout if out.returncode == 0 else None

    def node_states(self) -> dict[str, str]:
        out = self.slurm("sinfo", "-N", "-h", "-o", "%N %t", check=False) or ""
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def wait_idle(self, timeout: float = 60, nodes: list[str] | None = None) -> None:
        """Wait until ``nodes`` (default: all) are idle; on timeout the daemons' logs say why."""
        want = set(nodes or self.node_names)
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if want <= {n for n, s in states.items() if s == "idle"}:
                return
            time.sleep(0.5)
        self._fail(f"local SLURM nodes not idle after {timeout:.0f} s (states: {states or 'no answer'})")

    def down(self) -> None:
        """Stop every daemon and job of the cluster and remove its namespaces, bridge and files."""
        # every daemon, job step and worker lives in one of the namespaces
        delete_namespaces(list_namespaces(PREFIX + "-"), grace_s=5.0)
        pidfile = self.root / "munge" / "munged.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text().split()[0]), 15)
            except (ProcessLookupError, ValueError):
                pass
        _remove_network([])
        shutil.rmtree(self.root, ignore_errors=True)


def clear_stopped_cluster() -> list[str]:
    """Remove what a killed cluster left (namespaces and bridge outlive the daemons that ended
    with the session or job that ran them): returns the namespaces removed. Raises ClusterError
    while a process still runs in any of them (a live cluster, whose names are fixed)."""
    bridge = _run(["ip", "link", "show", BRIDGE], check=False).returncode == 0
    namespaces = list_namespaces(PREFIX + "-")
    if any(namespace_pids(ns) for ns in namespaces):
        raise ClusterError(f"a local SLURM cluster is already up (bridge {BRIDGE}, namespaces {PREFIX}-*): "
                           "stop it first with `make slurm-down` (python -m commlab.testing.localslurm down)")
    if bridge or namespaces:
        print(f"localslurm: removing a stopped cluster's leftovers ({', '.join(namespaces) or BRIDGE})",
              file=sys.stderr)
        _remove_network(namespaces)
    return namespaces


def _remove_network(namespaces: list[str]) -> None:
    """Delete ``namespaces`` (already emptied of processes), the bridge and the hosts files."""
    delete_namespaces(namespaces, grace_s=0.0)
    _run(["ip", "link", "delete", BRIDGE], check=False)
    for d in Path("/etc/netns").glob(f"{PREFIX}-*"):
        shutil.rmtree(d, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m commlab.testing.localslurm", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", default=DEFAULT_DIR, help="state directory (config, spools, logs)")
    parser.add_argument("--nodes", type=int, default=2, help="compute nodes")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster = LocalCluster(Path(args.dir), args.nodes)
    try:
        if args.action == "up":
            cluster.up()
            print(f"local SLURM cluster up: nodes {', '.join(cluster.node_names)}; "
                  f"export SLURM_CONF={cluster.conf}")
        else:
            cluster.down()
    except ClusterError as err:
        print(f"commlab.testing.localslurm: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
