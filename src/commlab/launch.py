"""Launch one experiment on its workers: the command Snakemake runs for every grid cell.

    python -m commlab launch --config results/p/name/seed0/config.yaml --sentinel .../sentinel.json
    python -m commlab launch --config run.yaml --network-mbit 1000     # emulated 1 Gbit/s links

* one node: ``torchrun --standalone`` with ``workers`` processes (a free rendezvous port is picked,
  so parallel jobs never collide), run inside this process (:func:`run_torchrun`), its workers
  forked from a server that imported torch and the training loop once;
* several nodes (``nodes > 1``, inside a SLURM allocation): ``srun`` starts one torchrun per node,
  which meet through c10d rendezvous at the first node of the allocation;
* ``max_restarts > 0`` lets torchrun restart failed workers, which resume from the last checkpoint;
* emulated network (config ``network: {bandwidth_mbit: ..., latency_ms: ...}`` or ``--network-mbit``,
  spec 8 part 1): :mod:`commlab.netem` builds one namespace per worker with shaped links, and each
  worker starts directly inside its namespace (``ip netns exec <ns> python -m commlab.loop ...``)
  with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT/GLOO_SOCKET_IFNAME set. This module then
  supervises them as torchrun does: one worker failing stops the others and the launch exits
  non-zero naming the rank; SIGTERM/SIGINT are forwarded (workers checkpoint and exit 143); the
  namespaces are always torn down. The links as built and their measured throughput reach the
  workers as a config override (``network.emulated``), so that rank 0 logs them as MLflow params.

The config is validated here first, so a bad key fails before any worker starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from commlab.config import ConfigError, load_config

MASTER_PORT = 29500  # each emulated run has private namespaces: a fixed port cannot collide


def slurm_first_host() -> str:
    """The first host name of the SLURM allocation (the rendezvous host), asked of slurmctld: in
    the SLURM executor's job step, SLURM_JOB_NODELIST names only that step's one node."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise RuntimeError("nodes > 1 needs a SLURM allocation (SLURM_JOB_ID is not set)")
    info = subprocess.run(["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True,
                          check=True, timeout=60).stdout
    nodelist = next((f[len("NodeList="):] for f in info.split() if f.startswith("NodeList=")), "")
    if not nodelist or nodelist == "(null)":
        raise RuntimeError(f"SLURM job {job} has no nodes (scontrol show job: {info.strip()[:200]})")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    return out[0]


def srun_env() -> dict[str, str]:
    """This process's environment without the enclosing job step's SLURM_* variables (but the job id
    and the config path), so that ``srun`` takes the geometry of the whole allocation from
    slurmctld: inside the step they describe one task on one node ("Only allocated 1 nodes")."""
    keep = {"SLURM_JOB_ID", "SLURM_CONF"}
    return {k: v for k, v in os.environ.items()
            if k in keep or not k.startswith(("SLURM_", "SRUN_", "SBATCH_"))}


def train_argv(config_path: str, sentinel: str | None, overrides: list[str] = ()) -> list[str]:
    """``-m commlab.loop`` arguments of one worker (the worker entry point, :mod:`commlab.loop.worker`)."""
    train = ["-m", "commlab.loop", "--config", config_path]
    return train + (["--sentinel", sentinel] if sentinel else []) + list(overrides)


def network_override(net) -> str:
    """The ``network=...`` config override that tells an emulated run's workers the links as
    built and measured (``network.emulated``, logged by rank 0 as ``network_*`` params)."""
    import dataclasses

    return "network=" + json.dumps({**dataclasses.asdict(net.spec), "emulated": net.params}, sort_keys=True)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` command


def torchrun_args(config: dict, config_path: str, sentinel: str | None) -> list[str]:
    """torchrun's arguments that start this run's workers (one node: standalone rendezvous)."""
    train = train_argv(config_path, sentinel)
    restarts = [f"--max-restarts={config.get('max_restarts', 0)}"]
    if config.get("nodes", 1) == 1:
        return ["--standalone", f"--nproc-per-node={config['workers']}", *restarts, *train]
    job = os.environ.get("SLURM_JOB_ID", "commlab")
    return [f"--nnodes={config['nodes']}", f"--nproc-per-node={config['workers']}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={slurm_first_host()}:{rendezvous_port(job)}", f"--rdzv-id={job}", *restarts, *train]


def rendezvous_port(job_id: str) -> int:
    """The c10d store's port on the allocation's first node: one per job (29500-30499), so that
    multi-node jobs sharing a first node do not collide."""
    return 29500 + int(job_id) % 1000 if job_id.isdigit() else 29500


def srun_command(nodes: int) -> list[str]:
    """``srun`` that starts one task (a torchrun agent) on each of the allocation's ``nodes``.

    ``commlab launch`` itself runs inside a job step (the SLURM executor's ``srun -n1``), which
    holds CPUs of the allocation: since Slurm 20.11 a second step waits for them forever
    ("Requested nodes are busy") unless it may share them, hence ``--overlap``. ``--ntasks`` is
    explicit and the step's own variables are dropped (:func:`srun_env`). When one agent fails
    or its node dies, ``--kill-on-bad-exit`` ends the others at once rather than leaving them to
    time out in the rendezvous."""
    return ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1"]


# ---------------------------------------------------------------------- worker supervision
def start_workers(argv: list[str], world_size: int, env: Callable[[int], dict],
                  prefix: Callable[[int], list[str]] = lambda rank: [],
                  log: str | None = None) -> list[subprocess.Popen]:
    """Start ``world_size`` processes ``prefix(rank) + [python, *argv]`` with ``env(rank)`` added;
    their output goes to ``log`` (appended) when given, else to this process's output."""
    procs = []
    out = open(log, "ab") if log else None  # noqa: SIM115 - the children hold it; closed below
    try:
        for rank in range(world_size):
            rank_env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", **env(rank)}
            procs.append(subprocess.Popen(prefix(rank) + [sys.executable, *argv], env=rank_env, stdout=out,
                                          stderr=subprocess.STDOUT if out else None))
    except BaseException:
        stop_workers(procs, 0.0)
        raise
    finally:
        if out:
            out.close()
    return procs


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal s -> 128 + s


def stop_workers(procs: list[subprocess.Popen], grace_s: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to the live workers, wait up to ``grace_s``, then SIGKILL the rest."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def supervise(procs: list[subprocess.Popen], fail_grace_s: float = 5.0, signal_grace_s: float = 30.0,
              poll_s: float = 0.1) -> int:
    """Wait for the workers like torchrun: 0 when all succeed; the first failure stops the others.

    On SIGTERM/SIGINT (:class:`commlab.netem.Terminated` or KeyboardInterrupt) the signal is
    forwarded so that the workers checkpoint, they get ``signal_grace_s`` to exit, and the
    exception propagates. A failed worker's peers are blocked in a collective and ignore SIGTERM
    until their next control point, so they get only ``fail_grace_s``."""
    from commlab.netem import Terminated

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    # Without an emulated network nobody has claimed SIGTERM yet: claim it, so the workers are not orphaned.
    claimed = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if claimed:
        signal.signal(signal.SIGTERM, raise_terminated)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"[commlab launch] worker rank {rank} failed (exit code {_exit_code(code)}); "
                      f"stopping the other workers", file=sys.stderr, flush=True)
                stop_workers(procs, fail_grace_s)
                return _exit_code(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except (Terminated, KeyboardInterrupt) as err:
        sig = err.signum if isinstance(err, Terminated) else signal.SIGINT
        print(f"[commlab launch] {signal.Signals(sig).name}: forwarding to the workers", file=sys.stderr, flush=True)
        stop_workers(procs, signal_grace_s, sig)
        raise
    finally:
        if claimed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_in_network(net, argv: list[str], extra_env: dict | None = None, log: str | None = None,
                   **supervise_kw) -> int:
    """Run one worker per namespace of ``net`` (an up :class:`~commlab.netem.EmulatedNetwork`)."""
    extra_env = dict(extra_env or {})
    procs = start_workers(argv, net.world_size,
                          env=lambda rank: {**net.env(rank), "MASTER_PORT": str(MASTER_PORT), **extra_env},
                          prefix=net.exec_prefix, log=log)
    return supervise(procs, **supervise_kw)


def run_on_loopback(argv: list[str], world_size: int, extra_env: dict | None = None, log: str | None = None,
                    **supervise_kw) -> int:
    """The same supervision without emulation (workers on 127.0.0.1), for side-by-side measurements."""
    from commlab.core.runtime import free_port

    port = str(free_port())
    procs = start_workers(argv, world_size, log=log,
                          env=lambda rank: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **(extra_env or {})})
    return supervise(procs, **supervise_kw)


# ---------------------------------------------------------------------- the launch command
def network_section(config: dict, mbit: float | None = None, latency_ms: float | None = None) -> dict | None:
    """The config's ``network`` section with command-line overrides applied."""
    section = dict(config.get("network") or {})
    section.pop("emulated", None)  # what an earlier launch built: rebuilt here
    if mbit is not None:
        section["bandwidth_mbit"] = mbit
    if latency_ms is not None:
        section["latency_ms"] = latency_ms
    return section or None


def launch_emulated(config: dict, config_path: str, sentinel: str | None, section: dict) -> int:
    """Start the workers in an emulated network; always tear it down."""
    from commlab.netem import EmulatedNetwork, NetemError, NetworkSpec, Terminated

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
        for attempt in range(config.get("max_restarts", 0) + 1):
            if attempt:
                print(f"[commlab launch] restart {attempt}: workers resume from the last checkpoint", flush=True)
            rc = run_in_network(net, train_argv(config_path, sentinel, [network_override(net)]))
            if rc == 0:
                break
        return rc
    except Terminated as err:
        return 128 + err.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        net.down()


def launch(config_path: str, sentinel: str | None = None, network_mbit: float | None = None,
           latency_ms: float | None = None) -> int:
    if network_mbit is None and latency_ms is None:
        start_worker_server_early(config_path)
    try:
        config = load_config(config_path)
    except ConfigError as err:
        print(f"commlab launch: {err}", file=sys.stderr)
        return 2
    section = network_section(config, network_mbit, latency_ms)
    if section:
        return launch_emulated(config, config_path, sentinel, section)
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
    args = torchrun_args(config, config_path, sentinel)
    print("[commlab launch] " + " ".join(TORCHRUN + args), flush=True)
    return run_torchrun(args)


# Imported once by the fork server that every single-node worker is forked from. torch._dynamo
# is listed because torch.optim imports it on the first optimizer it builds (~2 s of CPU).
WORKER_PRELOAD = ["torch", "torch._dynamo", "commlab.loop.loop", "commlab.loop.worker"]


def start_worker_server() -> None:
    """Start the fork server the workers are forked from, with :data:`WORKER_PRELOAD` (once)."""
    import multiprocessing.forkserver

    multiprocessing.forkserver.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts
    multiprocessing.forkserver.ensure_running()


def start_worker_server_early(config_path: str) -> None:
    """Start the workers' fork server now if the run file asks for one node and no emulated network,
    so that its imports overlap this process's own (validating the config imports torch too):
    about 2.5 s less per run on 2 cores. Only a head start: a wrong guess costs a server that
    exits with this process unused, and :func:`run_torchrun` starts it when this did not."""
    import yaml

    try:
        with open(config_path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return  # load_config reports it
    if isinstance(raw, dict) and raw.get("nodes", 1) == 1 and not raw.get("network"):
        start_worker_server()


def run_worker(argv: list[str]) -> None:
    """One worker: :mod:`commlab.loop.worker` on ``argv`` (``--config ...``) in a process forked by
    torchrun's agent; its exit status is the worker's."""
    from commlab.loop.worker import main

    rc = main(argv)
    if rc:
        raise SystemExit(rc)


def run_torchrun(args: list[str]) -> int:
    """``torchrun *args`` inside this process, with torchrun's exit status.

    The same elastic agent, rendezvous and failure handling as the ``torchrun`` command
    (torch.distributed.run), with two savings that matter when every run pays them: no second
    interpreter importing torch, and workers forked from a fork server that imported torch and the
    training loop once (:data:`WORKER_PRELOAD`) instead of ``workers`` fresh interpreters each
    importing them (~5 s of CPU apiece). The workers run :func:`run_worker` on the arguments of
    the ``-m commlab.loop`` command in ``args``. On SIGTERM/SIGINT the agent forwards the signal to the workers,
    waits for them (they checkpoint) and this returns 128 + the signal; a failed worker stops the
    others and the failure table names its rank (exit 1)."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    options = parse_args(args)
    if options.standalone:  # as torchrun's own run(): a private c10d store on a free local port
        options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    options.start_method = "forkserver"
    launch_config, _, _ = config_from_args(options)
    start_worker_server()
    try:
        elastic_launch(config=launch_config, entrypoint=run_worker)(list(options.training_script_args))
    except ChildFailedError as err:
        print(err, file=sys.stderr, flush=True)
        return 1
    except SignalException as err:
        # the code is said here too: under SLURM's job step the executor reports any failure as 1
        print(f"[commlab launch] {signal.Signals(err.sigval).name}: the workers were stopped; exit "
              f"{128 + int(err.sigval)}", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``launch`` options (shared by ``commlab launch`` and ``python -m commlab.launch``)."""
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--sentinel", help="run record JSON written by rank 0 at the end")
    parser.add_argument("--network-mbit", type=float, metavar="MBIT",
                        help="emulate per-worker links of this bandwidth (needs root and iproute2); "
                             "overrides network.bandwidth_mbit")
    parser.add_argument("--latency-ms", type=float, metavar="MS",
                        help="one-way latency to emulate (needs sch_netem); overrides network.latency_ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlab.launch", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return launch(args.config, args.sentinel, args.network_mbit, args.latency_ms)


if __name__ == "__main__":
    raise SystemExit(main())
