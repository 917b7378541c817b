"""The loop's compute seconds: each step's time on the device clock minus the time its collectives
and its waits for asynchronous ones took (docs/network.md, "What the seconds mean").

A step is timed like a collective (:mod:`commlab.core.clock`): host time on the CPU; on CUDA a
pair of events on the current stream, pending until the next log point, so the step's time is
the device's, not the time the host took to queue it. Collectives and waits started inside the
step are tallied apart by the Communicator's stats (``CommStats.in_step``), so collectives a
method issues outside steps (set-up, an evaluation completing SSD-SGD's in-flight allreduces)
are not taken off any step.

Example (the loop's use)::

    timer = StepTimer(clock, comm.stats, device)
    with timer.step():
        take_step(...)
    ...
    compute_s += timer.settle()      # at a log point or checkpoint: resolves the clock
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from commlab.core.clock import DeviceClock
from commlab.core.stats import CommStats


class StepTimer:
    """Compute seconds of the loop's steps (step time minus in-step communication and waits).

    Args:
        clock: the run's device clock (the Communicator's).
        stats: the Communicator's stats, whose ``in_step`` tally this timer opens and reads.
        device: the run's device (where a step's work runs).
    """

    def __init__(self, clock: DeviceClock, stats: CommStats, device: torch.device):
        self.clock, self.stats, self.device = clock, stats, device
        self._step_seconds = 0.0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one training step."""
        span = self.clock.start(self.device)
        self.stats.in_step = True
        try:
            yield
        finally:
            self.stats.in_step = False
            self.clock.stop(span, self._add)

    def _add(self, seconds: float) -> None:
        self._step_seconds += seconds

    def settle(self) -> float:
        """Compute seconds of the steps timed since the last settle. Resolves the clock (one wait
        for the device on CUDA): call it where the run reads its figures."""
        self.clock.resolve()
        compute = self._step_seconds - self.stats.take_step_comm()
        self._step_seconds = 0.0
        return compute
