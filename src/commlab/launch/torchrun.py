"""Starting workers through torchrun: one node with ``torchrun --standalone``, several nodes with
``srun`` starting one torchrun agent per node of the SLURM allocation (c10d rendezvous at its
first node).

On one node torchrun's elastic agent runs inside the launching process (:func:`run_torchrun`),
its workers forked from a server that imported torch and the training loop once. Every worker
runs the worker entry point, :mod:`commlab.loop.worker` (``python -m commlab.loop``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` command


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


def train_argv(config_path: str, sentinel: str | None, overrides: list[str] = (),
               relay: str | None = None) -> list[str]:
    """``-m commlab.loop`` arguments of one worker (the worker entry point, :mod:`commlab.loop.worker`);
    ``relay``: the launcher's tracking relay (:mod:`commlab.tracking_relay`)."""
    train = ["-m", "commlab.loop", "--config", config_path]
    train += ["--sentinel", sentinel] if sentinel else []
    return train + (["--tracking-relay", relay] if relay else []) + list(overrides)


def network_override(net) -> str:
    """The ``network=...`` config override that tells an emulated run's workers the links as
    built and measured (``network.emulated``, logged by rank 0 as ``network_*`` params)."""
    import dataclasses

    return "network=" + json.dumps({**dataclasses.asdict(net.spec), "emulated": net.params}, sort_keys=True)


def torchrun_args(config: dict, config_path: str, sentinel: str | None, relay: str | None = None) -> list[str]:
    """torchrun's arguments that start this run's workers (one node: standalone rendezvous, where
    the launcher's tracking ``relay`` serves rank 0)."""
    restarts = [f"--max-restarts={config.get('max_restarts', 0)}"]
    if config.get("nodes", 1) == 1:
        train = train_argv(config_path, sentinel, relay=relay)
        return ["--standalone", f"--nproc-per-node={config['workers']}", *restarts, *train]
    from commlab.config import run_dir

    train = train_argv(config_path, sentinel)  # rank 0 may be on another node: no relay
    job = os.environ.get("SLURM_JOB_ID", "commlab")
    # Each node's agent keeps its workers' error files in the run's folder (a folder per node and
    # job: <run dir>/torchelastic/<job>_*/attempt_<n>/<local rank>), on the file system every node
    # sees, rather than in a /tmp/torchelastic_* of its own that nothing removes.
    logs = run_dir(config).resolve() / "torchelastic"
    return [f"--nnodes={config['nodes']}", f"--nproc-per-node={config['workers']}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={slurm_first_host()}:{rendezvous_port(job)}", f"--rdzv-id={job}",
            f"--log-dir={logs}", *restarts, *train]


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


# Imported once by the fork server that every single-node worker is forked from. torch._dynamo
# is listed because torch.optim imports it on the first optimizer it builds (a large import);
# commlab.launch.warm builds what validating the run's config needs (every method imported).
WORKER_PRELOAD = ["torch", "torch._dynamo", "commlab.loop.loop", "commlab.loop.worker", "commlab.launch.warm"]


def start_worker_server() -> None:
    """Start the fork server the workers are forked from, with :data:`WORKER_PRELOAD` (once)."""
    import multiprocessing.forkserver

    multiprocessing.forkserver.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts
    multiprocessing.forkserver.ensure_running()


def start_worker_server_early(config_path: str) -> None:
    """Start the workers' fork server now if the run file asks for one node and no emulated network,
    so that its imports overlap this process's own (validating the config imports torch too):
    the workers then start sooner by the length of that import. Nothing before it may
    import torch (the command line, :mod:`commlab.loop`'s package). Only a head start: a wrong
    guess costs a server that exits with this process unused, and :func:`run_torchrun` starts it
    when this did not."""
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


#: A worker's exit status for a bad config or damaged data, after its one-line message (the
#: ``return 2`` of commlab.loop.worker, which this module does not import: it would pull torch into
#: the launcher before the workers' fork server starts).
EXIT_BAD_INPUT = 2


class _QuietBadInput(logging.Filter):
    """Drops the elastic agent's traceback for a worker that exited with :data:`EXIT_BAD_INPUT`:
    the worker already said what is wrong, and a traceback of the agent's poll loop buries it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"(exitcode: {EXIT_BAD_INPUT})" not in record.getMessage()


def run_torchrun(args: list[str], on_failure=None, start_method: str = "forkserver") -> int:
    """``torchrun *args`` inside this process, with torchrun's exit status.

    The same elastic agent, rendezvous and failure handling as the ``torchrun`` command
    (torch.distributed.run), with two savings that matter when every run pays them: no second
    interpreter importing torch, and workers forked from a fork server that imported torch and the
    training loop once (:data:`WORKER_PRELOAD`) instead of ``workers`` fresh interpreters each
    importing them (seconds of CPU apiece). The workers run :func:`run_worker` on the arguments of
    the ``-m commlab.loop`` command in ``args``. On SIGTERM/SIGINT the agent forwards the signal to the workers,
    waits for them (they checkpoint) and this returns 128 + the signal; a failed worker stops the
    others and the failure table names its rank (exit 1); workers that stopped on a bad config or
    damaged data (exit 2, their message printed once) give exit 2 and one line. ``on_failure(rank,
    exitcode)`` hears of the first failed worker (a negative exit code: killed by that signal).
    The agent's per-run folder (workers' error files) lives in a temporary folder removed when the
    launch ends: torchrun's default, ``/tmp/torchelastic_*``, stays behind after every run.
    ``start_method="fork"``: the workers are forked from this process itself, for a launcher that
    has imported what they need and run no torch operation (:mod:`commlab.launch.server`)."""
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    options = parse_args(args)
    if options.standalone:  # as torchrun's own run(): a private c10d store on a free local port
        options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    options.start_method = start_method
    agent_dir = None  # a --log-dir given in args is the caller's to keep
    if options.log_dir is None:
        agent_dir = tempfile.TemporaryDirectory(prefix="commlab-torchelastic-")
        options.log_dir = agent_dir.name
    launch_config, _, _ = config_from_args(options)
    if start_method == "forkserver":
        start_worker_server()
    agent_log, quiet = logging.getLogger("torch.distributed.elastic.multiprocessing.api"), _QuietBadInput()
    agent_log.addFilter(quiet)
    try:
        elastic_launch(config=launch_config, entrypoint=run_worker)(list(options.training_script_args))
    except ChildFailedError as err:
        if {f.exitcode for f in err.failures.values()} == {EXIT_BAD_INPUT}:
            # the workers said what is wrong (rank 0, one line); torch's failure table adds nothing
            print(f"[commlab launch] the run stopped before training (exit {EXIT_BAD_INPUT}): see the "
                  "message above", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        print(err, file=sys.stderr, flush=True)
        if on_failure is not None:
            rank, failure = err.get_first_failure()
            on_failure(rank, failure.exitcode)
        return 1
    except SignalException as err:
        # the code is said here too: under SLURM's job step the executor reports any failure as 1
        print(f"[commlab launch] {signal.Signals(err.sigval).name}: the workers were stopped; exit "
              f"{128 + int(err.sigval)}", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    finally:
        agent_log.removeFilter(quiet)
        if agent_dir is not None:
            agent_dir.cleanup()  # the failures were read from its error files above
    return 0
