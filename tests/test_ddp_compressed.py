"""DDP with bf16 and fp16 gradient compression (torch's bf16_compress_hook / fp16_compress_hook, run
through the Communicator) on 2 and 4 gloo ranks: one step's averaged gradient against the ranks'
own gradients cast, pre-divided and summed in the wire dtype as the hook does (written out here),
and bit for bit against torch's own hook on gloo; the bytes counted at 2 per element; and a few
steps that track fp32 DDP within the bound bfloat16 rounding allows."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook, fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from commlab.algorithms.ddp_wrapper import NO_FORWARD_BUFFER_SYNC
from commlab.testing import drive, run_distributed
from test_diloco import flat, gathered

SGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.0, "batch_size": 8}
WIRE = {"ddp_bf16": torch.bfloat16, "ddp_fp16": torch.float16}
TORCH_HOOK = {"ddp_bf16": bf16_compress_hook, "ddp_fp16": fp16_compress_hook}
BUCKET_MB = 0.004  # about 1,000 floats: the model's 2,000 parameters in two or more buckets
STEPS = 10


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 60), nn.Tanh(), nn.Linear(60, 30), nn.Tanh(), nn.Linear(30, 5))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 20, generator=g) * (1 + rank), torch.randint(0, 5, (8,), generator=g)


def own_gradient(weights: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's gradient at ``weights``, without DDP."""
    model = net()
    torch.nn.utils.vector_to_parameters(weights, model.parameters())
    F.cross_entropy(model(x), y).backward()
    return flat(param.grad for param in model.parameters())


def torch_hook_gradient(method: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The averaged gradient of torch's own compression hook on the same model, batch and buckets."""
    model = net()
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True, init_sync=False,
                                  **NO_FORWARD_BUFFER_SYNC)
    ddp.register_comm_hook(None, TORCH_HOOK[method])
    F.cross_entropy(ddp(x), y).backward()
    return flat(param.grad for param in model.parameters())


def _two_steps(rank, world, method):
    """Steps 0 (DDP's first iteration: one bucket) and 1 (its rebuilt buckets: several): the
    averaged gradient, the ranks' own gradients at the same weights, the step's counters."""
    model, seen = net(), {"synced": [], "weights": [], "counted": []}

    def watch(point, driven, info):
        if point == "synchronised":
            seen["synced"].append(flat(param.grad for param in model.parameters()))
        if point == "done":
            seen["weights"].append(flat(model.parameters()))
            seen["counted"].append(driven.comm.stats.totals())

    driven = drive(method, {"bucket_mb": BUCKET_MB}, model=model, steps=0, total_steps=2, train=SGD,
                   batches=lambda step: batch(rank, step), watch=watch)
    seen["weights"].insert(0, flat(model.parameters()))
    seen["counted"].insert(0, driven.comm.stats.totals())
    driven.run(2)
    steps = []
    for t in range(2):
        before, after = seen["counted"][t], seen["counted"][t + 1]
        steps.append({"synced": seen["synced"][t], "own": gathered(own_gradient(seen["weights"][t], *batch(rank, t))),
                      **{key: after[key] - before[key] for key in ("bytes_sent", "elements_sent",
                                                                   "collectives_global", "reductions_global")}})
    return {"steps": steps, "torch": torch_hook_gradient(method, *batch(rank, 0))}


def _tracking(rank, world):
    out = {}
    for method in ("ddp", "ddp_bf16"):
        seen = []

        def watch(point, driven, info, seen=seen):
            if point == "synchronised":
                seen.append(flat(param.grad for param in driven.model.parameters()))

        driven = drive(method, None, model=net(), steps=STEPS, train=SGD, batches=lambda step: batch(rank, step),
                       watch=watch)
        out[method] = (flat(driven.model.parameters()), torch.stack(seen))
    return out


def _everything(rank, world):
    return {"step": {method: _two_steps(rank, world, method) for method in WIRE}, "tracking": _tracking(rank, world)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def runs(request):
    return request.param, run_distributed(_everything, request.param, timeout_s=180)


def ring_sums(own: torch.Tensor, wire: torch.dtype, pre_divide: bool = True) -> list[torch.Tensor]:
    """An average over the ranks written out as a wire-dtype allreduce computes it: each rank's row
    of ``own`` cast to ``wire`` (and divided by P there, as the hook does, with ``pre_divide``),
    summed in ``wire`` in each order a ring can add them (gloo's ring starts each chunk at another
    rank, in either direction), back in float32 (divided by P there without ``pre_divide``)."""
    world = own.shape[0]
    parts = [g.to(wire).div_(world) if pre_divide else g.to(wire) for g in own]
    sums = []
    for start in range(world):
        for direction in (1, -1):
            total = parts[start].clone()
            for i in range(1, world):
                total = total + parts[(start + direction * i) % world]
            sums.append(total.to(torch.float32) if pre_divide else total.to(torch.float32) / world)
    return sums


@pytest.mark.parametrize("method", sorted(WIRE))
def test_a_step_is_the_wire_dtype_average_of_the_ranks_gradients(runs, method):
    world, results = runs
    n = sum(param.numel() for param in net().parameters())
    for out in results:
        for t, step in enumerate(out["step"][method]["steps"]):
            synced, own = step["synced"], step["own"]
            candidates = torch.stack(ring_sums(own, WIRE[method]))
            assert bool((candidates == synced).any(0).all()), f"step {t}: an element is no ring order's sum"
            if world == 2:  # one addition: one value
                assert torch.equal(synced, candidates[0])
            assert not torch.equal(synced, own.mean(0))  # not the float32 average: the test sees the wire
            assert step["reductions_global"] == 1
        # DDP's first iteration has one bucket, the next ones the buckets of bucket_mb
        assert [s["collectives_global"] for s in out["step"][method]["steps"]] == [1, 2]
        # torch's own hook on gloo gives the same gradient, bit for bit
        assert torch.equal(out["step"][method]["steps"][0]["synced"], out["step"][method]["torch"])
    for t in range(2):
        # over the ranks, a ring allreduce of n elements sends 2 n (P - 1) elements: 2 bytes each
        assert sum(out["step"][method]["steps"][t]["elements_sent"] for out in results) == 2 * n * (world - 1)
        assert sum(out["step"][method]["steps"][t]["bytes_sent"] for out in results) == 2 * n * (world - 1) * 2
        first = results[0]["step"][method]["steps"][t]["synced"]
        assert all(torch.equal(out["step"][method]["steps"][t]["synced"], first) for out in results)


def test_a_few_bf16_steps_track_fp32_ddp_within_the_rounding_bound(runs):
    """Each averaged bf16 gradient element is off by at most about P u max_r |g_r| (u = 2^-8,
    bfloat16's unit roundoff: the cast of each g_r and each of the P - 1 additions round once), so
    after T SGD steps the weights are apart by at most lr sum_t P u max|g_t|, times the growth the
    dynamics give such a perturbation in T steps (a factor 2 here: lr 0.1, 10 steps on a small
    net whose gradient changes slowly)."""
    world, results = runs
    u = 2.0 ** -8
    for out in results:
        (w32, g32), (w16, _) = out["tracking"]["ddp"], out["tracking"]["ddp_bf16"]
        bound = 2 * SGD["lr"] * sum(world * u * float(g.abs().max()) for g in g32)
        gap = float((w16 - w32).abs().max())
        assert 0 < gap <= bound, (gap, bound)
