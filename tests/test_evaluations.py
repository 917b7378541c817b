"""When the loop evaluates: at every epoch end, and at the other train.evals_per_epoch points of an
epoch, evenly spaced (commlab.loop.loop.mid_epoch_evaluations)."""

from __future__ import annotations

import pytest

from commlab.config import load_config
from commlab.loop.loop import mid_epoch_evaluations
from commlab.testing import run_distributed


@pytest.mark.parametrize(("steps", "per_epoch", "within"), [
    (12, 1, set()), (12, 2, {6}), (12, 3, {4, 8}), (12, 4, {3, 6, 9}),
    (10, 4, {2, 5, 8}),  # round half to even: 2.5 -> 2, 7.5 -> 8
    (3, 5, {1, 2}),  # more points than steps: each step at most once, never step 0
    (1, 3, set()),
])
def test_mid_epoch_points_are_evenly_spaced(steps, per_epoch, within):
    assert mid_epoch_evaluations(steps, per_epoch) == within


def _evaluated_steps(rank: int, world: int, overrides: list[str]) -> tuple[list[int], int]:
    from commlab.core import init_runtime
    from commlab.loop.loop import Run, steps
    from commlab.loop.runstate import StopSignal

    config = load_config(None, ["dataset=synthetic", "model=mlp", "workers=2", "backend=gloo", "seed=1",
                                "tracking.enabled=false", "train.batch_size=8", "train.log_every=4",
                                "train.checkpoint_every_epochs=0", *overrides])
    run = Run(config, init_runtime("gloo", device="cpu"))
    seen = []
    evaluate = run.evaluate

    def recording():
        seen.append(run.progress.step)
        evaluate()

    run.evaluate = recording
    steps(run, StopSignal())
    run.finish()
    run.logger.close("FINISHED")
    return seen, run.data.steps_per_epoch


def test_the_loop_evaluates_at_the_mid_epoch_points_and_every_epoch_end(tmp_path):
    overrides = [f"output_dir={tmp_path / 'out'}", "train.epochs=2", "train.evals_per_epoch=3",
                 "train.train_subset=192"]  # 12 steps per epoch on 2 ranks x 8
    for seen, per_epoch in run_distributed(_evaluated_steps, world_size=2, args=(overrides,)):
        assert per_epoch == 12
        assert seen == [4, 8, 12, 16, 20, 24]  # the last one is the epoch's end: no second final evaluation


def test_one_evaluation_per_epoch_by_default(tmp_path):
    overrides = [f"output_dir={tmp_path / 'out'}", "train.epochs=2", "train.train_subset=192"]
    for seen, _ in run_distributed(_evaluated_steps, world_size=2, args=(overrides,)):
        assert seen == [12, 24]
