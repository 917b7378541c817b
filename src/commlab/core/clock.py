"""Clocks: how long a piece of a step took, as the methods measure it (selection times, waits).

A clock hands out a mark and later the seconds since that mark. The run builds one clock for
its device and hands it to the method (``MethodContext.clock``), so a method times its pieces
without knowing how the device is timed. :class:`HostClock` is the host's clock; a clock that
reads device events implements the same two methods.

Example::

    >>> from commlab.core.clock import HostClock
    >>> clock = HostClock()
    >>> mark = clock.mark()
    >>> seconds = clock.seconds_since(mark)
    >>> seconds >= 0
    True
"""

from __future__ import annotations

import time

import torch


class Clock:
    """Seconds between two points of a step: :meth:`mark`, then :meth:`seconds_since` the mark."""

    def mark(self) -> object:
        """A point in time to measure from (opaque: pass it to :meth:`seconds_since`)."""
        raise NotImplementedError

    def seconds_since(self, mark: object) -> float:
        """Seconds from ``mark`` to now."""
        raise NotImplementedError


class HostClock(Clock):
    """Host wall time (``time.perf_counter``) to the completion of the device's queued work.

    On a CUDA device every reading first waits for the work queued on the device
    (``torch.cuda.synchronize``), so an interval covers the kernels launched inside it; that
    wait is a host sync at each reading. On the CPU a reading is a plain ``perf_counter``.

    Args:
        device: the device whose queued work an interval includes (None: the CPU).

    Example::

        >>> import torch
        >>> clock = HostClock(torch.device("cpu"))
        >>> mark = clock.mark()
        >>> _ = torch.ones(1000).sum()
        >>> clock.seconds_since(mark) > 0
        True
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self._sync = device is not None and device.type == "cuda"

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def mark(self) -> float:
        return self._now()

    def seconds_since(self, mark: float) -> float:
        return self._now() - mark
