"""ADPSGD on gloo ranks with the laptop grid's own options (read from config/papers/adpsgd.yaml):
gradients whose rank-to-rank spread falls and gradients whose spread grows give different
synchronisations before the learning-rate decay, every rank taking the same decisions; and a
method checkpointed mid-run (model, optimizer, schedule) resumes to the same bits."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import yaml

from commlab.algorithms.periodic import constant_syncs
from commlab.core.runtime import rank_generator
from commlab.grid import resolve_grid
from commlab.loop.optim import lr_at
from commlab.testing import drive, run_distributed
from test_adpsgd_schedule import _moves

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS_OF_RUNS = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["defaults"]  # as `commlab grid`


def _laptop_run() -> dict:
    """The laptop grid's ADPSGD run: its options, train section and step counts, as the loop gets them."""
    config = resolve_grid("adpsgd", DEFAULTS_OF_RUNS, scale="laptop", papers_dir=ROOT / "config" / "papers")
    config = next(c for c in config.values() if c["method"] == "adpsgd")
    train = config["train"]
    steps_per_epoch = train["train_subset"] // (config["workers"] * train["batch_size"])
    total = steps_per_epoch * train["epochs"]
    lrs = [lr_at(step, steps_per_epoch, total, train) for step in range(total)]
    decay = next(step for step in range(1, total) if lrs[step] < lrs[step - 1])
    return {"params": config["method_params"], "train": train, "steps_per_epoch": steps_per_epoch, "total": total,
            "decay": decay, "workers": config["workers"]}


RUN = _laptop_run()
SIZES = (16 * 4, 4)  # a linear model's weight and bias


def _gradients(rank: int, spread):
    """Rank-private noise times ``spread(step)``: the replicas' drift, with nothing in common."""
    def grads(step):
        g = rank_generator(7, rank, step)
        return [torch.randn(n, generator=g) * spread(step) for n in SIZES]
    return grads


def _falling(step):
    return 2.0 ** (-step / (RUN["decay"] / 4))  # halves four times before the decay


def _growing(step):
    return 2.0 ** (step / (RUN["decay"] / 4))


def _driven(rank: int, spread, steps: int):
    torch.manual_seed(0)
    return drive("adpsgd", RUN["params"], model=torch.nn.Linear(16, 4), grads=_gradients(rank, spread),
                 train=RUN["train"], steps_per_epoch=RUN["steps_per_epoch"], total_steps=RUN["total"], steps=steps)


def _bits(records: list[tuple]) -> list[tuple]:
    """Records with every float as its exact bits (NaN equals NaN)."""
    return [tuple(x.hex() if isinstance(x, float) else x for x in record) for record in records]


def _saved(state):
    """A state as a checkpoint holds it (through torch.save and torch.load)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _resumed(rank: int, cut: int):
    """The run checkpointed after ``cut`` steps and continued by a new method from the checkpoint."""
    first = _driven(rank, _falling, cut)
    state = _saved({"model": first.model.state_dict(), "optimizer": first.optimizer.state_dict(),
                    "algorithm": first.algo.state_dict()})
    second = _driven(rank, _falling, 0)
    second.model.load_state_dict(state["model"])
    second.optimizer.load_state_dict(state["optimizer"])
    second.algo.load_state_dict(state["algorithm"])
    second.next_step = cut
    return second.run(RUN["total"] - cut)


def _body(rank, world):
    out = {}
    for name, spread in (("falling", _falling), ("growing", _growing)):
        algo = _driven(rank, spread, RUN["total"]).algo
        out[name] = ([h[0] for h in algo.schedule.history], _bits(algo.schedule.decisions),
                     _moves(algo.schedule, RUN["decay"]))
    out["resume"] = []
    for driven in [_driven(rank, _falling, RUN["total"]), _resumed(rank, 20), _resumed(rank, RUN["decay"] + 3)]:
        out["resume"].append(([p.detach().clone() for p in driven.model.parameters()],
                              _bits(getattr(driven.algo.schedule, "decisions", driven.algo.schedule.history))))
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_body, RUN["workers"], timeout_s=300)


def test_the_spread_of_the_gradients_decides_the_synchronisations(ranks):
    decay, results = RUN["decay"], ranks
    for r in results[1:]:  # V comes from an allreduce: every rank takes the same decisions
        assert r["falling"] == results[0]["falling"] and r["growing"] == results[0]["growing"]
    falling, growing = results[0]["falling"][0], results[0]["growing"][0]
    before = {name: [s for s in steps if s < decay] for name, steps in (("falling", falling), ("growing", growing))}
    assert before["falling"] != before["growing"]
    assert len(before["falling"]) < len(before["growing"])  # a falling spread needs fewer
    budget = constant_syncs(RUN["params"]["budget_period"], RUN["total"])
    assert len(falling) <= budget and len(growing) <= budget
    # Before the decay, after its calibration, the rule lengthens the period each decision starts
    # from (or holds it) under the falling spread and shortens it (or holds it) under the growing
    # one, each at least once (a rule that keeps its period, or a constant one, fails one of them);
    # at the decay it re-tightens.
    lengthened, shortened = results[0]["falling"][2], [-move for move in results[0]["growing"][2]]
    assert min(lengthened) >= 0 and max(lengthened) > 0
    assert min(shortened) >= 0 and max(shortened) > 0
    decisions = results[0]["falling"][1]
    periods = [d[4] for d in decisions if d[0] < decay]
    assert next(d[4] for d in decisions if d[0] >= decay) < periods[-1]


def test_a_checkpointed_run_resumes_to_the_same_bits(ranks):
    for r in ranks:
        (params, decisions), *resumed = r["resume"]  # whole, then cut after step 20 and after the decay
        assert len(decisions) > 8
        for resumed_params, resumed_decisions in resumed:
            assert resumed_decisions == decisions
            for a, b in zip(resumed_params, params, strict=True):
                assert torch.equal(a, b)
