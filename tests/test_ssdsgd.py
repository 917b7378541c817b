"""OD-SGD / SSD-SGD: warm-up equals ssgd exactly; with a zero local learning rate the global replica
follows SSGD with delayed gradients (k = 1: delayed by one step; k = 3: taken at the last refresh);
the global replica is identical on every rank; the allreduce overlaps compute (counted with a
deliberately slowed collective); checkpoints with collectives in flight resume exactly.

All distributed scenarios run in one spawn of 4 gloo ranks (module fixture); each rank drives the
algorithm through the training loop's own step (commlab.testing.drive)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from commlab.algorithms.base import parse_options
from commlab.algorithms.local_compensation import LOCAL_RULES
from commlab.config import DEFAULTS
from commlab.core import Communicator
from commlab.loop.optim import ScaledSGD, build_optimizer, optimizer_settings, set_lr
from commlab.models import build_model
from commlab.registry import ALGORITHMS
from commlab.testing import drive, run_distributed

WORLD = 4
OVERLAP_STEPS = 7  # overlap scenario: 1 warm-up step, then two SSD periods of k = 3
STEPS = 8
TRAIN = {**DEFAULTS["train"], "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}


def lr_of(step: int) -> float:
    """A learning rate that changes every step: delayed updates must use their own step's lr."""
    return 0.05 + 0.01 * step


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def new_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", 1, 10, 8)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


# ---- a slowed collective: completes `delay` steps of compute after its launch -------------------
class Clock:
    step = 0


class SlowPending:
    def __init__(self, inner, launched: int, delay: int, log: list):
        self.inner, self.launched, self.ready_at, self.log = inner, launched, launched + delay, log

    def wait(self):
        # A wait called before the collective's (emulated) completion would block the step.
        self.log.append(("wait", self.launched, Clock.step, Clock.step < self.ready_at))
        return self.inner.wait()

    def is_completed(self) -> bool:
        return Clock.step >= self.ready_at and self.inner.is_completed()


class SlowComm:
    """The real Communicator, with async allreduces that complete ``delay`` steps later."""

    def __init__(self, comm: Communicator, delay: int, log: list):
        self._comm, self._delay, self._log = comm, delay, log

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_reduce(self, tensor, op="sum"):
        self._log.append(("sync", Clock.step))
        return self._comm.all_reduce(tensor, op)

    def all_reduce_async(self, tensor, op="sum"):
        self._log.append(("launch", Clock.step))
        return SlowPending(self._comm.all_reduce_async(tensor, op), Clock.step, self._delay, self._log)


# ---- one rank's run: the training loop's steps, with lr_of(t) as the schedule --------------------
def make(method: str, params: dict, comm=None, train=None, seed: int = 0, log: list | None = None, steps: int = 0):
    """``method`` on a fresh model (its init seeded by ``seed``), driven as the loop drives it for
    ``steps`` steps; each step's compute is logged in ``log`` and sets the emulated clock."""
    rank = dist.get_rank()

    def batches(t: int):
        Clock.step = t
        if log is not None:
            log.append(("compute", t))
        return batch(rank, t)

    return drive(method, params, model=new_model(seed), steps=steps, train={**TRAIN, **(train or {})}, comm=comm,
                 total_steps=STEPS, lr=lr_of, batches=batches)


def _each_step(driven, steps: int, see) -> list:
    """``see(driven)`` after each of the next ``steps`` steps."""
    return [see(driven.run(1)) for _ in range(steps)]


