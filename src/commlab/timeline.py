"""Where a training job's wall time goes: named phases of the launcher and of rank 0.

Every job records, on the host clock, the phases it passes through, and writes them beside the run
as ``<run dir>/timeline.json`` (:func:`merge`); ``commlab bench overhead`` prints the split of one
job and of a whole workflow run (docs/performance.md, "Around the steps"). The phases:

=================  ===========================================================================
interpreter        the launcher's process start (the kernel's start time) to its ``main``
launcher           the launcher's own work before it asks for workers (config checks, relay)
workers_start      until rank 0 runs: a fork server's imports, torchrun's agent, the fork
worker_setup       rank 0's config loading and validation
process_group      ``init_process_group`` and the runtime's checks
data               the task's data: the prepared files read, the shard built
build              the model, the method and its optimizer
mlflow             rank 0's MLflow calls: opening the run, logging, closing it
steps              the step loop, less what is named below
log_points         the log points' control allreduce and metrics (their MLflow calls excluded)
evaluation         the test set scored (every evaluation)
checkpoints        checkpoints written
outputs            the sentinel, the golden curve, the artifacts
worker_exit        rank 0's last phase to every worker gone, as the launcher sees it
teardown           the launcher's end: the relay closed, the failure record
=================  ===========================================================================

Invariants: phases are exclusive (a phase entered inside another is taken out of the outer one's
time), so a process's phases and its ``other`` (time inside no phase) add up to its wall time;
the clocks are read twice per phase entered, never inside a step, so the step loop runs as
without a timeline. Rank 0's phases cover its critical path: every other rank waits for it at the
collectives of the log points and evaluations.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

LAUNCHER_PHASES = ("interpreter", "launcher", "workers_start")
RANK0_PHASES = ("worker_setup", "process_group", "data", "build", "mlflow", "steps", "log_points", "evaluation",
                "checkpoints", "outputs")
END_PHASES = ("worker_exit", "teardown")
PHASES = (*LAUNCHER_PHASES, *RANK0_PHASES, "other", *END_PHASES)
#: The phases that are not training steps: start-up, bookkeeping and the end.
OVERHEAD_PHASES = tuple(p for p in PHASES if p != "steps")
RANK0_FILE = "timeline.rank0.json"
FILE = "timeline.json"


def process_start_time() -> float | None:
    """This process's start as a Unix time, from the kernel (``/proc``); None where unknown. Its age
    is the time since boot (``/proc/uptime``, to the hundredth) less its start after boot
    (``/proc/self/stat``, in clock ticks): the boot time ``btime`` is whole seconds only."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): starttime after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - max(0.0, uptime - started)
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    """One process's exclusive phase times (seconds) from its creation (``start``, Unix time)."""

    def __init__(self, start: float | None = None):
        self.start = time.time() if start is None else start
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._nested: list[float] = []  # per open phase: the time of the phases entered inside it

    @contextmanager
    def phase(self, name: str):
        """Time the block as ``name``, less the phases entered inside it."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r} (phases: {', '.join(PHASES)})")
        began = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - began
            self.seconds[name] += elapsed - self._nested.pop()
            self.counts[name] += 1
            if self._nested:
                self._nested[-1] += elapsed

    def to_dict(self) -> dict:
        """The phases so far, ``other`` (time in none of them) and the span's start and end."""
        end = time.time()
        seconds = dict(self.seconds)
        seconds["other"] = max(0.0, end - self.start - sum(seconds.values()))
        return {"start": self.start, "end": end, "seconds": seconds, "counts": dict(self.counts)}


#: This process's timeline (the loop's phases are recorded on it; rank 0 writes it).
CURRENT = Timeline()


def restart() -> Timeline:
    """A new timeline for this process from now: a worker forked from a process that imported this
    module long before starts its own here."""
    global CURRENT
    CURRENT = Timeline()
    return CURRENT


def phase(name: str):
    """``with phase("evaluation"): ...`` on this process's timeline."""
    return CURRENT.phase(name)


def write_rank0(folder: str | Path, timeline: Timeline | None = None) -> None:
    """Rank 0's phases into ``folder/timeline.rank0.json`` (the run's folder), for the launcher."""
    path = Path(folder) / RANK0_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps((timeline or CURRENT).to_dict()))


def merge(folder: str | Path, launcher: dict, workers_requested: float, workers_done: float,
          end: float | None = None) -> dict | None:
    """The job's timeline from the launcher's marks (``launcher``: its ``start`` (process start) and
    ``main`` Unix times) and rank 0's file, written to ``folder/timeline.json`` and returned; None
    when rank 0 wrote nothing (it failed before its end, or the run does not log). Every phase is in
    seconds; ``total`` is the launcher's process start to ``end`` (now by default)."""
    folder = Path(folder)
    try:
        rank0 = json.loads((folder / RANK0_FILE).read_text())
    except (OSError, ValueError):
        return None
    end = time.time() if end is None else end
    start = launcher.get("start") or launcher["main"]  # no /proc: the interpreter's start is not known
    seconds = {"interpreter": launcher["main"] - start,
               "launcher": workers_requested - launcher["main"],
               "workers_start": rank0["start"] - workers_requested,
               **rank0["seconds"],
               "worker_exit": workers_done - rank0["end"],
               "teardown": end - workers_done}
    seconds = {p: round(max(0.0, seconds.get(p, 0.0)), 4) for p in PHASES}
    record = {"total": round(end - start, 4), "seconds": seconds, "counts": rank0.get("counts", {}),
              "served": bool(launcher.get("served"))}
    (folder / FILE).write_text(json.dumps(record, indent=1) + "\n")
    (folder / RANK0_FILE).unlink(missing_ok=True)
    return record
