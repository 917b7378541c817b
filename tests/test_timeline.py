"""The job timeline (commlab.timeline): exclusive phases on a scripted clock, and the launcher's
merge of its marks with rank 0's file on hand-made records."""

from __future__ import annotations

import json

import pytest

from commlab import timeline
from commlab.timeline import PHASES, Timeline, merge


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(timeline.time, "perf_counter", fake)
    monkeypatch.setattr(timeline.time, "time", lambda: 1000.0 + fake.now)
    return fake


def test_a_phase_inside_another_is_taken_out_of_the_outer_one(clock):
    tl = Timeline()  # starts at 1000.0
    clock.now = 1.0
    with tl.phase("steps"):
        clock.now = 3.0
        with tl.phase("evaluation"):
            clock.now = 3.5
            with tl.phase("mlflow"):
                clock.now = 3.75
        clock.now = 6.0
        with tl.phase("checkpoints"):
            clock.now = 6.25
        clock.now = 8.0
    clock.now = 10.0
    with tl.phase("steps"):
        clock.now = 11.0
    record = tl.to_dict()
    # steps: 1-8 less 3-3.75 and 6-6.25, then 10-11
    assert record["seconds"] == {"steps": 7.0 - 1.0 + 1.0, "evaluation": 0.5, "mlflow": 0.25,
                                 "checkpoints": 0.25, "other": 1.0 + 2.0}
    assert record["counts"] == {"steps": 2, "evaluation": 1, "mlflow": 1, "checkpoints": 1}
    assert sum(record["seconds"].values()) == record["end"] - record["start"] == 11.0


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown phase 'compile'"):
        with Timeline().phase("compile"):
            pass


def test_a_phase_left_by_an_exception_still_counts(clock):
    tl = Timeline()
    with pytest.raises(RuntimeError):
        with tl.phase("data"):
            clock.now = 2.0
            raise RuntimeError("missing file")
    assert tl.to_dict()["seconds"]["data"] == 2.0


def test_the_launcher_merges_its_marks_with_rank_0s_phases(tmp_path):
    rank0 = {"start": 105.0, "end": 130.0, "seconds": {"worker_setup": 0.5, "process_group": 0.5, "data": 1.0,
                                                      "build": 1.0, "mlflow": 2.0, "steps": 18.0,
                                                      "evaluation": 1.5, "other": 0.5},
             "counts": {"steps": 1}}
    (tmp_path / timeline.RANK0_FILE).write_text(json.dumps(rank0))
    record = merge(tmp_path, {"start": 100.0, "main": 100.5}, workers_requested=102.0, workers_done=131.0,
                   end=131.25)
    assert record["seconds"]["interpreter"] == 0.5
    assert record["seconds"]["launcher"] == 1.5
    assert record["seconds"]["workers_start"] == 3.0
    assert record["seconds"]["worker_exit"] == 1.0
    assert record["seconds"]["teardown"] == 0.25
    assert record["seconds"]["steps"] == 18.0 and record["seconds"]["log_points"] == 0.0
    assert set(record["seconds"]) == set(PHASES)
    assert record["total"] == 31.25 == pytest.approx(sum(record["seconds"].values()))
    assert json.loads((tmp_path / timeline.FILE).read_text()) == record
    assert not (tmp_path / timeline.RANK0_FILE).exists()


def test_without_rank_0s_file_there_is_no_timeline(tmp_path):
    assert merge(tmp_path, {"start": 1.0, "main": 2.0}, 3.0, 4.0) is None
    assert not (tmp_path / timeline.FILE).exists()


def test_the_process_start_is_the_kernels_and_comes_before_now():
    import time

    start = timeline.process_start_time()
    assert start is not None and start <= time.time()
    assert time.time() - start < 24 * 3600  # this test's own process, started by pytest