def _scenarios(rank, world):
    out = {}
    # 1. Warm-up covering the whole run: ssgd, odsgd and ssdsgd from the same start, bit for bit.
    clip = {"grad_clip": 0.5}
    for method, params in (("ssgd", {}), ("odsgd", {"warmup_steps": 100}),
                           ("ssdsgd", {"warmup_steps": 100, "k": 3})):
        algo = make(method, params, train=clip, steps=STEPS).finish().algo
        out[f"warm_{method}"] = (flat(algo.model.parameters()), flat(algo.eval_model.parameters()))

    # 2. Zero local learning rate (OD-SGD, and SSD-SGD k = 3): the local replica after each step
    #    and the final global replica.
    for name, method, params in (("od", "odsgd", {"local_optimizer": "dcasgd"}),
                                 ("ssd", "ssdsgd", {"k": 3, "local_optimizer": "glu"})):
        driven = make(method, {"warmup_steps": 3, "local_lr_scale": 0.0, **params})
        local = _each_step(driven, STEPS, lambda d: flat(d.model.parameters()))
        driven.finish()
        out[f"delay_{name}"] = (local, flat(driven.algo.global_model.parameters()))

    # 3. The global replica (and its version) after every step; local replicas too.
    for name, method, params in (("ssd_glu", "ssdsgd", {"warmup_steps": 2, "k": 3, "local_optimizer": "glu",
                                                         "glu_source": "update"}),
                                 ("od_dc", "odsgd", {"warmup_steps": 2, "local_optimizer": "dcasgd"})):
        out[f"trace_{name}"] = _each_step(make(method, params), STEPS, lambda d: (
            d.algo.version, flat(d.algo.global_model.parameters()), flat(d.model.parameters()), d.algo.metrics()))

    # 3b. GLU from the global update, weight 1, no weight decay: after each refresh the local step
    #     moves the refreshed replica along the latest global step, scaled by the lr ratio.
    driven = make("odsgd", {"warmup_steps": 2, "local_optimizer": "glu", "glu_weight": 1.0, "glu_source": "update",
                            "local_lr_scale": 2.0}, train={"weight_decay": 0.0})
    out["glu_update"] = _each_step(driven, STEPS, lambda d: (flat(d.algo.global_model.parameters()),
                                                             flat(d.model.parameters())))

    # 4. Overlap: event logs under collectives slowed by one and by two steps.
    for delay in (1, 2):
        for name, method, params in (("od", "odsgd", {"warmup_steps": 1}),
                                     ("ssd", "ssdsgd", {"warmup_steps": 1, "k": 3})):
            log = []
            driven = make(method, params, comm=SlowComm(Communicator(), delay, log), log=log, steps=OVERLAP_STEPS)
            Clock.step += 1  # finish() runs after the last step's compute
            driven.finish()
            out[f"log_{name}_{delay}"] = log

    # 5. Checkpoint and resume (with collectives in flight) equals the uninterrupted run.
    for rule, extra in RESUMED.items():
        params = {"warmup_steps": 2, "k": 3, **extra}
        algo = make("ssdsgd", params, steps=STEPS).finish().algo
        straight = (flat(algo.global_model.parameters()), flat(algo.model.parameters()))
        driven = make("ssdsgd", params, steps=4)
        _ = driven.algo.eval_model  # an epoch-end evaluation mid-period (after step 3) must not change the run
        driven.run(1)
        in_flight = [len(driven.algo.in_flight)]
        saved = copy.deepcopy({"model": driven.model.state_dict(), "opt": driven.optimizer.state_dict(),
                               "algo": driven.algo.state_dict()})
        in_flight.append(len(driven.algo.in_flight))
        driven = make("ssdsgd", params, seed=1)
        driven.model.load_state_dict(saved["model"])
        driven.optimizer.load_state_dict(saved["opt"])
        driven.algo.load_state_dict(saved["algo"])
        driven.next_step = 5
        algo = driven.run(STEPS - 5).finish().algo
        out[f"resume_{rule}"] = (straight, (flat(algo.global_model.parameters()), flat(algo.model.parameters())),
                                 in_flight)

    # 6. A local learning rate on a schedule of its own (never refreshed after warm-up: k = 100).
    driven = make("ssdsgd", {"warmup_steps": 2, "k": 100, "local_optimizer": "sgd", **LOCAL_SCHEDULE})
    out["local_schedule"] = _each_step(driven, STEPS, lambda d: flat(d.model.parameters()))
    return out


LOCAL_SCHEDULE = {"local_lr": 0.3, "local_milestones": [0.5, 0.75], "local_gamma": 0.2}  # epochs of STEPS steps
RESUMED = {"glu": {"local_optimizer": "glu"}, "dcasgd": {"local_optimizer": "dcasgd"},
           "glu_released": {"local_optimizer": "glu", "glu_reading": "released", "local_rescale": "release"}}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_scenarios, WORLD)


