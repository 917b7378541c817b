"""Launch one experiment on its workers: the command Snakemake runs for every grid cell.

    python -m commlab launch --config results/p/name/seed0/config.yaml --sentinel .../sentinel.json
    python -m commlab launch --config run.yaml --network-mbit 1000     # emulated 1 Gbit/s links

* one node: ``torchrun --standalone`` with ``workers`` processes (a free rendezvous port is picked,
  so parallel jobs never collide), run inside this process (:func:`run_torchrun`), its workers
  forked from a server that imported torch and the training loop once (:mod:`.torchrun`);
* several nodes (``nodes > 1``, inside a SLURM allocation): ``srun`` starts one torchrun per node,
  which meet through c10d rendezvous at the first node of the allocation;
* ``max_restarts > 0`` lets torchrun restart failed workers, which resume from the last checkpoint;
* emulated network (config ``network: {bandwidth_mbit: ..., latency_ms: ...}`` or ``--network-mbit``,
  docs/network.md section 1): :mod:`commlab.launch.netem` builds one namespace per worker with shaped links, and each
  worker starts directly inside its namespace (``ip netns exec <ns> python -m commlab.loop ...``)
  with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT/GLOO_SOCKET_IFNAME set, and are
  supervised as torchrun does (:mod:`.supervise`): one worker failing stops the others and the launch exits
  non-zero naming the rank; SIGTERM/SIGINT are forwarded (workers checkpoint and exit 143); the
  namespaces are always torn down. Emulated runs use gloo (``backend: auto`` becomes gloo,
  ``nccl`` is refused: NCCL's P2P/SHM transports would bypass the shaped links). The links as
  built and their measured throughput reach the workers as a config override
  (``network.emulated``), so that rank 0 logs them as MLflow params.
  Every log point also samples each worker's interface counters (rank 0 logs them as ``wire_*``
  metrics; every rank appends them, beside its accounted bytes, to ``<run dir>/wire/rank<r>.jsonl``)
  and the launcher sums the first to last log point per rank and over the ranks in
  ``<run dir>/wire/summary.json`` (docs/network.md, "Bytes on the wire").

The config is validated here first, so a bad key fails before any worker starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import NoReturn

from commlab import timeline
from commlab.config import ConfigError, load_config
from commlab.launch.supervise import run_in_network
from commlab.launch.torchrun import (
    EXIT_BAD_INPUT,
    TORCHRUN,
    network_override,
    run_torchrun,
    srun_command,
    srun_env,
    start_worker_server_early,
    torchrun_args,
    train_argv,
)
from commlab.tracking_relay import start_relay


def network_section(config: dict, mbit: float | None = None, latency_ms: float | None = None) -> dict | None:
    """The config's ``network`` section with command-line overrides applied."""
    section = dict(config.get("network") or {})
    section.pop("emulated", None)  # what an earlier launch built: rebuilt here
    if mbit is not None:
        section["bandwidth_mbit"] = mbit
    if latency_ms is not None:
        section["latency_ms"] = latency_ms
    return section or None


class FailureRecord:
    """The first failed worker of a launch, as the supervisor (torchrun or ours) saw it; after the
    launch, the run's MLflow entry is marked FAILED naming it (:func:`commlab.tracking.record_failure`).
    Workers usually mark their run themselves; an NCCL watchdog abort, or SIGKILL of every rank,
    leaves nobody else to do it."""

    def __init__(self):
        self.rank: int | None = None
        self.reason: str | None = None

    def __call__(self, rank: int, exitcode: int) -> None:
        if self.rank is None:
            self.rank = rank
            how = (f"died with {signal.Signals(-exitcode).name}" if exitcode < 0 and -exitcode in
                   signal.valid_signals() else f"exited with code {exitcode}")
            self.reason = f"worker rank {rank} {how}"

    def record(self, config: dict, rc: int) -> None:
        """After the launch: a failure (not success, bad input or a forwarded signal) is recorded."""
        if rc in (0, EXIT_BAD_INPUT) or rc > 128:
            return
        from commlab.config import run_dir
        from commlab.tracking import record_failure

        reason = self.reason or f"the job's workers failed (launcher exit code {rc}; see the job's log)"
        run_id = record_failure(run_dir(config), reason, self.rank)
        if run_id:
            print(f"[commlab launch] MLflow run {run_id} marked FAILED: {reason}", file=sys.stderr, flush=True)


