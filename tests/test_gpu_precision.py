"""Mixed precision on a GPU (marked ``gpu``: ``make test-gpu``; skipped without CUDA): bfloat16
autocast on two gloo ranks sharing the GPU, for the methods with state of their own, keeps the
loss finite and near the float32 run's and every tensor a method holds in float32 (the CPU version
and its helpers: tests/test_precision.py)."""

from __future__ import annotations

import pytest
import torch

from commlab.testing import run_distributed
from test_precision import _check, _config, _watched

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")]


def test_bf16_autocast_on_cuda(tmp_path):
    methods = ["ssgd", "redsync", "powersgd", "ssdsgd", "asgd"]
    configs = [_config(tmp_path, m, p, device="cuda") for m in methods for p in ("fp32", "bf16")]
    per_rank = run_distributed(_watched, 2, args=(configs,), timeout_s=300, device="cuda")
    for i, method in enumerate(methods):
        _check(method, per_rank[0][2 * i], per_rank[0][2 * i + 1])
