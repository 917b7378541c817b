"""SSD-SGD / OD-SGD with each local rule on 4 gloo ranks against a single-process reference of the
whole method written out here: every rank's local replica and the global replica after every step.

The reference plays the four workers in one process: each takes its gradient on its own local
replica; the global replica (PyTorch's SGD with momentum and weight decay) applies the mean of the
four gradients of a step only when a refresh needs it (the updates of every earlier step, in
order); at a refresh each local replica is overwritten by the global one and the worker receives
the latest global gradient (the last applied mean gradient, or the last global step over its
learning rate); then every worker takes its local step with the rule's formula (GLU as released:
the release's kernel written over each parameter of the worker's replica, its snapshot retaken on
every fifth call of one counter over the parameters)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from commlab.config import DEFAULTS
from commlab.models import build_model
from commlab.testing import drive, run_distributed

WORLD = 4
STEPS = 9
WARMUP = 2
SCALE = 3.0  # local_lr_scale
TRAIN = {**DEFAULTS["train"], "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}

CASES = {
    # name: (method, method_params)
    "ssd_sgd": ("ssdsgd", {"k": 3, "local_optimizer": "sgd"}),
    "ssd_sgd_release_rescale": ("ssdsgd", {"k": 3, "local_optimizer": "sgd", "local_rescale": "release"}),
    "ssd_dcasgd": ("ssdsgd", {"k": 3, "local_optimizer": "dcasgd", "dc_lambda": 2.0, "dc_ms_decay": 0.9}),
    "ssd_glu_gradient": ("ssdsgd", {"k": 3, "local_optimizer": "glu", "glu_weight": 0.5, "glu_source": "gradient"}),
    "ssd_glu_update": ("ssdsgd", {"k": 3, "local_optimizer": "glu", "glu_weight": 0.5, "glu_source": "update"}),
    "ssd_glu_released": ("ssdsgd", {"k": 3, "local_optimizer": "glu", "glu_reading": "released",
                                    "local_rescale": "release"}),
    "od_glu_gradient": ("odsgd", {"local_optimizer": "glu", "glu_weight": 0.5}),
}


def lr_of(step: int) -> float:
    return 0.05 + 0.01 * step


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlp", 1, 10, 8)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


# ---- the method on 4 ranks (and 2, where the world size enters a formula) -------------------------
def _scenarios(rank, world, names=tuple(CASES)):
    out = {}
    for name in names:
        method, params = CASES[name]
        driven = drive(method, {"warmup_steps": WARMUP, "local_lr_scale": SCALE, **params}, model=new_model(),
                       train=TRAIN, total_steps=STEPS, lr=lr_of, batches=lambda t: batch(rank, t))
        trace = []
        for _ in range(STEPS):
            driven.run(1)
            trace.append((flat(driven.model.parameters()), flat(driven.algo.global_model.parameters())))
        driven.finish()
        out[name] = (trace, flat(driven.algo.global_model.parameters()))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_scenarios, WORLD, timeout_s=180)


RESCALED = "ssd_sgd_release_rescale"  # the local direction divided by the world size


# ---- the reference, in one process ----------------------------------------------------------------
class Reference:
    """All workers and the global replica of one case."""

    def __init__(self, method: str, params: dict, world: int = WORLD):
        self.k = params.get("k", 1) if method == "ssdsgd" else 1
        self.params, self.world = params, world
        self.scratch = new_model()
        start = flat(new_model().parameters())
        self.global_w = torch.nn.Parameter(start.clone())
        self.global_opt = torch.optim.SGD([self.global_w], lr=TRAIN["lr"], momentum=TRAIN["momentum"],
                                          weight_decay=TRAIN["weight_decay"])
        self.local = [start.clone() for _ in range(world)]
        self.mean_square = [torch.zeros_like(start) for _ in range(world)]
        self.pending: list[tuple[torch.Tensor, float]] = []  # mean gradients launched, not yet applied
        self.held = None  # the global gradient the workers hold
        self.last_mean, self.last_step = None, None
        self.sizes = [p.numel() for p in self.scratch.parameters()]
        self.snapshots: list[list[torch.Tensor] | None] = [None] * world  # GLU as released: previous_weight_s
        self.calls = [0] * world  # GLU as released: local_num

    def gradient(self, weights: torch.Tensor, rank: int, t: int) -> torch.Tensor:
        torch.nn.utils.vector_to_parameters(weights, self.scratch.parameters())
        self.scratch.zero_grad()
        x, y = batch(rank, t)
        F.cross_entropy(self.scratch(x), y).backward()
        return flat(p.grad for p in self.scratch.parameters())

    def apply(self, mean: torch.Tensor, lr: float) -> None:
        before = self.global_w.detach().clone()
        self.global_w.grad = mean.clone()
        self.global_opt.param_groups[0]["lr"] = lr
        self.global_opt.step()
        self.last_mean, self.last_step = mean, (before - self.global_w.detach()) / lr

    def hold(self) -> None:
        source = self.params.get("glu_source", "gradient")
        self.held = self.last_step if source == "update" else self.last_mean

    def local_step(self, w: torch.Tensor, g: torch.Tensor, shift, rank: int, t: int) -> torch.Tensor:
        rule = self.params["local_optimizer"]
        if rule == "glu" and self.params.get("glu_reading") == "released":
            return self.released_step(w, g, rank, t)
        if rule == "sgd":
            d = g
        elif rule == "dcasgd":
            m, lam0 = self.params["dc_ms_decay"], self.params["dc_lambda"]
            self.mean_square[rank] = m * self.mean_square[rank] + (1 - m) * g * g
            d = g if shift is None else g + lam0 / torch.sqrt(self.mean_square[rank] + 1e-7) * g * g * shift
        else:  # glu as described
            beta = self.params["glu_weight"]
            d = (1 - beta) * g + beta * self.held
        if self.params.get("local_rescale") == "release":
            d = d / self.world
        return w - SCALE * lr_of(t) * (d + TRAIN["weight_decay"] * w)

    def released_step(self, w: torch.Tensor, g: torch.Tensor, rank: int, t: int) -> torch.Tensor:
        """Per parameter: w <- -lr (1.0 w + g + (prev - w) 0.5) (DCKernel, the unset rescale_grad in
        the weight-decay slot), prev taken at the first call, retaken after every fifth call."""
        if self.params.get("local_rescale") == "release":
            g = g / self.world
        lr = SCALE * lr_of(t)
        ws, gs = list(torch.split(w, self.sizes)), torch.split(g, self.sizes)
        if self.snapshots[rank] is None:
            self.snapshots[rank] = [x.clone() for x in ws]
        for j in range(len(ws)):
            ws[j] = -lr * (1.0 * ws[j] + gs[j] + (self.snapshots[rank][j] - ws[j]) * 0.5)
            if self.calls[rank] % 5 == 0:
                self.snapshots[rank][j] = ws[j].clone()
            self.calls[rank] += 1
        return torch.cat(ws)

    def run(self) -> tuple[list, torch.Tensor]:
        trace = []
        for t in range(STEPS):
            world = range(self.world)
            grads = [self.gradient(self.local[r], r, t) for r in world]
            mean = sum(grads) / self.world
            if t < WARMUP:  # synchronous SGD; every local replica takes the global one
                self.apply(mean, lr_of(t))
                self.hold()
                self.local = [self.global_w.detach().clone() for _ in world]
            else:
                self.pending.append((mean, lr_of(t)))
                shifts = [None] * self.world
                if (t - WARMUP + 1) % self.k == 0:  # refresh: every update but this step's
                    while len(self.pending) > 1:
                        self.apply(*self.pending.pop(0))
                    self.hold()
                    shifts = [self.global_w.detach() - w for w in self.local]
                    self.local = [self.global_w.detach().clone() for _ in world]
                self.local = [self.local_step(self.local[r], grads[r], shifts[r], r, t) for r in world]
            trace.append(([w.clone() for w in self.local], self.global_w.detach().clone()))
        while self.pending:
            self.apply(*self.pending.pop(0))
        return trace, self.global_w.detach().clone()


@pytest.fixture(scope="module")
def references():
    return {name: Reference(method, params).run() for name, (method, params) in CASES.items()}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-5, rtol=1e-4)


# ---- the tests ------------------------------------------------------------------------------------
def _follows(runs: list, name: str, reference: tuple) -> None:
    ref_trace, ref_final = reference
    for rank, r in enumerate(runs):
        trace, final = r[name]
        for t, ((local, global_), (ref_locals, ref_global)) in enumerate(zip(trace, ref_trace, strict=True)):
            assert close(local, ref_locals[rank]), (name, rank, t, (local - ref_locals[rank]).abs().max())
            assert close(global_, ref_global), (name, rank, t, (global_ - ref_global).abs().max())
        assert close(final, ref_final), (name, rank)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_follows_the_reference_at_every_step(runs, references, name):
    _follows(runs, name, references[name])


def test_the_release_rescale_divides_by_the_world_size_on_2_ranks():
    runs_2 = run_distributed(_scenarios, 2, args=((RESCALED,),), timeout_s=120)
    _follows(runs_2, RESCALED, Reference(*CASES[RESCALED], world=2).run())


def test_the_global_replica_is_the_same_on_every_rank(runs):
    for name in CASES:
        first = runs[0][name]
        for r in runs[1:]:
            assert torch.equal(r[name][1], first[1]), name
            for (_, mine), (_, theirs) in zip(r[name][0], first[0], strict=True):
                assert torch.equal(mine, theirs), name


def test_the_rules_give_different_runs(references):
    """Each case's reference ends elsewhere: a product that ignored a rule's term would fail above."""
    finals = {name: ref[0][-1][0][0] for name, ref in references.items()}
    names = list(finals)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert (finals[a] - finals[b]).abs().max() > 1e-4, (a, b)


def test_glu_released_workers_never_hold_the_global_weights_after_warmup(references):
    """The release's kernel overwrites the replica at every local step, a refresh's included: after
    the warm-up no worker's replica is the global one, and the workers' replicas differ."""
    trace, _ = references["ssd_glu_released"]
    for t in range(WARMUP, STEPS):
        locals_, global_ = trace[t]
        assert all((w - global_).abs().max() > 1e-3 for w in locals_), t
        assert (locals_[0] - locals_[1]).abs().max() > 1e-6, t
