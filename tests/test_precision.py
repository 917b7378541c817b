"""Mixed precision (``train.precision: bf16``; src/commlab/loop/precision.py): a few steps through
the loop on two gloo ranks with bfloat16 autocast on the CPU, for methods that keep state of
their own (residuals and error feedback, RedSync's u and v, PowerSGD's errors, QSGD's rounding,
SSD-SGD's global replica, ASGD's server). The loss stays finite and close to the float32 run's
without being equal to it (autocast did change the arithmetic), and the parameters, the gradients
the methods see stay float32, and every floating-point tensor a method keeps keeps its dtype
(float32; a float64 statistic stays float64), never a 16-bit one."""

from __future__ import annotations

import math

import pytest
import torch

from commlab.testing import run_distributed
from commlab.testing.quick import QUICK_PARAMS
from looprun import run, run_config

METHODS = ["ssgd", "redsync", "powersgd", "qsgd", "oktopk", "ssdsgd", "asgd"]


def _floating_dtypes(state, found: set) -> set:
    if torch.is_tensor(state):
        if state.is_floating_point():
            found.add(str(state.dtype))
    elif isinstance(state, dict):
        for value in state.values():
            _floating_dtypes(value, found)
    elif isinstance(state, (list, tuple)):
        for value in state:
            _floating_dtypes(value, found)
    return found


def _dtypes(loop) -> dict:
    """What a finished run keeps: the method's state and the model's parameters, by dtype; and the
    dtype of the gradients the method received at the last step."""
    return {"state": sorted(_floating_dtypes(loop.algo.state_dict(), set())),
            "params": sorted({str(p.dtype) for p in loop.model.parameters()}),
            "grads": sorted(loop.seen_grads)}


def _watched(rank: int, world: int, configs: list[dict]) -> list:
    from commlab.loop import loop as loop_module

    backward = loop_module.Run._backward

    def spying(self, batch):  # the gradients as the method's after_backward receives them
        loss = backward(self, batch)
        self.seen_grads = {str(p.grad.dtype) for p in self.model.parameters() if p.grad is not None}
        return loss

    loop_module.Run._backward = spying
    return [run(c, keep=_dtypes) for c in configs]


def _config(tmp_path, method: str, precision: str, model: str = "cnn", dataset: str = "synthetic", **extra) -> dict:
    params = "{" + ", ".join(f"{k}: {v}" for k, v in QUICK_PARAMS.get(method, {}).items()) + "}"
    return run_config(tmp_path, tmp_path, f"{method}_{model}_{precision}", dataset, model, 8, **{
        "method": method, "method_params": params, "train.precision": precision, "train.max_steps": 6,
        "train.train_subset": 96, "train.test_subset": 32, **extra})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision")
    bert = {"model_options": "{layers: 2, hidden: 32, heads: 2, dropout: 0.0}", "task.seq_len": 16,
            "train.eval_batch_size": 8}
    configs = [_config(tmp, m, p) for m in METHODS for p in ("fp32", "bf16")]
    configs += [_config(tmp, "ssgd", p, "bert", "synthetic_tokens", **bert) for p in ("fp32", "bf16")]
    per_rank = run_distributed(_watched, 2, args=(configs,), timeout_s=300)
    names = [(m, "cnn") for m in METHODS] + [("ssgd", "bert")]
    return {name: (per_rank[0][2 * i], per_rank[0][2 * i + 1]) for i, name in enumerate(names)}


@pytest.mark.parametrize("method,model", [(m, "cnn") for m in METHODS] + [("ssgd", "bert")])
def test_bf16_autocast_keeps_everything_a_method_holds_in_fp32(results, method, model):
    _check(method, *results[(method, model)])


def _check(method: str, fp32, bf16) -> None:
    curve32, curve16 = [p["train_loss"] for p in fp32[2]], [p["train_loss"] for p in bf16[2]]
    assert len(curve16) == 6 and all(math.isfinite(v) for v in curve16)
    assert curve16 != curve32  # autocast ran the forward pass in bfloat16
    # ASGD's server applies pushes in arrival order, so its curve moves with the ranks' timing
    # (two fp32 runs differ too): a looser band there.
    assert curve16 == pytest.approx(curve32, rel=0.15 if method == "asgd" else 0.05)
    kept = bf16[3]
    assert kept["params"] == ["torch.float32"] and kept["grads"] == ["torch.float32"]
    # autocast changed no dtype a method keeps (SSD-SGD's float64 statistics stay float64), and
    # nothing it keeps is a 16-bit float
    assert kept["state"] == fp32[3]["state"], kept["state"]
    assert not {"torch.bfloat16", "torch.float16"} & set(kept["state"]), kept["state"]
    if method in ("redsync", "powersgd", "oktopk", "ssdsgd", "asgd"):
        assert "torch.float32" in kept["state"]  # a method with state was checked
