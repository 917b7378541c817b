"""Launch one experiment on its workers: the command Snakemake runs for every grid cell.

    python -m commlab launch --config results/p/name/seed0/config.yaml --sentinel .../sentinel.json

* one node: ``torchrun --standalone`` with ``workers`` processes (a free rendezvous port is picked,
  so parallel jobs never collide);
* several nodes (``nodes > 1``, inside a SLURM allocation): ``srun`` starts one torchrun per node,
  which meet through c10d rendezvous at the first node of the allocation;
* ``max_restarts > 0`` lets torchrun restart failed workers, which resume from the last checkpoint.

The config is validated here first, so a bad key fails before any worker starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from commlab.config import ConfigError, load_config


def slurm_first_host() -> str:
    """The first host name of the SLURM allocation (the rendezvous host)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise RuntimeError("nodes > 1 needs a SLURM allocation (SLURM_JOB_NODELIST is not set)")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0]


def torchrun_command(config: dict, config_path: str, sentinel: str | None) -> list[str]:
    """The command line that starts this run's workers (without srun)."""
    train = ["-m", "commlab", "train", "--config", config_path]
    if sentinel:
        train += ["--sentinel", sentinel]
    restarts = [f"--max-restarts={config.get('max_restarts', 0)}"]
    if config.get("nodes", 1) == 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={config['workers']}", *restarts, *train]
    job = os.environ.get("SLURM_JOB_ID", "commlab")
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={config['nodes']}",
            f"--nproc-per-node={config['workers']}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={slurm_first_host()}:29500", f"--rdzv-id={job}", *restarts, *train]


def launch(config_path: str, sentinel: str | None = None) -> int:
    try:
        config = load_config(config_path)
    except ConfigError as err:
        print(f"commlab launch: {err}", file=sys.stderr)
        return 2
    cmd = torchrun_command(config, config_path, sentinel)
    if config.get("nodes", 1) > 1:
        if shutil.which("srun") is None:
            print("commlab launch: nodes > 1 needs srun (run inside a SLURM allocation)", file=sys.stderr)
            return 2
        cmd = ["srun", f"--nodes={config['nodes']}", "--ntasks-per-node=1", *cmd]
    print("[commlab launch] " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)
