"""Communication and timing accounting shared by the Communicator, the selectors and the loop.

Counters are cumulative since the start of the run (they are saved in checkpoints so that a
resumed run keeps counting where it stopped). The training loop reads :meth:`CommStats.totals`
at every log point and logs it beside the loss, so every plot can use bytes, reductions or seconds
as its x-axis. Besides bytes, each collective counts the point-to-point messages it sent
(``messages_sent``; each costs the transport's framing on the wire), and ``by_op`` keeps bytes
and messages per operation.

Elements, bytes and messages are recorded exactly when a call is made. Seconds come from the
run's :class:`~commlab.core.clock.DeviceClock` (device time on CUDA, host time on the CPU): on
CUDA they arrive when the clock resolves its pending intervals, which :meth:`CommStats.totals` and
:meth:`CommStats.state_dict` do first, so what they return is complete. ``comm_seconds`` is the
collectives' own time (an asynchronous one: its launch), ``blocked_seconds`` the waits for
asynchronous ones, ``selection_seconds`` the sparse methods' selections.

Under an emulated network (docs/network.md, "Bytes on the wire") the launcher names the worker's
interface (``COMMLAB_WIRE_INTERFACE``): :meth:`CommStats.totals` then adds that interface's own
counters (``wire_tx_bytes``, ``wire_rx_bytes``, ``wire_tx_packets``, ``wire_rx_packets``: every
frame the link carried, cumulative since the network was built), so rank 0's log has the wire
beside the accounting at every log point. With ``COMMLAB_WIRE_LOG`` (a folder) every rank also
appends each log point's totals to ``<folder>/rank<r>.jsonl``: the other ranks' figures, which
only rank 0's MLflow run would otherwise lose. Reading the counters costs a few file reads per log
point and sends nothing.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from commlab.core.clock import DeviceClock

COUNTERS = (
    "elements_sent", "elements_recv", "bytes_sent", "bytes_recv",
    "collectives_global", "collectives_local", "reductions_global", "reductions_local",
    "comm_seconds", "blocked_seconds", "selection_seconds", "elements_selected", "messages_sent",
)
MAX_CALLS = 4096  # call records kept between drains: the newest; the counters count every call
INTERFACE_ENV = "COMMLAB_WIRE_INTERFACE"  # the worker's link, set by the launcher of an emulated run
WIRE_LOG_ENV = "COMMLAB_WIRE_LOG"  # a folder for every rank's log-point totals (rank<r>.jsonl)
WIRE_COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")


def read_interface(interface: str, proc_net_dev: str = "/proc/net/dev") -> dict[str, int]:
    """The kernel's counters of ``interface`` in this process's network namespace. Read from
    ``/proc/net/dev``, which always shows the reader's own namespace (``/sys/class/net`` shows the
    namespace sysfs was mounted in, which a worker that entered its namespace with ``setns``
    does not remount)."""
    try:
        lines = Path(proc_net_dev).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"{INTERFACE_ENV}={interface}: cannot read {proc_net_dev} ({err})") from None
    for line in lines[2:]:  # two header lines; then `name: 8 receive and 8 transmit fields`
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            values = [int(v) for v in fields.split()]
            return {"rx_bytes": values[0], "rx_packets": values[1], "tx_bytes": values[8], "tx_packets": values[9]}
    raise ValueError(f"{INTERFACE_ENV}={interface}: no such network interface here ({proc_net_dev})")


@dataclass
class WireMeter:
    """This worker's interface counters, sampled at each log point (and logged per rank)."""

    interface: str
    log_dir: str | None = None
    rank: int = 0
    points: int = 0  # log points sampled by this process (a resumed run starts again at 0)
    proc_net_dev: str = "/proc/net/dev"

    @classmethod
    def from_env(cls) -> WireMeter | None:
        interface = os.environ.get(INTERFACE_ENV)
        if not interface:
            return None
        return cls(interface, os.environ.get(WIRE_LOG_ENV) or None, int(os.environ.get("RANK", "0")))

    def sample(self, totals: dict, by_op: dict | None = None) -> dict[str, int]:
        """``wire_*`` counters now; with a log folder, append ``totals``, them and the per-operation
        figures ``by_op`` to this rank's log."""
        wire = {f"wire_{k}": v for k, v in read_interface(self.interface, self.proc_net_dev).items()}
        if self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(self.log_dir) / f"rank{self.rank}.jsonl", "a") as f:
                f.write(json.dumps({"point": self.points, **totals, **wire, "by_op": by_op}) + "\n")
        self.points += 1
        return wire


