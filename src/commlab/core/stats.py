"""Communication and timing accounting shared by the Communicator, the selectors and the loop.

Counters are cumulative since the start of the run (they are saved in checkpoints so that a
resumed run keeps counting where it stopped). The training loop reads :meth:`CommStats.totals`
at every log point and logs it beside the loss, so every plot can use bytes, reductions or seconds
as its x-axis. Besides bytes, each collective counts the point-to-point messages it sent
(``messages_sent``; each costs the transport's framing on the wire), and ``by_op`` keeps bytes
and messages per operation.

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
from dataclasses import dataclass, field
from pathlib import Path

COUNTERS = (
    "elements_sent", "elements_recv", "bytes_sent", "bytes_recv",
    "collectives_global", "collectives_local", "reductions_global", "reductions_local",
    "comm_seconds", "blocked_seconds", "selection_seconds", "elements_selected", "messages_sent",
)
MAX_CALLS = 4096  # call records kept between drains: the newest; the counters count every call
INTERFACE_ENV = "COMMLAB_WIRE_INTERFACE"  # the worker's link, set by the launcher of an emulated run
WIRE_LOG_ENV = "COMMLAB_WIRE_LOG"  # a folder for every rank's log-point totals (rank<r>.jsonl)
WIRE_COUNTERS = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")


def read_interface(interface: str, sys_class_net: str = "/sys/class/net") -> dict[str, int]:
    """The kernel's counters of ``interface`` in this process's network namespace."""
    folder = Path(sys_class_net) / interface / "statistics"
    try:
        return {k: int((folder / k).read_text()) for k in WIRE_COUNTERS}
    except OSError as err:
        raise ValueError(f"{INTERFACE_ENV}={interface}: no such network interface here ({err})") from None


@dataclass
class WireMeter:
    """This worker's interface counters, sampled at each log point (and logged per rank)."""

    interface: str
    log_dir: str | None = None
    rank: int = 0
    points: int = 0  # log points sampled by this process (a resumed run starts again at 0)
    sys_class_net: str = "/sys/class/net"

    @classmethod
    def from_env(cls) -> WireMeter | None:
        interface = os.environ.get(INTERFACE_ENV)
        if not interface:
            return None
        return cls(interface, os.environ.get(WIRE_LOG_ENV) or None, int(os.environ.get("RANK", "0")))

    def sample(self, totals: dict, by_op: dict | None = None) -> dict[str, int]:
        """``wire_*`` counters now; with a log folder, append ``totals``, them and the per-operation
        figures ``by_op`` to this rank's log."""
        wire = {f"wire_{k}": v for k, v in read_interface(self.interface, self.sys_class_net).items()}
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
    :data:`MAX_CALLS`, the newest: a training run that never drains keeps bounded memory)."""

    counters: dict = field(default_factory=lambda: {k: 0 for k in COUNTERS})
    by_op: dict = field(default_factory=dict)  # op -> {"bytes_sent": ..., "messages_sent": ...}
    calls: deque = field(default_factory=lambda: deque(maxlen=MAX_CALLS))
    keep_calls: bool = True
    wire: WireMeter | None = field(default_factory=WireMeter.from_env)

    def record(self, op: str, scope: str, sent: int, recv: int, esize: int, seconds: float,
               messages: int = 0) -> None:
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
        if self.keep_calls:
            self.calls.append(CallRecord(op, scope, sent, recv, sent * esize, recv * esize, seconds, messages))

    def relabel_last(self, op: str) -> None:
        """Rename the last call (a composite collective names its parts)."""
        if self.calls:
            self.calls[-1].op = op

    def add_reduction(self, scope: str) -> None:
        self.counters[f"reductions_{scope}"] += 1

    def add_blocked(self, seconds: float) -> None:
        self.counters["blocked_seconds"] += seconds

    def add_selection(self, elements: int, seconds: float) -> None:
        self.counters["elements_selected"] += int(elements)
        self.counters["selection_seconds"] += seconds

    def drain(self) -> list[CallRecord]:
        """Return and forget the call records gathered since the last drain."""
        calls = list(self.calls)
        self.calls.clear()
        return calls

    def totals(self) -> dict:
        """The counters (and, on an emulated link, the interface's ``wire_*`` counters)."""
        totals = dict(self.counters)
        if self.wire is not None:
            totals.update(self.wire.sample(totals, self.by_op))
        return totals

    def state_dict(self) -> dict:
        return {"counters": dict(self.counters), "by_op": {k: dict(v) for k, v in self.by_op.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.counters.update(state["counters"])
        self.by_op = {k: dict(v) for k, v in state.get("by_op", {}).items()}