# ---- the tests ------------------------------------------------------------------------------------
def test_warmup_covering_the_run_equals_ssgd_exactly(runs):
    for r in runs:
        ssgd_params, _ = r["warm_ssgd"]
        for method in ("odsgd", "ssdsgd"):
            local, global_ = r[f"warm_{method}"]
            assert torch.equal(local, ssgd_params), method
            assert torch.equal(global_, ssgd_params), method


def base_version(t: int, warmup: int, k: int) -> int:
    """Global version the local replica holds when step t's gradient is taken (zero local lr):
    t in warm-up; afterwards the version copied at the last refresh, i.e. at the last step r < t
    with (r - warmup + 1) % k == 0 (refresh r copies version r), or warmup before the first."""
    if t <= warmup:
        return t
    refreshes = [r for r in range(warmup, t) if (r - warmup + 1) % k == 0]
    return refreshes[-1] if refreshes else warmup


def _dense_trajectory(versions) -> list[torch.Tensor]:
    """w_{t+1} = SGD-momentum step of w_t with the mean over ranks of the gradients taken at
    w_{versions(t)}: SSGD with a delayed gradient, in one process."""
    model, scratch = new_model(), new_model()
    opt = build_optimizer(model.parameters(), optimizer_settings(TRAIN))
    history = [flat(model.parameters())]
    for t in range(STEPS):
        torch.nn.utils.vector_to_parameters(history[versions(t)], scratch.parameters())
        scratch.zero_grad()
        loss = sum(F.cross_entropy(scratch(batch(r, t)[0]), batch(r, t)[1]) for r in range(WORLD)) / WORLD
        loss.backward()
        for p, s in zip(model.parameters(), scratch.parameters(), strict=True):
            p.grad = s.grad.clone()
        set_lr(opt, lr_of(t))
        opt.step()
        history.append(flat(model.parameters()))
    return history


@pytest.mark.parametrize("name, k", [("od", 1), ("ssd", 3)])
def test_zero_local_lr_is_ssgd_with_delayed_gradients(runs, name, k):
    """k = 1: exactly SSGD delayed by one step, w_{t+1} = opt(w_t, avg grad(w_{t-1})) after warm-up;
    k = 3: the gradient of step t is taken at the global version of the last refresh."""
    warmup = 3
    if k == 1:
        assert [base_version(t, warmup, 1) for t in range(STEPS)] == [0, 1, 2, 3] + list(range(3, STEPS - 1))
    ref = _dense_trajectory(lambda t: base_version(t, warmup, k))
    undelayed = _dense_trajectory(lambda t: t)
    for r in runs:
        local, global_ = r[f"delay_{name}"]
        # After step t the local replica holds w_{t+1} in warm-up, then the version it last copied.
        for t, w in enumerate(local):
            expected = ref[t + 1] if t < warmup else ref[base_version(t + 1, warmup, k)]
            assert torch.allclose(w, expected, atol=1e-6, rtol=1e-5), t
        assert torch.allclose(global_, ref[STEPS], atol=1e-6, rtol=1e-5)
    # The delay is visible: the undelayed SSGD trajectory ends elsewhere.
    assert (undelayed[STEPS] - ref[STEPS]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["ssd_glu", "od_dc"])
def test_global_replica_identical_on_every_rank_at_every_step(runs, name):
    traces = [r[f"trace_{name}"] for r in runs]
    for t in range(STEPS):
        version, global_, local, _ = traces[0][t]
        for other in traces[1:]:
            assert other[t][0] == version
            assert torch.equal(other[t][1], global_)
        if t < 2:  # warm-up: one synchronous update per step, replicas equal everywhere
            assert version == t + 1 and torch.equal(local, global_)
            assert all(torch.equal(o[t][2], local) for o in traces[1:])
        else:  # local steps with each rank's own gradient: the local replicas differ
            assert any(not torch.equal(o[t][2], local) for o in traces[1:])
    metrics = traces[0][-1][3]
    assert metrics["warmup"] == 0.0 and metrics["refreshes"] > 0 and metrics["refresh_distance_mean"] > 0
    if name == "ssd_glu":
        # k = 3 after 2 warm-up steps: refreshes at steps 4 and 7 hold versions 4 and 7.
        assert [traces[0][t][0] for t in range(STEPS)] == [1, 2, 2, 2, 4, 4, 4, 7]
        assert [traces[0][t][3]["staleness"] for t in range(STEPS)] == [0, 0, 0, 1, 2, 1, 2, 3]
    else:
        assert [traces[0][t][0] for t in range(STEPS)] == [1, 2, 2, 3, 4, 5, 6, 7]
        assert [traces[0][t][3]["staleness"] for t in range(STEPS)] == [0, 0, 0] + [1] * 5