@dataclass
class CallRecord:
    """One collective call as seen by this rank."""

    op: str
    scope: str
    elements_sent: int
    elements_recv: int
    bytes_sent: int
    bytes_recv: int
    seconds: float
    messages: int = 0  # point-to-point messages sent (each costs gloo's framing on the wire)


@dataclass
class CommStats:
    """Cumulative counters plus the records of the calls since the last :meth:`drain` (at most
    :data:`MAX_CALLS`, the newest: a training run that never drains keeps bounded memory).

    ``clock``: the clock whose pending intervals feed these counters (the Communicator sets it);
    :meth:`totals` and :meth:`state_dict` resolve it first. ``in_step``: the loop sets it while
    a training step runs; seconds of collectives and waits started then are also added to
    ``step_comm_seconds``, which the loop takes off the step's time (:meth:`take_step_comm`)."""

    counters: dict = field(default_factory=lambda: {k: 0 for k in COUNTERS})
    by_op: dict = field(default_factory=dict)  # op -> {"bytes_sent": ..., "messages_sent": ...}
    calls: deque = field(default_factory=lambda: deque(maxlen=MAX_CALLS))
    keep_calls: bool = True
    wire: WireMeter | None = field(default_factory=WireMeter.from_env)
    clock: DeviceClock | None = None
    in_step: bool = False
    step_comm_seconds: float = 0.0

    def record(self, op: str, scope: str, sent: int, recv: int, esize: int, seconds: float = 0.0,
               messages: int = 0) -> CallRecord | None:
        """Count one call; returns its record (None when records are not kept), whose seconds a
        :meth:`comm_time` sink completes later."""
        c = self.counters
        c["elements_sent"] += sent
        c["elements_recv"] += recv
        c["bytes_sent"] += sent * esize
        c["bytes_recv"] += recv * esize
        c[f"collectives_{scope}"] += 1
        c["comm_seconds"] += seconds
        c["messages_sent"] += messages
        mine = self.by_op.setdefault(op, {"bytes_sent": 0, "messages_sent": 0})
        mine["bytes_sent"] += sent * esize
        mine["messages_sent"] += messages
        if not self.keep_calls:
            return None
        record = CallRecord(op, scope, sent, recv, sent * esize, recv * esize, seconds, messages)
        self.calls.append(record)
        return record

    def comm_time(self, record: CallRecord | None) -> Callable[[float], None]:
        """A clock sink for a collective's seconds: ``comm_seconds`` and the call's record."""
        return self._sink("comm_seconds", record)

    def blocked_time(self) -> Callable[[float], None]:
        """A clock sink for a wait on an asynchronous collective: ``blocked_seconds``."""
        return self._sink("blocked_seconds", None)

    def _sink(self, key: str, record: CallRecord | None) -> Callable[[float], None]:
        in_step = self.in_step  # where the call was made, not where its seconds are read

        def add(seconds: float) -> None:
            self.counters[key] += seconds
            if record is not None:
                record.seconds += seconds
            if in_step:
                self.step_comm_seconds += seconds
        return add

    def take_step_comm(self) -> float:
        """Seconds of collectives and waits started inside steps since the last call (resolve
        the clock first), and reset."""
        seconds, self.step_comm_seconds = self.step_comm_seconds, 0.0
        return seconds

    def relabel_last(self, op: str) -> None:
        """Rename the last call (a composite collective names its parts)."""
        if self.calls:
            self.calls[-1].op = op

    def add_reduction(self, scope: str) -> None:
        self.counters[f"reductions_{scope}"] += 1

    def add_selection(self, elements: int, seconds: float = 0.0) -> None:
        """Entries selected, and seconds spent selecting (a clock sink adds them when read)."""
        self.counters["elements_selected"] += int(elements)
        self.counters["selection_seconds"] += seconds

    def drain(self) -> list[CallRecord]:
        """Return and forget the call records gathered since the last drain."""
        calls = list(self.calls)
        self.calls.clear()
        return calls

    def resolve(self) -> None:
        """Read the clock's pending intervals into the counters (device time on CUDA)."""
        if self.clock is not None:
            self.clock.resolve()

    def totals(self) -> dict:
        """The counters (and, on an emulated link, the interface's ``wire_*`` counters), with the
        clock's pending seconds read first."""
        self.resolve()
        totals = dict(self.counters)
        if self.wire is not None:
            totals.update(self.wire.sample(totals, self.by_op))
        return totals

    def state_dict(self) -> dict:
        self.resolve()
        return {"counters": dict(self.counters), "by_op": {k: dict(v) for k, v in self.by_op.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.counters.update(state["counters"])
        self.by_op = {k: dict(v) for k, v in state.get("by_op", {}).items()}
