"""Short runs that still reach every method's main path: method options for a few dozen steps.

The defaults of the methods are the papers' (Ok-Topk's 128 dense warm-up steps, SSD-SGD's 500,
K-step periods of 16 and more), so a run of a few dozen steps would only ever take their warm-up
branch. :data:`QUICK_PARAMS` shortens warm-ups and periods so that a 32-step run on generated data
takes the sparse, compressed, delayed or averaging branch many times; the GPU suite and the replica
tests run every registered method with them::

    from commlab.testing.quick import quick_run_config
    cfg = quick_run_config("oktopk", out_dir, backend="nccl")   # a run config (a dict), 32 steps
"""

from __future__ import annotations

QUICK_PARAMS: dict[str, dict] = {
    "oktopk": {"warmup_steps": 4, "density": 0.02},
    "topk_allgather": {"warmup_steps": 4, "density": 0.02},
    "gaussiank": {"warmup_steps": 4, "density": 0.02},
    "gtopk": {"warmup_steps": 4, "density": 0.02},
    "redsync": {"density": 0.01, "binary_search_above": 1_000_000, "trimmed_topk_above": 100_000},
    "dgc": {"density": 0.01},
    "powersgd": {"warmup_steps": 4, "rank": 2},
    "kstep": {"k": 4},
    "kstep_hier": {"k_local": 2, "k_global": 4, "group_size": 2},
    "cpsgd": {"period": 4},
    "adpsgd": {"initial_period": 2, "calibration_syncs": 2, "calibration_warmup": 2},
    "ssdsgd": {"warmup_steps": 4, "k": 2},
    "odsgd": {"warmup_steps": 4},
}

#: Methods whose layer-size policy needs large layers to pick every selector (RedSync's binary
#: search above 1M elements, trimmed top-k above 100k): they run on ``wide_mlp``.
WIDE_MODEL = {"redsync", "dgc"}


def quick_run_config(method: str, out_dir: str, *, workers: int = 1, backend: str = "gloo", device: str = "auto",
                     epochs: int = 2, seed: int = 0, **extra) -> dict:
    """A run config of ``method`` on generated data: 16 steps per epoch (512 samples, batch 32 per
    worker spread over the workers), MLflow off, the run's folder ``out_dir``."""
    params = dict(QUICK_PARAMS.get(method, {}))
    if method == "kstep_hier" and workers % 2:
        params["group_size"] = 1
    return {"method": method, "method_params": params, "model": "wide_mlp" if method in WIDE_MODEL else "cnn",
            "dataset": "synthetic", "seed": seed, "workers": workers, "backend": backend, "device": device,
            "output_dir": str(out_dir), "tracking": {"enabled": False},
            "train": {"epochs": epochs, "batch_size": 32 // workers if workers <= 32 else 1, "lr": 0.05,
                      "train_subset": 512, "test_subset": 256, "log_every": 4}, **extra}