def test_glu_update_source_moves_along_the_latest_global_step(runs):
    for r in runs:
        trace = r["glu_update"]
        for t in range(3, STEPS):
            # Step t refreshed to version t; the latest applied step is t-1 -> t (lr of step t-1).
            (g_prev, _), (g_now, local) = trace[t - 1], trace[t]
            expected = g_now - 2.0 * lr_of(t) * (g_prev - g_now) / lr_of(t - 1)
            assert torch.allclose(local, expected, atol=1e-6, rtol=1e-5), t


def _waits(log):
    return [e for e in log if e[0] == "wait"]


def test_overlap_slowed_collective_does_not_block_the_step(runs):
    end = OVERLAP_STEPS  # the clock reading of finish(), after the last step
    for r in runs:
        for name in ("od", "ssd"):
            log = r[f"log_{name}_1"]
            # Warm-up: one synchronous (blocking) allreduce, no async one.
            assert [e for e in log if e[0] == "sync"] == [("sync", 0)]
            launches = [e[1] for e in log if e[0] == "launch"]
            assert launches == list(range(1, end))
            waits = _waits(log)
            assert sorted(w[1] for w in waits) == launches  # every collective waited exactly once
            # Slowed by one step of compute: no wait comes before its collective could finish...
            assert not any(w[3] for w in waits)
            # ...because each wait comes after at least one more step was computed.
            for _, launched, waited, _ in waits:
                assert waited > launched
                if waited < end:
                    assert log.index(("compute", launched + 1)) < log.index(("wait", launched, waited, False))
        # OD-SGD waits every step for the previous step's collective; SSD-SGD (k = 3) only at its
        # refreshes (steps 3 and 6) and at the end, for up to k collectives at once.
        assert [w[2] for w in _waits(r["log_od_1"])] == list(range(2, end + 1))
        assert [w[2] for w in _waits(r["log_ssd_1"])] == [3, 3, 6, 6, 6, end]
        # Slowed by two steps: OD-SGD blocks at every step, SSD-SGD at one step in three.
        assert sum(w[3] for w in _waits(r["log_od_2"]) if w[2] < end) == 5
        assert sum(w[3] for w in _waits(r["log_ssd_2"]) if w[2] < end) == 2


@pytest.mark.parametrize("rule", list(RESUMED))
def test_checkpoint_with_collectives_in_flight_resumes_exactly(runs, rule):
    for r in runs:
        straight, resumed, in_flight = r[f"resume_{rule}"]
        assert in_flight == [1, 0]  # A_4 was in flight; state_dict completed it
        assert torch.equal(straight[0], resumed[0])
        assert torch.equal(straight[1], resumed[1])


def test_local_lr_on_its_own_schedule(runs):
    """After warm-up each rank's local replica takes plain SGD steps with its own gradient at
    local_lr x gamma^(milestones passed) with the run's weight decay, whatever the run's lr."""
    for rank, r in enumerate(runs):
        local = r["local_schedule"]
        w = local[1].clone()  # after the 2 warm-up steps: the global replica
        scratch = new_model()
        for t in range(2, STEPS):
            torch.nn.utils.vector_to_parameters(w, scratch.parameters())
            scratch.zero_grad()
            F.cross_entropy(scratch(batch(rank, t)[0]), batch(rank, t)[1]).backward()
            g = flat(p.grad for p in scratch.parameters())
            passed = sum(1 for m in LOCAL_SCHEDULE["local_milestones"] if t / STEPS >= m)
            rate = LOCAL_SCHEDULE["local_lr"] * LOCAL_SCHEDULE["local_gamma"] ** passed
            w = w - rate * (g + TRAIN["weight_decay"] * w)
            assert torch.allclose(local[t], w, atol=1e-6, rtol=1e-5), (rank, t)


