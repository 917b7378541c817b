"""Every method's checkpoint restores it bit for bit (``resume`` on the class; the loop's
checkpoint, src/commlab/loop/loop.py ``Run.checkpoint`` and ``Run.resume``).

On 2 gloo ranks, each method with state of its own that it declares exact takes 8 steps, is saved
as the loop saves it (the model, the loop's optimizer and ``algo.state_dict()``, through
``torch.save``), is built afresh over a differently initialised model, loads the saved state in
the loop's order and takes 8 more steps. Its parameters, its optimizer's state and its own state
then equal, bit for bit, those of the same method run 16 steps without a stop. The step count
lies past every quick run's warm-up, so a stop falls in the middle of the method's main branch
(residuals, thresholds, replicas, schedules, outer optimizers and the random generators are
live). tests/test_resume.py runs the same through real killed and preempted jobs for a few of
them."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from commlab.registry import ALGORITHMS
from commlab.testing import drive, run_distributed
from commlab.testing.quick import quick_params, quick_run

WORLD, BEFORE, AFTER = 2, 8, 8
EXACT = [name for name in ALGORITHMS.package_names()
         if (resume := ALGORITHMS.get(name).resume) is not None and resume.state and not resume.inexact]


def _model(method: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    width = 512 if quick_run(method).wide_model else 64  # the sparse methods at density 0.01 need entries
    return nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, 10))


def _batches(rank: int):
    """The batch of a step depends on the rank and the step alone, as the loop's sampler's does."""
    def batch(step: int):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        return torch.randn(16, 32, generator=gen) * 3, torch.randint(0, 10, (16,), generator=gen)
    return batch


def _flat(state, out: dict, path: str = "") -> dict:
    """Every tensor and number in a state, by its path of keys."""
    if torch.is_tensor(state):
        out[path] = state.detach().clone()
    elif isinstance(state, dict):
        for key in sorted(state, key=str):
            _flat(state[key], out, f"{path}/{key}")
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            _flat(value, out, f"{path}/{i}")
    elif isinstance(state, (int, float, bool, str)) or state is None:
        out[path] = state
    return out


def _is_timing(path: str) -> bool:
    """Seconds a method measured (selection, blocked time): the clock's, not the run's."""
    last = path.rsplit("/", 1)[-1]
    return last.endswith("_s") or "_s_" in last or "seconds" in last


def _snapshot(driven) -> dict:
    return {"params": {str(i): p.detach().clone() for i, p in enumerate(driven.model.parameters())},
            "optimizer": _flat(driven.optimizer.state_dict()["state"], {}),
            "algorithm": {k: v for k, v in _flat(driven.algo.state_dict(), {}).items() if not _is_timing(k)}}


def _round_trip(rank: int, world: int, methods: list[str]) -> dict:
    out = {}
    for method in methods:
        options, train = quick_params(method, world), {"lr": 0.05, "momentum": 0.9}
        common = {"train": train, "batches": _batches(rank), "total_steps": BEFORE + AFTER,
                  "steps_per_epoch": BEFORE}
        torch.manual_seed(7)
        whole = drive(method, options, model=_model(method, 0), steps=BEFORE + AFTER, **common)

        torch.manual_seed(7)
        first = drive(method, options, model=_model(method, 0), steps=BEFORE, **common)
        saved = io.BytesIO()
        torch.save({"model": first.model.state_dict(), "optimizer": first.optimizer.state_dict(),
                    "algorithm": first.algo.state_dict(), "rng": torch.get_rng_state()}, saved)
        saved.seek(0)
        state = torch.load(saved, weights_only=False)

        torch.manual_seed(123)  # nothing of the fresh build may leak into the resumed run
        resumed = drive(method, options, model=_model(method, 1), steps=0, **common)
        resumed.model.load_state_dict(state["model"])
        resumed.optimizer.load_state_dict(state["optimizer"])
        resumed.algo.load_state_dict(state["algorithm"])
        torch.set_rng_state(state["rng"])
        resumed.next_step = BEFORE
        resumed.run(AFTER)
        out[method] = (_snapshot(whole), _snapshot(resumed))
    return out


def _equal(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) or \
            (a.shape == b.shape and a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
             and torch.equal(a.nan_to_num(), b.nan_to_num()))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # a statistic not yet measured, on both sides
    return type(a) is type(b) and a == b


@pytest.fixture(scope="module")
def results():
    return run_distributed(_round_trip, WORLD, args=(EXACT,), timeout_s=600)


def test_the_methods_that_hold_state_are_all_here():
    assert {"oktopk", "redsync", "powersgd", "qsgd", "adpsgd", "kstep", "diloco", "streaming_diloco",
            "ssdsgd", "odsgd"} <= set(EXACT)


@pytest.mark.parametrize("method", EXACT)
def test_a_method_saved_and_loaded_mid_run_ends_bit_for_bit_as_the_uninterrupted_one(results, method):
    for rank, per_method in enumerate(results):
        whole, resumed = per_method[method]
        for key in ("params", "optimizer", "algorithm"):
            assert whole[key].keys() == resumed[key].keys(), (rank, key)
            unequal = [path for path in whole[key] if not _equal(whole[key][path], resumed[key][path])]
            assert unequal == [], f"rank {rank}: {key} differs at {unequal[:5]}"
        assert whole["params"] and whole["algorithm"], "a method with state saved nothing"
