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
