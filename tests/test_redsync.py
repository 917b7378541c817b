"""RedSync and DGC on gloo ranks against dense references: density 1.0 is momentum SGD, masking
zeroes exactly the sent entries, the residual is conserved, and indices above 2^24 survive."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commlab.algorithms.base import parse_options
from commlab.algorithms.dgc import DGC
from commlab.algorithms.momentum_correction import warmup_density
from commlab.algorithms.redsync import RedSync
from commlab.config import DEFAULTS, load_config
from commlab.loop.optim import optimizer_settings
from commlab.testing import drive, run_distributed


def _model() -> nn.Module:
    # Layer sizes 12800, 200, 10000, 50, 500, 10: every selector and the dense path get a layer
    # once the thresholds below are applied.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 50), nn.ReLU(), nn.Linear(50, 10))


SMALL_POLICY = {"binary_search_above": 10_000, "trimmed_topk_above": 5_000, "dense_at_most": 64}


def _train_cfg(**kw) -> dict:
    return {**DEFAULTS["train"], "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3, **kw}


def _drive(method: str, params: dict, train: dict, model: nn.Module, steps: int, **how):
    """The method on ``model`` for ``steps`` steps of the training loop (4 steps an epoch, 100 in all)."""
    return drive(method, params, model=model, steps=steps, train=train, steps_per_epoch=4, total_steps=100, **how)


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)


# ---- density 1.0 equals momentum SGD with a dense allreduce ---------------------------------------
def _equivalence(rank, world, steps):
    out = {}
    for nesterov in (False, True):
        runs = {"ssgd": ("ssgd", {}, _train_cfg(nesterov=nesterov)),
                "redsync": ("redsync", {"density": 1.0}, _train_cfg(nesterov=nesterov)),
                "dgc": ("dgc", {"density": 1.0}, _train_cfg(nesterov=nesterov)),
                "plain_sgd": ("ssgd", {}, _train_cfg(momentum=0.0))}
        for name, (method, params, train) in runs.items():
            gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data, same per method
            driven = _drive(method, params, train, _model(), steps, batches=lambda step, gen=gen: _batch(gen))
            out[(nesterov, name)] = [p.detach().clone() for p in driven.model.parameters()]
            group = driven.optimizer.param_groups[0]
            out[(nesterov, name, "momentum")] = (type(driven.optimizer).__name__, group["momentum"],
                                                 group["weight_decay"], group["nesterov"])
    return out


def test_density_one_equals_momentum_sgd_with_dense_allreduce():
    results = run_distributed(_equivalence, 4, args=(6,))
    for out in results:
        for nesterov in (False, True):
            reference = out[(nesterov, "ssgd")]
            for method in ("redsync", "dgc"):
                # plain SGD: momentum, Nesterov and weight decay live in the compressor
                assert out[(nesterov, method, "momentum")] == ("SGD", 0.0, 0.0, False)
                for ours, ref in zip(out[(nesterov, method)], reference, strict=True):
                    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-6), (nesterov, method)
            # momentum matters here, so the agreement above is not vacuous
            plain = out[(nesterov, "plain_sgd")]
            assert max(float((a - b).abs().max()) for a, b in zip(plain, reference, strict=True)) > 1e-3
        # Nesterov changes the trajectory (the release silently dropped its term)
        assert any(not torch.allclose(a, b) for a, b in
                   zip(out[(False, "redsync")], out[(True, "redsync")], strict=True))
    for a, b in zip(results[0][(True, "redsync")], results[3][(True, "redsync")], strict=True):
        assert torch.equal(a, b)  # every rank holds the same replica


# ---- masking and conservation, step by step, against a brute-force recomputation ------------------
VARIANTS = {
    "momentum": {"density": 0.05, **SMALL_POLICY},
    "nesterov": {"density": 0.05, "nesterov": True, **SMALL_POLICY},
    "quantized": {"density": 0.05, "quantize": True, **SMALL_POLICY},
    "no_momentum": {"density": 0.02, "momentum": 0.0, **SMALL_POLICY},
    "clipped": {"density": 0.05, "local_clip": 0.05, **SMALL_POLICY},
    "dgc": {"density": 0.05, "dense_at_most": 64},
}


def _masking(rank, world, steps):
    return {name: _mask_variant(rank, world, steps, "dgc" if name == "dgc" else "redsync", params)
            for name, params in VARIANTS.items()}


def _mask_variant(rank, world, steps, method, params):
    """Every step of ``method``, checked between backward and the optimizer step against a
    brute-force recomputation of what it must have done."""
    gen = torch.Generator().manual_seed(7 + rank)
    errors = {"mask": 0.0, "untouched": 0.0, "conservation": 0.0, "cumulative": 0.0}
    band, selectors, flags, sums, before = [], set(), {"signs_ok": True, "clipped": False}, {}, []

    def watch(point, driven, info):
        algo, step = driven.algo, info.step
        if not sums:
            sums["grads"] = [torch.zeros(layer.n) for layer in algo.layers]
            sums["applied"] = [torch.zeros(layer.n) for layer in algo.layers]
        if point == "gradients":  # before after_backward: the raw gradients and the state
            raw = [layer.param.grad.reshape(-1).clone() for layer in algo.layers]
            if algo.options.local_clip:  # brute force: one norm over all layers, limit clip/sqrt(P)
                norm = float(torch.cat(raw).norm())
                limit = algo.options.local_clip / world ** 0.5
                flags["clipped"] |= norm > limit
                raw = [g * min(1.0, limit / (norm + 1e-6)) for g in raw]
            before[:] = [(layer.u.clone(), layer.v.clone(), g, layer.param.detach().reshape(-1).clone())
                         for layer, g in zip(algo.layers, raw, strict=True)]
        elif point == "synchronised":  # after after_backward, before the optimizer step
            _check_step(algo, step, world, before, errors, band, selectors, flags, sums)

    driven = _drive(method, params, _train_cfg(), _model(), steps, batches=lambda step: _batch(gen), watch=watch)
    algo = driven.algo
    if algo.m == 0:  # sum of gradients = sum of applied updates + residuals (averaged over ranks)
        for i, layer in enumerate(algo.layers):
            total = sums["grads"][i] - layer.v
            dist.all_reduce(total)
            errors["cumulative"] = max(errors["cumulative"],
                                       float((total / world - sums["applied"][i]).abs().max()))
    return {"errors": errors, "band": band, "selectors": selectors, "signs_ok": flags["signs_ok"],
            "clipped": flags["clipped"], "metrics": algo.metrics(), "stats": algo.comm.stats.totals()}


def _check_step(algo, step, world, before, errors, band, selectors, flags, sums):
    m, nesterov, wd = algo.m, algo.nesterov, algo.weight_decay
    for i, (layer, (u0, v0, g, w)) in enumerate(zip(algo.layers, before, strict=True)):
        g = g + wd * w
        u1 = m * u0 + g
        v_pre = v0 + (m * u1 + g if nesterov else u1)
        sent = v_pre - layer.v  # what this rank handed over this step
        sums["grads"][i] += g
        idx = layer.last_indices
        if idx is None:  # dense layer: everything sent, momentum kept
            errors["untouched"] = max(errors["untouched"], float((layer.u - u1).abs().max()))
            errors["mask"] = max(errors["mask"], float(layer.v.abs().max()))
        else:
            selectors.add(layer.selector_name)
            rest = torch.ones(layer.n, dtype=torch.bool)
            rest[idx] = False
            errors["mask"] = max(errors["mask"], _amax(layer.u[idx]))
            if not algo.quantized:
                errors["mask"] = max(errors["mask"], _amax(layer.v[idx]))
            else:  # one mean per layer at the sent indices, all of one sign
                chosen = v_pre[idx]
                flags["signs_ok"] &= bool((chosen > 0).all() if step % 2 == 0 else (chosen < 0).all())
                if idx.numel():
                    errors["mask"] = max(errors["mask"], float((sent[idx] - chosen.mean()).abs().max()))
            errors["untouched"] = max(errors["untouched"], float((layer.u[rest] - u1[rest]).abs().max()),
                                      float((layer.v[rest] - v_pre[rest]).abs().max()))
            if layer.selector_name == "binary_search" and not algo.quantized:
                band.append((idx.numel(), algo_k(layer.n, algo.density)))
        dist.all_reduce(sent)  # brute force: the dense average of what every rank sent
        sent /= world
        errors["conservation"] = max(errors["conservation"],
                                     float((sent - layer.param.grad.reshape(-1)).abs().max()))
        sums["applied"][i] += layer.param.grad.reshape(-1)


def algo_k(n: int, density: float) -> int:
    from commlab.compress.base import k_for_density

    return k_for_density(n, density)


def test_masking_zeroes_exactly_the_sent_entries_and_the_residual_is_conserved():
    results = run_distributed(_masking, 2, args=(3,))
    for report in results:
        for name, r in report.items():
            e = r["errors"]
            assert e["mask"] < 1e-6, (name, e)
            assert e["untouched"] < 1e-6, (name, e)
            assert e["conservation"] < 1e-6, (name, e)
            assert e["cumulative"] < 1e-5, (name, e)
            assert all(k / 2 < count < 2 * k for count, k in r["band"]), (name, r["band"])
            assert r["signs_ok"], name
            assert r["stats"]["reductions_global"] == 3  # one reduction per step
            assert r["stats"]["selection_seconds"] > 0 and r["stats"]["elements_selected"] > 0
        assert report["momentum"]["selectors"] == {"binary_search", "trimmed_topk", "exact_topk"}
        assert report["dgc"]["selectors"] == {"exact_topk"}
        assert report["clipped"]["clipped"]  # the clipping branch was exercised
        assert report["momentum"]["band"]  # the binary-search layer was checked
        metrics = report["momentum"]["metrics"]
        assert any(key.startswith("select_ms_binary_search_n12800") for key in metrics)
        assert 0 < metrics["selected_fraction"] < 0.1
        # the quantised variant sends one mean per layer instead of one value per index
        assert report["quantized"]["stats"]["bytes_sent"] < report["momentum"]["stats"]["bytes_sent"]


# ---- indices above 2^24 survive the compress + gather path ----------------------------------------
BIG = 2**24 + 4096
SPIKES = [2**24 + 1, 2**24 + 3, BIG - 1]  # odd: float32 would round them to a neighbour


def _big_layer(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(1, BIG, bias=False)
    gen = torch.Generator().manual_seed(rank)
    grad = torch.randn(BIG, 1, generator=gen) * 1e-3
    for j, i in enumerate(SPIKES):
        grad[i] = 10.0 * (rank + 1) + j
    algo = _drive("redsync", {"density": 0.001}, _train_cfg(momentum=0.0, weight_decay=0.0), model, 1,
                  grads=lambda step: [grad]).algo
    out = model.weight.grad.reshape(-1)
    layer = algo.layers[0]
    sent = grad.reshape(-1) - layer.v
    dist.all_reduce(sent)
    return {"values": out[[2**24, *SPIKES]].clone(), "selector": layer.selector_name,
            "conservation": float((sent / world - out).abs().max()), "count": int(layer.last_indices.numel())}


def test_indices_above_2_pow_24_survive():
    results = run_distributed(_big_layer, 2, timeout_s=120)
    k = algo_k(BIG, 0.001)
    for r in results:
        assert r["selector"] == "binary_search"
        assert k / 2 < r["count"] < 2 * k
        assert r["conservation"] < 1e-6
        values = r["values"]
        assert abs(float(values[0])) < 0.1  # 2^24 itself got nothing of the spikes
        for j in range(len(SPIKES)):  # the mean over the two ranks of 10*(rank+1)+j
            assert float(values[1 + j]) == pytest.approx(15.0 + j)


# ---- the training loop runs it end to end ---------------------------------------------------------
def _loop(rank, world, out_dir):
    from commlab.loop import train

    config = load_config(None, [
        "method=redsync", "model=mlp", "dataset=synthetic", f"workers={world}", "seed=1",
        "train.epochs=1", "train.batch_size=16", "train.train_subset=512", "train.max_steps=8",
        "train.log_every=4", "tracking.enabled=false", f"output_dir={out_dir}",
        "method_params.density=0.01", "method_params.warmup=true", "method_params.warmup_stage_epochs=0.25",
    ])
    final = train(config)
    state = torch.load(f"{out_dir}/checkpoints/step_8/rank{rank}.pt", weights_only=False)
    return final, state["algorithm"]["totals"], state["optimizer"]["param_groups"][0]["momentum"]


def test_redsync_through_the_training_loop(tmp_path):
    results = run_distributed(_loop, 2, args=(str(tmp_path),))
    final, totals, momentum = results[0]
    assert momentum == 0.0
    assert totals["steps"] == 8
    assert final["elements_selected"] > 0 and final["selection_seconds"] > 0
    # 16 steps per epoch: step 7 is in the second warm-up stage (6.25%), above the target 1%
    assert final["algo_density"] == pytest.approx(0.0625)
    assert 0 < final["algo_sent_fraction"] < 0.5


# ---- options, policy, schedule --------------------------------------------------------------------
def test_selector_policy_by_layer_size_and_dgc_uses_exact_topk():
    opts = parse_options(RedSync.Options, {})
    redsync = RedSync(nn.Linear(1, 1), None, opts, None)
    assert [redsync.selector_for(n) for n in (1024, 1025, 2**20, 2**20 + 1, 4 * 2**20, 4 * 2**20 + 1)] == \
        [None, "exact_topk", "exact_topk", "trimmed_topk", "trimmed_topk", "binary_search"]
    dgc = DGC(nn.Linear(1, 1), None, parse_options(DGC.Options, {}), None)
    assert [dgc.selector_for(n) for n in (1024, 1025, 10**8)] == [None, "exact_topk", "exact_topk"]
    with pytest.raises(ValueError, match="unknown option"):
        parse_options(DGC.Options, {"reuse_every": 10})


def test_paper_grid_runs_every_selector_where_the_paper_uses_it():
    """The paper-scale grid has a layer above 4M elements (VGG-16's 4096x4096 classifier layer), so
    the threshold binary search runs at the paper's thresholds, and a 1M-4M one for trimmed top-k."""
    from pathlib import Path

    from commlab.grid import resolve_grid
    from commlab.models import build_model

    root = Path(__file__).resolve().parents[1]
    runs = resolve_grid("redsync", scale="paper", papers_dir=root / "config/papers")
    config = runs[("redsync_vgg16fc", 0)]
    model = build_model(config["model"], 3, 10, 32)
    algo = RedSync(model, None, parse_options(RedSync.Options, config["method_params"]), None)
    selectors = {algo.selector_for(p.numel()) for p in model.parameters()}
    assert {"binary_search", "trimmed_topk", "exact_topk", None} <= selectors
    assert max(p.numel() for p in model.parameters()) == 4096 * 4096 > config["method_params"]["binary_search_above"]


def test_density_warmup_schedule():
    opts = parse_options(RedSync.Options, {"warmup": True, "density": 0.001})
    assert [warmup_density(e, opts) for e in (0, 0.5, 1, 2, 3, 4, 10)] == \
        [0.25, 0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]
    opts = parse_options(RedSync.Options, {"warmup": True, "density": 0.01, "warmup_stage_epochs": 0.5})
    assert [warmup_density(e, opts) for e in (0, 0.5, 1.0, 1.5, 2.0)] == [0.25, 0.0625, 0.015625, 0.01, 0.01]
    assert warmup_density(0, parse_options(RedSync.Options, {})) == 0.001


@pytest.mark.parametrize("params,match", [({"density": 0}, "density"), ({"momentum": 1.0}, "momentum"),
                                           ({"reuse_every": 0}, "reuse_every"),
                                           ({"warmup_densities": [0.5, 2]}, "warmup_densities"),
                                           ({"local_clip": -1}, "local_clip")])
def test_bad_options_name_the_value(params, match):
    with pytest.raises(ValueError, match=match):
        parse_options(RedSync.Options, params)


def test_adam_is_refused():
    # the method declares plain SGD, and refuses a run whose optimizer is Adam (momentum lives in
    # the compressor); the SGD itself is checked in the distributed tests
    run = optimizer_settings(_train_cfg())
    for cls in (RedSync, DGC):
        declared = cls.loop_optimizer(parse_options(cls.Options, {}), run)
        assert declared == dataclasses.replace(run, momentum=0.0, nesterov=False, weight_decay=0.0)
        with pytest.raises(ValueError, match="needs train.optimizer 'sgd'.*got 'adam'"):
            cls.loop_optimizer(parse_options(cls.Options, {}), optimizer_settings(_train_cfg(optimizer="adam")))