def launch_emulated(config: dict, config_path: str, sentinel: str | None, section: dict,
                    failures: FailureRecord, relay: str | None = None) -> int:
    """Start the workers in an emulated network; always tear it down. (A Unix socket, the tracking
    ``relay``, is reached from every network namespace.)"""
    from commlab.config import run_dir
    from commlab.launch.netem import WIRE_LOG_ENV, EmulatedNetwork, NetemError, NetworkSpec, Terminated
    from commlab.launch.wire_logs import write_summary

    try:
        spec = NetworkSpec.from_config(section)
    except (TypeError, ValueError) as err:
        print(f"commlab launch: {err}", file=sys.stderr)
        return 2
    if config.get("nodes", 1) > 1:
        print("commlab launch: network emulation runs on one node; set nodes: 1", file=sys.stderr)
        return 2
    net = EmulatedNetwork(config["workers"], spec)
    try:
        try:
            params = net.up()
        except NetemError as err:
            print(f"commlab launch: {err}", file=sys.stderr)
            return 2
        print(f"[commlab launch] emulated network {net.run_id}: " + ", ".join(
            f"{k.removeprefix('network_')}={v}" for k, v in params.items()), flush=True)
        rc = 1
        wire = run_dir(config) / "wire"
        shutil.rmtree(wire, ignore_errors=True)  # counters start again with every network
        for attempt in range(config.get("max_restarts", 0) + 1):
            if attempt:
                print(f"[commlab launch] restart {attempt}: workers resume from the last checkpoint", flush=True)
            rc = run_in_network(net, train_argv(config_path, sentinel, [network_override(net), "backend=gloo"], relay),
                                extra_env={WIRE_LOG_ENV: str(wire)}, on_failure=failures)
            if rc == 0:
                try:
                    write_summary(wire, config["workers"])
                except (OSError, ValueError) as err:  # the run itself succeeded: say so, do not fail it
                    print(f"[commlab launch] no wire summary: {err}", file=sys.stderr, flush=True)
                break
        return rc
    except Terminated as err:
        return 128 + err.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        net.down()


def launch(config_path: str, sentinel: str | None = None, network_mbit: float | None = None,
           latency_ms: float | None = None, marks: dict | None = None, warm: bool = False) -> int:
    """Launch the run of ``config_path``; its exit status. ``marks``: the launcher process's start and
    ``main`` (Unix times) for the job's timeline (:mod:`commlab.timeline`), taken now when not given;
    ``warm``: this process is a fork of the warm launcher (:mod:`.server`), which imported torch, the
    loop and MLflow: its workers are forked from it, and rank 0 logs to MLflow itself."""
    marks = marks or {"start": timeline.process_start_time(), "main": time.time()}
    if network_mbit is None and latency_ms is None and not warm:
        start_worker_server_early(config_path)
    try:
        config = load_config(config_path)
    except ConfigError as err:
        print(f"commlab launch: {err}", file=sys.stderr)
        return 2
    section = network_section(config, network_mbit, latency_ms)
    if section and config.get("backend") == "nccl":
        # NCCL reaches peers on one host through P2P/SHM, not the shaped interfaces: the run would
        # measure NVLink or PCIe, not the link it names. Emulated links run gloo (workers get backend=gloo).
        print("commlab launch: emulated networks run on gloo (NCCL would bypass the shaped links through "
              "its P2P/SHM transports); set backend: gloo or auto", file=sys.stderr)
        return 2
    from commlab.core.runtime import check_backend  # here: torch after the workers' fork server started

    # An NCCL run with fewer GPUs than workers per node stops here, before any worker starts. With
    # several nodes each node's workers check their own node's GPUs when they start (srun places
    # them; this process may run elsewhere), and stop with the same message.
    if config.get("nodes", 1) == 1:
        try:
            choice = check_backend({**config, "backend": "gloo"} if section else config)
        except ValueError as err:
            print(f"commlab launch: {err}", file=sys.stderr)
            return 2
        if choice.note and not section:
            print(f"[commlab launch] {choice.note}", flush=True)
    failures = FailureRecord()
    # Rank 0's MLflow calls are made here, by a relay that imports MLflow while the workers start
    # (a warm launcher has it imported already, and forks its workers: no thread may run then).
    relay = start_relay(config) if config.get("nodes", 1) == 1 and not warm else None
    requested = time.time()
    try:
        rc = _launch_workers(config, config_path, sentinel, section, failures, relay.address if relay else None,
                             start_method="fork" if warm else "forkserver")
    finally:
        done = time.time()
        if relay is not None:
            relay.close()
    failures.record(config, rc)
    from commlab.config import run_dir

    timeline.merge(run_dir(config), {**marks, "served": warm}, requested, done)
    return rc


