"""The rank runner of tests and benchmarks (commlab.launch.ranks) when a rank fails, dies or hangs:
it stops waiting soon after, and says where every silent rank and its children were."""

import multiprocessing
import os
import time

import pytest

from commlab.launch.ranks import run_ranks


def _stuck_here(seconds=600):
    time.sleep(seconds)


def _one_fails_one_hangs(rank, world):
    if rank == 1:
        raise ValueError("rank one gives up")
    _stuck_here()


def test_a_failed_rank_ends_the_wait_with_the_silent_ranks_stacks():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        run_ranks(_one_fails_one_hangs, 2, timeout_s=60, grace_s=1)
    waited = time.monotonic() - start
    message = str(failure.value)
    assert "ValueError: rank one gives up" in message
    assert "rank 0 did not finish in" in message and "_stuck_here" in message and "_one_fails_one_hangs" in message
    assert waited < 60  # grace_s after the failure, not 3 * timeout_s


def _child_stuck():
    _stuck_here()


def _hangs_with_a_child(rank, world, pid_file):
    if rank == 0:
        child = multiprocessing.get_context("fork").Process(target=_child_stuck, daemon=True)
        child.start()
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
    _stuck_here()


def test_a_hang_ends_at_the_deadline_with_every_stack_and_no_orphan(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(RuntimeError) as failure:
        run_ranks(_hangs_with_a_child, 2, args=(str(pid_file),), timeout_s=3)
    message = str(failure.value)
    assert "rank 0 did not finish" in message and "rank 1 did not finish" in message
    assert "_child_stuck" in message  # the forked child's stack, from the handler it inherited
    assert message.count("_stuck_here") >= 3  # both ranks and the child
    child = int(pid_file.read_text())
    for _ in range(50):  # killed with its parent; reaped by init shortly after
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the hung rank's child {child} outlived the run")


def _one_dies(rank, world):
    if rank == 1:
        os._exit(3)
    _stuck_here()


def test_a_rank_that_dies_silently_is_named_with_its_exit_code():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        run_ranks(_one_dies, 2, timeout_s=60, grace_s=1)
    assert "rank 1: exited with code 3 before it reported" in str(failure.value)
    assert "rank 0 did not finish" in str(failure.value)
    assert time.monotonic() - start < 60


def _returns_rank(rank, world):
    return rank * 10


def test_results_come_back_in_rank_order():
    assert run_ranks(_returns_rank, 3, timeout_s=30) == [0, 10, 20]
