"""Start, watch and interrupt whole jobs from outside, as a cluster would (docs/cluster.md, sections 3-6).

The fault, resume and concurrency tests drive real ``commlab launch`` / ``torchrun`` jobs with
these helpers, and they serve to rehearse a preemption by hand::

    job = start_job(["launch", "--config", "run.yaml"], log="job.log")   # run.yaml: testing.step_delay_s: 0.1
    wait_for(lambda: checkpoint_step("out") == 16, job=job)     # epoch 1 is checkpointed
    signal_job(job, signal.SIGTERM)                             # what SLURM sends before preemption
    job.wait()                                                  # 143: preempted, resumable

:func:`signal_job` reaches the launcher, torchrun and every worker at once, as SLURM's signals
reach every process of a job step.
The run config's ``testing.step_delay_s`` makes the loop sleep after each step so that a signal
sent from outside lands where the test means it to (mid-epoch), however loaded the machine is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml


def write_config(path: str | Path, **fragment) -> Path:
    """Write a run config YAML (``fragment`` merged over nothing: the loader adds defaults)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(fragment, sort_keys=False))
    return path


#: The longest temporary folder a job is given: multiprocessing's fork server binds its socket at
#: <folder>/pymp-XXXXXXXX/listener-XXXXXXXX (32 bytes more), and a socket's path holds 107 bytes.
MAX_SCRATCH_PATH = 107 - 32


def scratch_env(folder: Path) -> dict[str, str]:
    """``{"TMPDIR": folder/tmp}`` (created) for a job whose temporary files should stay with its
    other files; empty when that path is too long for a socket in it (the job keeps /tmp)."""
    scratch = folder / "tmp"
    if len(str(scratch)) > MAX_SCRATCH_PATH:
        return {}
    scratch.mkdir(parents=True, exist_ok=True)
    return {"TMPDIR": str(scratch)}


def start_job(argv: list[str], log: str | Path, env: dict | None = None, cwd: str | Path | None = None,
              module: str = "commlab") -> subprocess.Popen:
    """``python -m <module> *argv`` with stdout+stderr appended to ``log``.

    The job's temporary files (torchrun's agent folder, the fork server's socket folder) go to a
    ``tmp`` folder beside ``log`` unless ``env`` sets ``TMPDIR``: a job killed with SIGKILL cannot
    remove them, and there they are removed with the log instead of staying in /tmp. Where that
    folder's path is too long for the fork server's socket in it, the job keeps the usual TMPDIR."""
    env = env or {}
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                **({} if "TMPDIR" in env else scratch_env(Path(log).absolute().parent)), **env}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", module, *argv], stdout=out, stderr=subprocess.STDOUT,
                                env=full_env, cwd=cwd)


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process (Linux /proc)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                table[int(entry.name)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                continue
    return table


def descendants(*roots: int) -> set[int]:
    """The live processes at or below ``roots`` (zombies count as gone)."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in table and table[pid][1] != "Z" and pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def signal_job(job: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the launcher and every process below it, as SLURM signals every process
    of a job step (torchrun starts its workers in sessions of their own, so a signal to the
    launcher's process group alone would not reach them)."""
    for pid in descendants(job.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def reap(job: subprocess.Popen, timeout: float = 90.0) -> int:
    """Wait until the launcher and every process it started are gone (a launcher killed by a
    signal may leave workers finishing their checkpoint); SIGKILL what is left after ``timeout``.
    Returns the launcher's exit code as a shell reports it (128 + signal when killed by one)."""
    deadline = time.monotonic() + timeout
    known = descendants(job.pid)
    while time.monotonic() < deadline:
        known = descendants(*known) | ({job.pid} if job.poll() is None else set())
        if not known:
            break
        time.sleep(0.1)
    for pid in descendants(*known):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rc = job.wait()
    return 128 - rc if rc < 0 else rc


def wait_for(predicate: Callable[[], bool], timeout: float = 120.0, job: subprocess.Popen | None = None,
             poll: float = 0.05) -> None:
    """Poll ``predicate`` until true; fail early if ``job`` exits first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if job is not None and job.poll() is not None:
            raise AssertionError(f"job exited with {job.returncode} before the awaited state")
        if time.monotonic() > deadline:
            raise AssertionError(f"state not reached within {timeout} s")
        time.sleep(poll)


def checkpoint_step(output_dir: str | Path) -> int | None:
    """Step of the latest complete checkpoint of a run, or None."""
    latest = Path(output_dir) / "checkpoints" / "latest.json"
    try:
        return json.loads(latest.read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def worker_pids(job: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the job's training workers, found by the process name each worker takes
    (:data:`commlab.loop.worker.WORKER_NAME`) among the processes below the launcher."""
    from commlab.loop.worker import WORKER_NAME

    pattern = re.compile(WORKER_NAME.format(rank=r"(\d+)") + "$")
    ranks = {}
    for pid in descendants(job.pid) - {job.pid}:
        try:
            match = pattern.match(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
        if match:
            ranks[int(match.group(1))] = pid
    return ranks


def run_history(uri: str, run_id: str, skip: Callable[[str], bool] = lambda key: False) -> dict[str, list]:
    """Every metric of an MLflow run as ``key -> [(step, value), ...]`` in step order."""
    from commlab.tracking import client as tracking_client

    client = tracking_client(uri)
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in sorted(run.data.metrics) if not skip(key)}


def is_timing(key: str) -> bool:
    """Metrics measured in seconds differ between any two runs; everything else must not."""
    return "seconds" in key or key.endswith(("_s", "_ms")) or "time" in key
