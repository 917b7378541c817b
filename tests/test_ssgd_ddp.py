"""Dense SGD through the Communicator equals PyTorch DDP, step for step, on the same data."""

import pytest
import torch

from commlab.config import load_config
from commlab.testing import run_distributed


def _train(rank, world, method, out_dir, model):
    from commlab.loop import train

    config = load_config(None, [
        f"method={method}", f"model={model}", "dataset=synthetic", f"workers={world}", "seed=3",
        "train.epochs=2", "train.batch_size=16", "train.train_subset=1024", "train.lr=0.05",
        "train.momentum=0.9", "train.weight_decay=0.0001", "train.log_every=4", "tracking.enabled=false",
        f"output_dir={out_dir}", "method_params.bucket_mb=0.05",
    ])
    final = train(config)
    state = torch.load(f"{out_dir}/checkpoints/step_32/rank{rank}.pt", weights_only=False)
    return final, state["model"], state["stats"]["counters"]


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_ssgd_matches_ddp_parameters(tmp_path, model):
    world = 4
    ssgd = run_distributed(_train, world, args=("ssgd", str(tmp_path / "ssgd"), model))
    ddp = run_distributed(_train, world, args=("ddp", str(tmp_path / "ddp"), model))
    for rank in range(world):
        ours, theirs = ssgd[rank][1], ddp[rank][1]
        for key in ours:
            assert torch.allclose(ours[key], theirs[key], rtol=1e-4, atol=1e-6), key
        # Every rank holds the same replica.
        for key in ours:
            assert torch.equal(ours[key], ssgd[0][1][key])
    f_ssgd, f_ddp = ssgd[0][0], ddp[0][0]
    assert f_ssgd["test_accuracy"] == pytest.approx(f_ddp["test_accuracy"], abs=0.2)
    # 1024 samples / (4 x 16) = 16 steps per epoch, 32 steps: one global reduction each. Summed
    # over ranks, a ring allreduce of n elements moves 2n(P-1) whatever the bucketing, so both
    # methods account the same bytes: the initial broadcast plus 32 allreduces of all gradients.
    c_ssgd, c_ddp = ssgd[0][2], ddp[0][2]
    assert c_ssgd["reductions_global"] == c_ddp["reductions_global"] == 32
    n = sum(v.numel() for v in ssgd[0][1].values())
    for counters in ([r[2] for r in ssgd], [r[2] for r in ddp]):
        assert sum(c["elements_sent"] for c in counters) == 32 * 2 * n * (world - 1) + n * (world - 1)
    assert c_ssgd["collectives_global"] > 32  # small buckets: several allreduces per step



class _WithUnused(torch.nn.Module):
    """Three layers; ``skip`` is not used in forward (its gradient stays zero, no hook fires)."""

    def __init__(self):
        super().__init__()
        self.a, self.skip, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _small_model(unused: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if unused:
        return _WithUnused()
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _in_bucket(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= t.data_ptr() < start + flat.numel() * flat.element_size()


def _overlapped(rank, world, method, unused):
    from commlab.algorithms.dense_allreduce import allreduce_gradients
    from commlab.algorithms.tensors import grad_buckets
    from commlab.core import CommStats, Communicator
    from commlab.testing import drive

    gen = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)) for _ in range(3)]
    bucket_bytes = 30 * 4  # about 30 floats: two or three buckets
    side = Communicator(stats=CommStats())  # the blocking reference, uncounted by the method
    seen = {"started": [], "views": [], "synced": [], "reference": []}

    def watch(point, driven, info):
        algo = driven.algo
        if point == "gradients":  # backward done, after_backward not called yet
            seen["started"].append(sum(b.pending is not None for b in algo.buckets))
            seen["weights"] = [p.detach().clone() for p in algo.model.parameters()]
        elif point == "synchronised":
            params = list(algo.model.parameters())
            seen["views"].append(all(any(_in_bucket(p.grad, b.flat) for b in algo.buckets) for p in params))
            seen["synced"].append([p.grad.clone() for p in params])
            # The same local gradients (same weights, same batch), averaged by blocking allreduces.
            ref = _small_model(unused)
            with torch.no_grad():
                for r, w in zip(ref.parameters(), seen["weights"], strict=True):
                    r.copy_(w)
            torch.nn.functional.cross_entropy(ref(batches[info.step][0]), batches[info.step][1]).backward()
            allreduce_gradients(grad_buckets(list(ref.parameters()), bucket_bytes), side)
            seen["reference"].append([r.grad.clone() for r in ref.parameters()])

    driven = drive(method, {"bucket_mb": bucket_bytes / 2**20}, model=_small_model(unused), steps=3,
                   batches=lambda s: batches[s], train={"lr": 0.1, "optimizer": "sgd"}, watch=watch)
    return seen, len(driven.algo.buckets), driven.comm.stats.totals()


@pytest.mark.parametrize("method, unused", [("ssgd", False), ("ssgd", True), ("fp16", False)])
def test_ssgd_starts_bucket_allreduces_in_backward_and_averages_exactly(method, unused):
    results = run_distributed(_overlapped, 3, args=(method, unused))
    for seen, buckets, totals in results:
        assert buckets >= 2
        # Every bucket started during backward; with a parameter unused in forward in the first
        # bucket, no bucket starts before after_backward (buckets start in order on every rank).
        assert seen["started"] == ([0] * 3 if unused else [buckets] * 3)
        assert seen["views"] == [True] * 3  # every gradient is a view into its bucket
        for synced, ref in zip(seen["synced"], seen["reference"], strict=True):
            for got, want in zip(synced, ref, strict=True):
                if method == "ssgd":
                    assert torch.equal(got, want)  # the blocking bucketed allreduce, bit for bit
                else:
                    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # fp16 on the wire
        assert totals["reductions_global"] == 3
        assert totals["collectives_global"] == 1 + 3 * buckets  # setup's broadcast, then the buckets
    for seen, _, _ in results[1:]:  # every replica applies the same gradient
        for a, b in zip(seen["synced"], results[0][0]["synced"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _ddp_batch_norm(rank, world):
    """Two ddp steps of a model whose BatchNorm comes first (its running mean is the inputs'
    own: independent of the weights), each rank on its own batches; what torch warned."""
    import warnings

    from commlab.testing import drive

    gen = torch.Generator().manual_seed(20 + rank)
    batches = [(torch.randn(8, 6, generator=gen) + rank, torch.randint(0, 3, (8,), generator=gen)) for _ in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drive("ddp", None, model=model, steps=2, batches=lambda s: batches[s], train={"lr": 0.1, "optimizer": "sgd"})
    # BatchNorm's update without any sync between ranks: momentum 0.1 from zero, the rank's own batches
    expected = 0.9 * (0.1 * batches[0][0].mean(0)) + 0.1 * batches[1][0].mean(0)
    return model[0].running_mean.clone(), expected, [str(w.message) for w in caught if w.category is FutureWarning]


def test_ddp_keeps_batch_norm_statistics_per_rank_as_ssgd_does_without_a_warning():
    for running, expected, warned in run_distributed(_ddp_batch_norm, 2):
        # a forward buffer sync would have put rank 0's statistics into rank 1's before step 2
        torch.testing.assert_close(running, expected)
        assert warned == []  # torch 2.14 deprecates broadcast_buffers: the option is named for the torch in use
