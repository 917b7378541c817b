"""SSD-SGD's local update rules (commlab.algorithms.local_compensation) stepped by the local optimizer
the method declares, over several steps, against their formulas written out here.

Each case plays a worker's local replica ``w`` for STEPS steps: a given gradient every step, taken
at the replica before the step (``w_grad``); at the refresh steps the replica first jumps to given
global weights (``w_now``) and the worker receives a given global gradient, which it then holds;
every step has its own learning rate. Single process; the method's collectives are covered by
tests/test_ssdsgd_rules.py."""

from __future__ import annotations

import pytest
import torch

from commlab.algorithms.local_compensation import build_rule
from commlab.loop.optim import build_optimizer, optimizer_settings, set_lr
from commlab.options import parse_options
from commlab.registry import ALGORITHMS

STEPS = 7
REFRESH = (2, 5)  # steps at which the replica is overwritten by global weights before its local step
SIZE = 40
SCALE = 3.0  # local_lr_scale
DECAY = 1e-2  # the run's weight decay
RUN = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": DECAY}


def lr_of(step: int) -> float:
    return 0.05 + 0.01 * step


def _inputs():
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(SIZE, generator=gen)
    grads = [torch.randn(SIZE, generator=gen) for _ in range(STEPS)]
    jumps = {t: torch.randn(SIZE, generator=gen) for t in REFRESH}  # the global weights at a refresh
    global_grads = {t: torch.randn(SIZE, generator=gen) * 0.5 for t in REFRESH}
    return start, grads, jumps, global_grads


def product(params: dict) -> list[torch.Tensor]:
    """The replica after each step: the rule's direction, stepped by the optimizer ssdsgd declares."""
    start, grads, jumps, global_grads = _inputs()
    cls = ALGORITHMS.get("ssdsgd")
    options = parse_options(cls.Options, {"local_lr_scale": SCALE, **params})
    w = torch.nn.Parameter(start.clone())
    opt = build_optimizer([w], cls.loop_optimizer(options, optimizer_settings(RUN)))
    rule = build_rule(options)
    held, out = None, []
    for t in range(STEPS):
        shift = None
        if t in REFRESH:
            before = w.detach().clone()
            with torch.no_grad():
                w.copy_(jumps[t])
            shift = w.detach() - before
            held = global_grads[t]
        direction = rule.direction(grads[t], shift, held)
        w.grad = None if direction is None else direction.clone()
        set_lr(opt, lr_of(t))
        opt.step()
        out.append(w.detach().clone())
    return out


def step(w: torch.Tensor, d: torch.Tensor, t: int) -> torch.Tensor:
    """Local SGD, momentum 0: w - local_lr * (d + weight_decay * w), local_lr = SCALE x lr(t)."""
    return w - SCALE * lr_of(t) * (d + DECAY * w)


def reference(rule: str, **knobs) -> list[torch.Tensor]:
    """The rules' formulas, written out."""
    start, grads, jumps, global_grads = _inputs()
    w, held, mean_square, out = start.clone(), None, torch.zeros(SIZE), []
    for t in range(STEPS):
        g = grads[t]
        w_grad = w
        if t in REFRESH:
            w, held = jumps[t].clone(), global_grads[t]
        if rule == "sgd":
            w = step(w, g, t)
        elif rule == "dcasgd":
            m, lam0 = knobs["m"], knobs["lam0"]
            mean_square = m * mean_square + (1 - m) * g * g
            lam = lam0 / torch.sqrt(mean_square + 1e-7) if knobs["adaptive"] else lam0
            w = step(w, g + lam * g * g * (w - w_grad), t)
        elif rule == "glu_described":
            beta = knobs["beta"]
            w = step(w, g if held is None else (1 - beta) * g + beta * held, t)
        elif rule == "glu_released":
            pass  # no local step: the replica keeps the last global weights it was given
        out.append(w)
    return out


CASES = {
    "sgd": ({"local_optimizer": "sgd"}, "sgd", {}),
    "dcasgd_adaptive": ({"local_optimizer": "dcasgd", "dc_lambda": 2.0, "dc_ms_decay": 0.9}, "dcasgd",
                        {"adaptive": True, "lam0": 2.0, "m": 0.9}),
    "dcasgd_constant": ({"local_optimizer": "dcasgd", "dc_lambda": 0.3, "dc_adaptive": False}, "dcasgd",
                        {"adaptive": False, "lam0": 0.3, "m": 0.0}),
    "glu_described": ({"local_optimizer": "glu", "glu_weight": 0.25}, "glu_described", {"beta": 0.25}),
    "glu_described_all_global": ({"local_optimizer": "glu", "glu_weight": 1.0}, "glu_described", {"beta": 1.0}),
    "glu_released": ({"local_optimizer": "glu", "glu_reading": "released"}, "glu_released", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rule_and_local_optimizer_follow_the_formula_over_several_steps(case):
    params, rule, knobs = CASES[case]
    got, expected = product(params), reference(rule, **knobs)
    for t, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (case, t, (a - b).abs().max())


def test_the_cases_differ_from_each_other():
    """The formulas are distinguishable on these inputs (a reference that ignores a term fails)."""
    finals = {case: reference(rule, **knobs)[-1] for case, (_, rule, knobs) in CASES.items()}
    names = list(finals)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (finals[a] - finals[b]).abs().max() > 1e-3, (a, b)


def test_glu_released_keeps_the_global_weights_exactly():
    _, _, jumps, _ = _inputs()
    got = product({"local_optimizer": "glu", "glu_reading": "released"})
    assert torch.equal(got[REFRESH[0]], jumps[REFRESH[0]])
    assert torch.equal(got[STEPS - 1], jumps[REFRESH[-1]])
