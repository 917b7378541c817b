"""ASGD (algorithms/asgd.py, docs/asgd.md) against references.

* One worker: ASGD is plain SGD, bit for bit (the run's optimizer, its learning-rate schedule).
* Four workers on a deterministic toy (each worker's gradient is a function of the weights it
  pulled: w - target_rank), with jittered steps so that pushes interleave: replaying the server's
  log of updates (worker, version its gradient was computed on, version, lr) with the same
  optimizer from the initial weights gives the server's final weights bit for bit; so every update
  the server applied is a gradient computed on a known earlier version, which staleness counts.
  The same run checks the byte accounting per push and pull exactly, and a run stopped, saved,
  rebuilt and resumed (as a checkpoint does) replays as one.

The four-worker scenarios run in one spawn of gloo ranks (module fixture); each rank drives the
method through the training loop's own step (commlab.testing.drive)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from commlab.core.costs import broadcast_sends
from commlab.testing import drive, run_distributed

WORLD = 4
STEPS = 10
TRAIN = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}
HEADER = 16  # bytes: kind and learning rate, float64


def lr_of(step: int) -> float:
    """A learning rate that changes every step: each update must use its own worker's."""
    return 0.1 / (1 + 0.05 * step)


def toy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(5, 3)


def targets(rank: int, model: torch.nn.Module) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def _toy_gradients(rank: int, model: torch.nn.Module):
    """grad of 0.5 |w - target|^2 at the worker's weights, after a jittered compute time."""
    goal = targets(rank, model)

    def grads(step: int) -> list[torch.Tensor]:
        time.sleep(((rank * 7 + step * 3) % 5) * 0.004)
        return [p.detach() - t for p, t in zip(model.parameters(), goal, strict=True)]

    return grads


def _scenarios(rank: int, world: int) -> dict:
    out = {}
    # (1) a run of STEPS steps, finished
    model = toy()
    start = flat(model.parameters())
    driven = drive("asgd", None, model=model, steps=STEPS, train=TRAIN, lr=lr_of,
                   grads=_toy_gradients(rank, model))
    driven.finish()
    algo = driven.algo
    out["run"] = {"start": start, "final_model": flat(model.parameters()),
                  "stats": algo.comm.stats.totals(), "by_op": copy.deepcopy(algo.comm.stats.by_op),
                  "numel": algo.numel}
    if rank == 0:
        out["run"].update(history=list(algo.history), server=flat(algo.server_params), metrics=algo.metrics())
    # (2) stopped after 4 steps, saved as a checkpoint saves, rebuilt, loaded, resumed for 6 more
    model = toy()
    first = drive("asgd", None, model=model, steps=4, train=TRAIN, lr=lr_of, grads=_toy_gradients(rank, model))
    saved_model, saved_algo = copy.deepcopy(model.state_dict()), first.algo.state_dict()
    first.finish()
    history = list(first.algo.history) if rank == 0 else []
    model = toy(seed=5)  # other weights: everything must come back from the checkpoint
    second = drive("asgd", None, model=model, steps=0, train=TRAIN, lr=lr_of, grads=_toy_gradients(rank, model))
    model.load_state_dict(saved_model)
    second.algo.load_state_dict(saved_algo)
    second.next_step = 4
    second.run(6).finish()
    if rank == 0:
        out["resumed"] = {"history": history + list(second.algo.history), "server": flat(second.algo.server_params)}
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_scenarios, WORLD, timeout_s=180)


def replay(history, start: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """The server's updates, recomputed: each a worker's gradient at the version it names."""
    params = [torch.nn.Parameter(t.clone()) for t in torch.split(start, [p.numel() for p in model.parameters()])]
    opt = torch.optim.SGD(params, lr=TRAIN["lr"], momentum=TRAIN["momentum"], weight_decay=TRAIN["weight_decay"])
    goals = {r: flat(targets(r, model)) for r in range(WORLD)}
    versions, pushed = [start.clone()], [0] * WORLD
    for i, (worker, base, version, lr) in enumerate(history):
        assert version == i and 0 <= base <= version
        assert lr == lr_of(pushed[worker])  # the pushing worker's own step's lr
        pushed[worker] += 1
        grad = versions[base] - goals[worker]
        for p, g in zip(params, torch.split(grad, [p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p).clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        versions.append(flat(params))
    assert pushed == [len(history) // WORLD] * WORLD
    return versions[-1]


def _one_worker(rank: int, world: int) -> list:
    out = []
    for method in ("asgd", "ssgd"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        gen = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(7)]
        driven = drive(method, None, model=model, steps=7, lr=lr_of, batches=lambda s, b=batches: b[s],
                       train={**TRAIN, "nesterov": True})
        driven.finish()
        out.append((flat(model.parameters()), driven.algo.metrics()))
    return out


def test_one_worker_is_plain_sgd():
    (asgd, metrics), (ssgd, _) = run_distributed(_one_worker, 1)[0]
    assert torch.equal(asgd, ssgd)
    assert metrics["server_version"] == 7 and metrics["staleness_max"] == 0


def test_every_update_is_a_gradient_of_a_known_earlier_version(runs):
    run = runs[0]["run"]
    history = run["history"]
    assert len(history) == WORLD * STEPS
    assert torch.equal(replay(history, run["start"], toy()), run["server"])
    staleness = [version - base for _, base, version, _ in history]
    assert max(staleness) > 0  # the pushes did interleave (jittered steps)
    for worker in range(WORLD):  # a worker computes on the version its last pull returned
        bases = [base for w, base, _, _ in history if w == worker]
        answered = [version + 1 for w, _, version, _ in history if w == worker]
        assert bases == [0] + answered[:-1]
    assert run["metrics"]["staleness_mean_run"] == pytest.approx(sum(staleness) / len(staleness))
    # finish: every rank holds the server's final weights
    for r in range(WORLD):
        assert torch.equal(runs[r]["run"]["final_model"], run["server"])


def test_bytes_per_push_and_pull_are_exact(runs):
    n = runs[0]["run"]["numel"] * 4  # float32 parameters
    done = HEADER  # each worker's last message
    for rank in range(WORLD):
        stats, by_op = runs[rank]["run"]["stats"], runs[rank]["run"]["by_op"]
        # rank 0's weights at the start (setup) and the server's at the end (finish): binomial trees
        tree = 2 * broadcast_sends(WORLD, rank, 0) * n
        if rank == 0:
            pushes = (WORLD - 1) * STEPS
            assert by_op["send"] == {"bytes_sent": pushes * n, "messages_sent": pushes}
            assert stats["bytes_recv"] == pushes * (HEADER + n) + (WORLD - 1) * done
            assert stats["bytes_sent"] == pushes * n + tree
        else:
            assert by_op["send"] == {"bytes_sent": STEPS * (HEADER + n) + done, "messages_sent": 2 * STEPS + 1}
            assert stats["bytes_recv"] == STEPS * n + 2 * n
            assert stats["bytes_sent"] == STEPS * (HEADER + n) + done + tree
        assert stats["reductions_global"] == 0


def test_a_resumed_server_replays_as_one_run(runs):
    resumed = runs[0]["resumed"]
    assert len(resumed["history"]) == WORLD * 10
    assert torch.equal(replay(resumed["history"], runs[0]["run"]["start"], toy()), resumed["server"])
