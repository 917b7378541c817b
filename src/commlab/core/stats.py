"""Communication and timing accounting shared by the Communicator, the selectors and the loop.

Counters are cumulative since the start of the run (they are saved in checkpoints so that a
resumed run keeps counting where it stopped). The training loop reads :meth:`CommStats.totals`
after every step and logs it beside the loss, so every plot can use bytes, reductions or seconds
as its x-axis.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

COUNTERS = (
    "elements_sent", "elements_recv", "bytes_sent", "bytes_recv",
    "collectives_global", "collectives_local", "reductions_global", "reductions_local",
    "comm_seconds", "blocked_seconds", "selection_seconds", "elements_selected",
)
MAX_CALLS = 4096  # call records kept between drains: the newest; the counters count every call


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


@dataclass
class CommStats:
    """Cumulative counters plus the records of the calls since the last :meth:`drain` (at most
    :data:`MAX_CALLS`, the newest: a training run that never drains keeps bounded memory)."""

    counters: dict = field(default_factory=lambda: {k: 0 for k in COUNTERS})
    calls: deque = field(default_factory=lambda: deque(maxlen=MAX_CALLS))
    keep_calls: bool = True

    def record(self, op: str, scope: str, sent: int, recv: int, esize: int, seconds: float) -> None:
        c = self.counters
        c["elements_sent"] += sent
        c["elements_recv"] += recv
        c["bytes_sent"] += sent * esize
        c["bytes_recv"] += recv * esize
        c[f"collectives_{scope}"] += 1
        c["comm_seconds"] += seconds
        if self.keep_calls:
            self.calls.append(CallRecord(op, scope, sent, recv, sent * esize, recv * esize, seconds))

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
        return dict(self.counters)

    def state_dict(self) -> dict:
        return {"counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        self.counters.update(state["counters"])
