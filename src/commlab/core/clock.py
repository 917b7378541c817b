"""The device clock: how long a collective, a wait, a selection or a step took on the device that ran it.

Every figure of a run in seconds, except ``wall_seconds``, goes through one :class:`DeviceClock`
(docs/network.md, "What the seconds mean"): the Communicator times each collective and each wait
for an asynchronous one with it, the sparse methods their selections, the loop its steps.

* **CPU** (a CPU tensor, or no device): host ``time.perf_counter`` around the piece. A CPU
  collective or kernel has finished when its call returns, so host time is its duration, and
  the seconds are known at once.
* **CUDA**: a pair of CUDA events recorded on the device's *current stream* around the piece.
  A call on a GPU only queues work, so host time around it would measure the queueing (or, with
  a ``synchronize`` at the end, the queue: the tail of backward queued before a collective
  would be charged to it). The start event runs when the stream reaches the piece, the end
  event when the piece is done, so the pair measures the piece alone. Pairs stay *pending*:
  nothing is synchronised per call. :meth:`DeviceClock.resolve` reads them at the points where
  the run reads its figures (the loop's log point and checkpoints; ``CommStats.totals()``),
  waiting once for the last pending event, and hands each pair's seconds to its *sink*.

A sink is a function of the seconds (``CommStats`` adds them to its counters and the call
record; the loop to its step time); on the CPU it is called at :meth:`DeviceClock.stop`, on CUDA
at :meth:`DeviceClock.resolve`. Anything that reads a sink's target reads it after a resolve.

What an interval covers on CUDA: a synchronous collective, from the moment the stream reached
it (its inputs were computed) to the moment the stream may use its result (NCCL: the collective's
kernels; gloo with CUDA tensors: the copies to the host, the host algorithm, the copies back);
an asynchronous collective's launch, only what it put on the stream (next to nothing); a wait
for it (``work.wait()``), the time the stream stalled until the collective finished, which is
the *blocked* time. On the CPU the same calls are timed on the host, with the same meaning.

Example::

    >>> import torch
    >>> clock = DeviceClock()
    >>> seconds = []
    >>> with clock.timed(torch.device("cpu"), seconds.append):
    ...     _ = torch.ones(1000).sum()
    >>> clock.resolve()                       # nothing pending on the CPU: the sink ran at stop
    >>> len(seconds) == 1 and seconds[0] > 0
    True
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

Sink = Callable[[float], None]

#: Pending pairs kept before the oldest is read (bounded memory for a caller that never resolves;
#: reading the oldest waits only for work queued long ago).
MAX_PENDING = 8192


class Event(Protocol):
    """A point on a device's timeline (a CUDA event recorded on the current stream)."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Event) -> float: ...  # milliseconds from this event to ``end``


# Stream objects by (device index, raw stream handle): ``torch.cuda.current_stream`` builds a new
# one at each call, which costs more than recording the event; the raw handle is one C call.
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def _current_stream(index: int) -> torch.cuda.Stream:
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


class CudaEvent:
    """A timing CUDA event recorded on ``device``'s current stream."""

    __slots__ = ("event", "index")

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self.event.record(_current_stream(self.index))

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_time(self, end: CudaEvent) -> float:
        return self.event.elapsed_time(end.event)


def cuda_events(device: torch.device | None) -> CudaEvent | None:
    """The default event source: a CUDA event on a CUDA device, None (host time) elsewhere."""
    if device is not None and device.type == "cuda":
        return CudaEvent(device)
    return None


class Span:
    """A started interval: a host time (``start`` a float) or a recorded start event."""

    __slots__ = ("device", "start")

    def __init__(self, start: float | Any, device: torch.device | None):
        self.start = start
        self.device = device


class DeviceClock:
    """Times pieces of a step on the device that runs them; see the module docstring.

    Args:
        events: ``events(device)`` returns an unrecorded :class:`Event` to time ``device`` with,
            or None to time it on the host. Default :func:`cuda_events` (events on CUDA devices);
            tests pass fake events to drive the pending path on the CPU.
        max_pending: pairs kept pending before the oldest is read.

    Example (on a GPU: the pair is read at the resolve, not at the stop)::

        clock = DeviceClock()
        spent = []
        span = clock.start(x.device)
        y = x @ x
        clock.stop(span, spent.append)      # CUDA: spent == [] (pending), no synchronize
        clock.resolve()                     # spent == [seconds of the product on the device]
    """

    def __init__(self, events: Callable[[torch.device | None], Event | None] = cuda_events,
                 max_pending: int = MAX_PENDING):
        self._events = events
        self._pending: deque[tuple[Event, Event, Sink, torch.device]] = deque()
        # Events already read, per device, recorded again by later intervals: creating a CUDA
        # event costs more than recording one.
        self._free: dict[torch.device, list[Event]] = {}
        self.max_pending = max_pending

    def _event(self, device: torch.device | None) -> Event | None:
        free = self._free.get(device)
        return free.pop() if free else self._events(device)

    def start(self, device: torch.device | None) -> Span:
        """Start timing a piece that runs on ``device`` (None: the host)."""
        event = self._event(device)
        if event is None:
            return Span(time.perf_counter(), None)
        event.record()
        return Span(event, device)

    def stop(self, span: Span, sink: Sink) -> None:
        """End the piece started as ``span``; ``sink(seconds)`` now (host time) or at :meth:`resolve`."""
        if span.device is None:
            sink(time.perf_counter() - span.start)
            return
        end = self._event(span.device)
        end.record()
        self._pending.append((span.start, end, sink, span.device))
        if len(self._pending) > self.max_pending:
            self._read_oldest()

    @contextmanager
    def timed(self, device: torch.device | None, sink: Sink) -> Iterator[None]:
        """Time the block on ``device`` into ``sink``."""
        span = self.start(device)
        try:
            yield
        finally:
            self.stop(span, sink)

    @property
    def pending(self) -> int:
        """Intervals waiting for :meth:`resolve`."""
        return len(self._pending)

    def resolve(self) -> None:
        """Read every pending interval, oldest first, into its sink (waits for the device work
        queued before the last pending event: call it where the run reads its figures)."""
        while self._pending:
            self._read_oldest()

    def _read_oldest(self) -> None:
        start, end, sink, device = self._pending.popleft()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000.0
        free = self._free.setdefault(device, [])
        if len(free) < 2 * self.max_pending:
            free += (start, end)
        sink(seconds)
