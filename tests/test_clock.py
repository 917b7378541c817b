"""The device clock (core/clock.py) and every figure timed with it, driven on the CPU with fake
device events: intervals stay pending (no synchronisation per call) until the run reads its
figures, each collective's seconds are its own interval, waits for asynchronous collectives are
blocked time, the loop's compute is its steps minus the collectives and waits inside them, and
selections reach ``selection_seconds`` and the methods' ``select_ms``.

A fake event records a point on a fake device timeline that advances by ``tick`` seconds at every
record, so every interval's length is known exactly; on the CPU without fakes the clock is the
host's. (tests/test_gpu_timing.py checks the same on CUDA with real events.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from commlab.core import CommStats, Communicator, DeviceClock
from commlab.loop.timing import StepTimer
from commlab.testing import drive, run_distributed


class Timeline:
    """A fake device: events record its time, which moves ``tick`` seconds at every record."""

    def __init__(self, tick: float = 1.0):
        self.now, self.tick, self.syncs, self.created = 0.0, tick, 0, 0

    def events(self, device):
        self.created += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, timeline: Timeline):
        self.timeline, self.t = timeline, None

    def record(self) -> None:
        self.timeline.now += self.timeline.tick
        self.t = self.timeline.now

    def synchronize(self) -> None:
        self.timeline.syncs += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1000.0  # milliseconds, as CUDA events


def fake_comm(tick: float = 1.0) -> tuple[Communicator, Timeline]:
    timeline = Timeline(tick)
    return Communicator(stats=CommStats(), clock=DeviceClock(timeline.events)), timeline


def test_host_time_reaches_the_sink_at_stop_and_nothing_is_pending():
    clock, got = DeviceClock(), []
    with clock.timed(torch.device("cpu"), got.append):
        torch.ones(10_000).sum()
    assert len(got) == 1 and got[0] > 0 and clock.pending == 0


def test_pending_pairs_are_bounded_and_read_oldest_first():
    timeline = Timeline(tick=1.0)
    clock, got = DeviceClock(timeline.events, max_pending=3), []
    for i in range(5):
        span = clock.start(torch.device("cpu"))
        timeline.now += i  # interval i lasts i + 1 ticks
        clock.stop(span, got.append)
    assert got == [1.0, 2.0] and clock.pending == 3 and timeline.syncs == 2
    clock.resolve()
    assert got == [1.0, 2.0, 3.0, 4.0, 5.0] and clock.pending == 0 and timeline.syncs == 5


def test_events_that_were_read_are_recorded_again():
    timeline = Timeline()
    clock, got = DeviceClock(timeline.events), []
    for _ in range(2):
        for _ in range(5):
            clock.stop(clock.start(torch.device("cpu")), got.append)
        clock.resolve()
    assert got == [1.0] * 10 and timeline.created == 10  # the second window made no event


def _collectives(rank, world):
    comm, timeline = fake_comm()
    x = torch.arange(6, dtype=torch.float32) + rank
    comm.all_reduce(x, op="avg")
    comm.broadcast(torch.zeros(3), src=0)
    comm.all_gather(torch.ones(2))
    comm.all_to_all_single(torch.arange(world, dtype=torch.float32), [1] * world, [1] * world)
    comm.all_gatherv(torch.ones(rank + 1))
    before = dict(comm.stats.counters), comm.clock.pending, timeline.syncs
    records = list(comm.stats.calls)
    totals = comm.stats.totals()  # a reader of the counters resolves the clock first
    return x, before, records, totals, timeline.syncs


def test_collectives_stay_pending_until_read_then_each_gets_its_own_interval():
    world = 2
    for x, before, records, totals, syncs in run_distributed(_collectives, world):
        assert torch.equal(x, torch.arange(6, dtype=torch.float32) + 0.5)
        counters, pending, syncs_before = before
        calls = 6  # all_gatherv is two collectives
        assert pending == calls and syncs_before == 0 and counters["comm_seconds"] == 0
        assert counters["bytes_sent"] > 0  # bytes are counted at the call
        assert totals["comm_seconds"] == calls * 1.0  # start and end: one tick each
        assert [r.seconds for r in records] == [1.0] * calls
        assert syncs == calls


def _async_and_steps(rank, world):
    comm, timeline = fake_comm()
    timer = StepTimer(comm.clock, comm.stats, torch.device("cpu"))
    with timer.step():  # records at 1 ... 12
        comm.all_reduce(torch.ones(4))  # 2 -> 3
        timeline.now += 10  # compute: 3 -> 13
        pending = comm.all_reduce_async(torch.ones(4) * rank, op="avg")  # launch: 14 -> 15
        timeline.tick = 3.0  # the wait below is long: 18 -> 21
        result = pending.wait()
        timeline.tick = 1.0
    # end of step at 22: the step lasted 22 - 1 = 21 ticks
    outside = timeline.now
    comm.all_reduce(torch.ones(4))  # outside any step: comm, not taken off compute
    seen = comm.stats.counters["blocked_seconds"], timeline.syncs
    compute = timer.settle()
    return result, seen, compute, comm.stats.totals(), outside, timeline.syncs


def test_blocked_time_is_the_wait_and_compute_is_the_step_minus_its_collectives():
    for result, seen, compute, totals, outside, syncs in run_distributed(_async_and_steps, 2):
        assert torch.equal(result, torch.full((4,), 0.5))
        assert seen == (0, 0)  # nothing read, nothing synchronised, before the log point
        assert outside == 22.0
        assert totals["blocked_seconds"] == 3.0
        assert totals["comm_seconds"] == 1.0 + 1.0 + 1.0  # two in the step (one a launch), one outside
        assert compute == 21.0 - (1.0 + 1.0) - 3.0
        assert syncs == 5  # one per interval, all at the settle


def _selections(rank, world, method, options):
    comm, timeline = fake_comm(tick=0.5)
    gen = torch.Generator().manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
    driven = drive(method, options, model=model, steps=3, comm=comm, train={"lr": 0.1, "optimizer": "sgd"},
                   grads=lambda step: torch.randn(sum(p.numel() for p in model.parameters()), generator=gen))
    stats = comm.stats
    before = stats.counters["selection_seconds"], stats.counters["elements_selected"], timeline.syncs
    totals = stats.totals()
    return before, totals, driven.algo.metrics()


@pytest.mark.parametrize("method, options, per_step", [
    ("topk_allgather", {"density": 0.05, "warmup_steps": 0}, 1),  # one selection per step
    ("redsync", {"density": 0.05, "dense_at_most": 32}, 2),  # one per compressed layer (2048, 128)
])
def test_selections_are_timed_on_the_clock_and_read_at_the_log_point(method, options, per_step):
    for before, totals, metrics in run_distributed(_selections, 2, args=(method, options)):
        seconds, selected, syncs = before
        assert seconds == 0 and selected > 0 and syncs == 0
        assert totals["selection_seconds"] == 3 * per_step * 0.5
        ms = {k: v for k, v in metrics.items() if k.startswith("select_ms")}
        assert ms and all(v == 500.0 for v in ms.values()), ms  # 0.5 s per call


def test_no_production_module_synchronises_the_device():
    """Timing reads events at log points; a ``torch.cuda.synchronize`` in the core, the methods,
    the compressors or the loop would put a host sync back into every step."""
    src = Path(__file__).resolve().parents[1] / "src" / "commlab"
    found = []
    for package in ("core", "compress", "algorithms", "loop"):
        for path in sorted((src / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "synchronize" and \
                        ast.unparse(node.value) in ("torch.cuda", "cuda"):
                    found.append(f"{path.name}:{node.lineno}")
    assert not found