RELAY_REMARK = "# rank 0's MLflow calls go through this launcher (--tracking-relay)"


def _launch_workers(config: dict, config_path: str, sentinel: str | None, section: dict | None,
                    failures: FailureRecord, relay: str | None = None, start_method: str = "forkserver") -> int:
    """Start the run's workers (emulated network, several nodes through srun, or torchrun here;
    ``relay``: the tracking relay's address, for rank 0 on this node; ``start_method``: how
    torchrun's agent starts them, see :func:`~commlab.launch.torchrun.run_torchrun`)."""
    if section:
        return launch_emulated(config, config_path, sentinel, section, failures, relay)
    if config.get("nodes", 1) > 1:
        if shutil.which("srun") is None:
            print("commlab launch: nodes > 1 needs srun (run inside a SLURM allocation)", file=sys.stderr)
            return 2
        try:
            args = torchrun_args(config, config_path, sentinel)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:  # no allocation, scontrol failed
            print(f"commlab launch: cannot find the allocation's first node: {err}", file=sys.stderr)
            return 2
        cmd = srun_command(config["nodes"]) + TORCHRUN + args
        print("[commlab launch] " + " ".join(cmd), flush=True)
        return subprocess.call(cmd, env=srun_env())
    # Printed without the relay, whose socket ends with this launcher: the line is the command to
    # run the workers again by hand (rank 0 then opens the MLflow run itself); a comment says it.
    print("[commlab launch] " + " ".join(TORCHRUN + torchrun_args(config, config_path, sentinel))
          + (f"  {RELAY_REMARK}" if relay else ""), flush=True)
    return run_torchrun(torchrun_args(config, config_path, sentinel, relay), on_failure=failures,
                        start_method=start_method)


def end_process(rc: int) -> NoReturn:
    """End the launcher with ``rc`` once its output is flushed, without the interpreter's teardown:
    with torch and MLflow loaded it is a noticeable part of a short run, and nothing is left to do
    by then. The workers have exited, the relay and the agent's folder are removed, every store call
    has returned, and the workers' fork server exits when this process does."""
    logging.shutdown()  # torch's agent logs through it
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream has nothing left to say
            pass
    os._exit(rc)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``launch`` options (shared by ``commlab launch`` and ``python -m commlab.launch``)."""
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--sentinel", help="run record JSON written by rank 0 at the end")
    parser.add_argument("--network-mbit", type=float, metavar="MBIT",
                        help="emulate per-worker links of this bandwidth (needs root and iproute2); "
                             "overrides network.bandwidth_mbit")
    parser.add_argument("--latency-ms", type=float, metavar="MS",
                        help="one-way latency to emulate (needs sch_netem); overrides network.latency_ms")


def run(argv: list[str], args: argparse.Namespace) -> int:
    """``commlab launch`` on ``argv`` (parsed as ``args``): in the warm launcher when one answers
    (:mod:`.server`), else in this process."""
    from commlab.launch.client import served_launch

    marks = {"start": timeline.process_start_time(), "main": time.time()}
    rc = served_launch(argv, marks)
    return rc if rc is not None else launch(args.config, args.sentinel, args.network_mbit, args.latency_ms,
                                            marks=marks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlab.launch", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run(argv, parser.parse_args(argv))

