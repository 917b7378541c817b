"""SSD-SGD's local update rules (commlab.algorithms.local_compensation) stepped by the local optimizer
the method declares, over several steps, against their formulas written out here.

Each case plays a worker's local replica ``w`` for STEPS steps: a given gradient every step, taken
at the replica before the step (``w_grad``); at the refresh steps the replica first jumps to given
global weights (``w_now``) and the worker receives a given global gradient, which it then holds;
every step has its own learning rate. GLU as released is checked against the released kernel and
optimizer written out here from their C++ and Python sources (main-520/SSD-SGD), on one parameter
and on several (its snapshot counter runs over all of them). Single process; the method's
collectives are covered by tests/test_ssdsgd_rules.py."""

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
        set_lr(opt, lr_of(t))
        if rule.writes_replica:  # the rule writes the replica; the loop's optimizer skips the step
            with torch.no_grad():
                rule.write_replica([w.detach()], [grads[t]], SCALE * lr_of(t))
            w.grad = None
        else:
            w.grad = rule.direction(grads[t], shift, held).clone()
        opt.step()
        out.append(w.detach().clone())
    return out


def step(w: torch.Tensor, d: torch.Tensor, t: int) -> torch.Tensor:
    """Local SGD, momentum 0: w - local_lr * (d + weight_decay * w), local_lr = SCALE x lr(t)."""
    return w - SCALE * lr_of(t) * (d + DECAY * w)


# ---- the release's GLU, written out from main-520/SSD-SGD ------------------------------------------
def dc_kernel(weight, grad, previous, param_clip_gradient, param_lr, param_lam, param_wd, param_rescale_grad):
    """DCKernel::Map (src/operator/optimizer_op-inl.h:110-121), its parameters in their declared
    order: out = (-1.0) * lr * (wd * weight + grad + (previous - weight) * 0.5)."""
    return (-1.0) * param_lr * (param_wd * weight + grad + (previous - weight) * 0.5)


def dc_sgd_update(weight, grad, previous, lr, wd=0.0, rescale_grad=1.0, clip_gradient=-1.0, lam=0.04):
    """DCUpdate (lines 123-143) with DCParam's defaults (lines 68-94): the kernel launched with
    (clip_gradient, lr, wd, rescale_grad, lam), positionally."""
    return dc_kernel(weight, grad, previous, clip_gradient, lr, wd, rescale_grad, lam)


class ReleasedGLUOptimizer:
    """GLU.update (python/mxnet/optimizer/optimizer.py:1229-1249) under Python 2, momentum 0, with
    the Updater's create_state at a parameter's first call (lines 1221-1227, 1848-1849)."""

    def __init__(self, rescale_grad=1.0, wd=1e-4, lamda=0.04):
        self.rescale_grad, self.wd, self.lamda = rescale_grad, wd, lamda
        self.states: dict[int, tuple] = {}
        self.local_num = 0

    def update(self, index, weight, grad, lr):
        if index not in self.states:
            self.states[index] = (None, weight.clone(), weight.clone())
        grad = grad * self.rescale_grad
        mom, previous_weight, previous_weight_s = self.states[index]
        weight = dc_sgd_update(weight, grad, previous_weight_s, lr=lr, wd=self.wd, lam=self.lamda)  # out = weight
        if self.local_num % 5 == 0:
            previous_weight_s = weight.clone()  # previous_weight_s[:] = weight
        self.states[index] = (mom, previous_weight, previous_weight_s)
        self.local_num += 1
        return weight


def reference(rule: str, **knobs) -> list[torch.Tensor]:
    """The rules' formulas, written out."""
    start, grads, jumps, global_grads = _inputs()
    w, held, mean_square, out = start.clone(), None, torch.zeros(SIZE), []
    released = ReleasedGLUOptimizer()
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
            w = released.update(0, w, g, SCALE * lr_of(t))
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


def _released(n_steps: int, sizes: tuple[int, ...], lrs: list[float], seed: int = 3):
    """The release's GLU on a replica of len(sizes) parameters for n_steps steps: the rule's
    replicas after each step, the written-out optimizer's, and the snapshots of both."""
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(n_steps)]
    rule = build_rule(parse_options(ALGORITHMS.get("ssdsgd").Options, {"local_optimizer": "glu",
                                                                        "glu_reading": "released"}))
    optimizer = ReleasedGLUOptimizer()
    mine, theirs = [w.clone() for w in start], [w.clone() for w in start]
    got, expected = [], []
    for t in range(n_steps):
        rule.write_replica(mine, grads[t], lrs[t])
        theirs = [optimizer.update(j, w, g, lrs[t]) for j, (w, g) in enumerate(zip(theirs, grads[t], strict=True))]
        got.append([w.clone() for w in mine])
        expected.append(theirs)
    return got, expected, rule, optimizer


def test_glu_released_is_the_kernel_written_over_the_replica_on_hand_numbers():
    """w = 1, g = 0.5, lr = 0.5: -0.5 (1 + 0.5) = -0.75, snapshot; -0.5 (-0.75 + 0.5) = 0.125;
    -0.5 (0.125 + 0.5 + 0.5 (-0.75 - 0.125)) = -0.09375 (the snapshot still the first step's)."""
    rule = build_rule(parse_options(ALGORITHMS.get("ssdsgd").Options, {"local_optimizer": "glu",
                                                                        "glu_reading": "released"}))
    w = [torch.tensor([1.0])]
    out = []
    for _ in range(3):
        rule.write_replica(w, [torch.tensor([0.5])], 0.5)
        out.append(w[0].item())
    assert out == [-0.75, 0.125, -0.09375]
    assert rule.previous[0].item() == -0.75 and rule.calls == 3


def test_glu_released_follows_the_release_over_several_parameters():
    """Three parameters, twelve steps: the call counter runs over all of them, so parameter j is
    snapshotted at step n when (3 n + j) % 5 == 0 (j = 0 at n = 0, 5, 10; j = 1 at 3, 8; j = 2 at
    1, 6, 11)."""
    lrs = [0.3 + 0.05 * t for t in range(12)]
    got, expected, rule, optimizer = _released(12, (6, 5, 4), lrs)
    for t, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        for j, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"step {t}, parameter {j}")
    for j, prev in enumerate(rule.previous):
        torch.testing.assert_close(prev, optimizer.states[j][2])
    # the snapshots: parameter 0 last at step 10, 1 at step 8, 2 at step 11
    assert [torch.equal(rule.previous[j], got[n][j]) for j, n in enumerate((10, 8, 11))] == [True] * 3
    assert rule.calls == 36


def test_glu_released_state_resumes_exactly():
    lrs = [0.4] * 9
    got, _, _, _ = _released(9, (6, 5, 4), lrs)
    options = parse_options(ALGORITHMS.get("ssdsgd").Options, {"local_optimizer": "glu", "glu_reading": "released"})
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(n, generator=gen) for n in (6, 5, 4)]
    grads = [[torch.randn(n, generator=gen) for n in (6, 5, 4)] for _ in range(9)]
    first, w = build_rule(options), [x.clone() for x in start]
    for t in range(4):
        first.write_replica(w, grads[t], lrs[t])
    second = build_rule(options)
    second.load_state_dict({k: ([x.clone() for x in v] if isinstance(v, list) else v)
                            for k, v in first.state_dict().items()})
    for t in range(4, 9):
        second.write_replica(w, grads[t], lrs[t])
    for a, b in zip(w, got[-1], strict=True):
        assert torch.equal(a, b)
