"""Where a result comes from: the code's commit, a run's source, the machine a measurement ran on.

Every run and every benchmark names the code that produced it (docs/architecture.md, "The flow of
one run": the sentinel, the MLflow run and each benchmark file carry the commit):

* :func:`git_commit`: the checkout's commit, ``-dirty`` when tracked files changed, ``unknown``
  without git or a checkout;
* :func:`source_tags`: MLflow's standard source tags of a training run (the program every training
  process runs, :data:`ENTRY_MODULE`, and the commit, branch and remote when git knows them);
* :func:`environment`: a benchmark's record of its machine (host, Python, torch, device, load,
  commit, time, the workers' malloc settings).

Git is asked in the code's own checkout, never the working directory's, and each call is bounded
(:data:`GIT_TIMEOUT_S`): a git stalled on a slow disk must not stall a run's start. Nothing here
imports MLflow or torch at import time.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from commlab.malloc import describe

CHECKOUT = Path(__file__).resolve().parents[2]  # src/commlab/provenance.py -> the repository
#: The module every training process runs (``python -m commlab.loop``, ``commlab train`` and each
#: worker the launcher starts): a run's source.
ENTRY_MODULE = Path(__file__).resolve().parent / "loop" / "worker.py"
GIT_TIMEOUT_S = 30


def git_commit() -> str:
    """The commit of the code that runs, with ``-dirty`` when the tree has changes ("unknown"
    without git or a checkout)."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def source_tags() -> dict[str, str]:
    """MLflow's standard source tags for a run of this checkout's training loop: the UI's Source
    column (the program: :data:`ENTRY_MODULE`) and Version column (the commit, linked when the
    remote is known). Without git only the program."""
    tags = {"mlflow.source.name": str(ENTRY_MODULE), "mlflow.source.type": "LOCAL"}
    head = _git("rev-parse", "HEAD", "--abbrev-ref", "HEAD").splitlines()
    if len(head) == 2:
        tags["mlflow.source.git.commit"] = head[0]
        if head[1] != "HEAD":  # not a detached checkout
            tags["mlflow.source.git.branch"] = head[1]
    remote = _git("config", "--get", "remote.origin.url")
    if remote:
        tags["mlflow.source.git.repoURL"] = remote
    return tags


def environment() -> dict:
    """The machine and code a benchmark measured on, for the ``environment`` block of its JSON."""
    import torch

    cuda = torch.cuda.is_available()
    return {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})",
            "cuda": cuda, "git_commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "worker_malloc": describe()}  # the training workers' malloc settings (commlab.loop.heap)


def _git(*args: str) -> str:
    """One git command's output in the code's checkout ("" when git or the checkout is absent, or
    when it fails or outlasts :data:`GIT_TIMEOUT_S`)."""
    try:
        out = subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""