# ---- single-process pieces ------------------------------------------------------------------------
def test_local_rules_against_their_formulas():
    g, gg = torch.randn(50), torch.randn(50)
    shift = torch.randn(50) * 0.1
    opts = parse_options(ALGORITHMS.get("ssdsgd").Options,
                         {"dc_lambda": 0.3, "dc_adaptive": False, "glu_weight": 0.25})
    assert torch.equal(LOCAL_RULES["sgd"](opts).direction(g, shift, gg), g)
    assert torch.allclose(LOCAL_RULES["dcasgd"](opts).direction(g, shift, gg), g + 0.3 * g * g * shift)
    assert torch.equal(LOCAL_RULES["dcasgd"](opts).direction(g, None, gg), g)
    assert torch.allclose(LOCAL_RULES["glu"](opts).direction(g, shift, gg), 0.75 * g + 0.25 * gg)
    adaptive = LOCAL_RULES["dcasgd"](parse_options(ALGORITHMS.get("ssdsgd").Options,
                                                   {"dc_lambda": 2.0, "dc_ms_decay": 0.9}))
    adaptive.direction(g, None, None)
    ms = 0.1 * g * g
    g2 = torch.randn(50)
    ms = 0.9 * ms + 0.1 * g2 * g2
    expected = g2 + 2.0 / torch.sqrt(ms + 1e-7) * g2 * g2 * shift
    assert torch.allclose(adaptive.direction(g2, shift, None), expected)


def test_scaled_sgd_steps_with_scaled_lr_like_torch_sgd():
    a, b = torch.nn.Parameter(torch.randn(20)), torch.nn.Parameter(torch.randn(20))
    b.data.copy_(a.data)
    mine = ScaledSGD([a], lr=0.1, lr_scale=4.0, momentum=0.5, weight_decay=0.01)
    ref = torch.optim.SGD([b], lr=0.4, momentum=0.5, weight_decay=0.01)
    for _ in range(3):
        g = torch.randn(20)
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        ref.step()
    assert torch.equal(a, b)
    assert mine.param_groups[0]["lr"] == 0.1  # the loop's lr is left as the loop set it


def test_the_declared_local_optimizer_is_scaled_sgd_with_the_local_momentum():
    """SSD-SGD declares its local optimizer; the loop builds it: SGD at local_lr_scale x the run's
    lr with local_momentum, the run's weight decay, never Nesterov, whatever the run's optimizer."""
    cls = ALGORITHMS.get("ssdsgd")
    options = parse_options(cls.Options, {"local_lr_scale": 5.0, "local_momentum": 0.3})
    for train in (TRAIN, {**TRAIN, "nesterov": True}, {**TRAIN, "optimizer": "adam"}):
        declared = cls.loop_optimizer(options, optimizer_settings(train))
        opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], declared)
        group = opt.param_groups[0]
        assert type(opt) is ScaledSGD
        assert (group["lr"], group["lr_scale"], group["momentum"], group["nesterov"], group["weight_decay"]) == \
            (TRAIN["lr"], 5.0, 0.3, False, TRAIN["weight_decay"])


@pytest.mark.parametrize("bad", [{"k": 0}, {"warmup_steps": -1}, {"local_optimizer": "adam"},
                                 {"local_lr_scale": -1.0}, {"glu_weight": 1.5}, {"local_momentum": 1.0},
                                 {"dc_ms_decay": 1.0}, {"bucket_mb": 0}, {"glu_source": "weights"},
                                 {"local_lr": -1.0}, {"local_milestones": [10]}, {"local_gamma": 0.0},
                                 {"local_lr": 0.1, "local_momentum": 0.5}, {"glu_reading": "paper"},
                                 {"local_rescale": "sum"}])
def test_options_reject_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        parse_options(ALGORITHMS.get("ssdsgd").Options, bad)


def test_odsgd_has_no_k_and_method_defaults():
    with pytest.raises(ValueError, match="unknown option"):
        parse_options(ALGORITHMS.get("odsgd").Options, {"k": 2})
    od, ssd = ALGORITHMS.get("odsgd").Options(), ALGORITHMS.get("ssdsgd").Options()
    assert (od.warmup_steps, ssd.warmup_steps, ssd.k) == (200, 500, 5)
