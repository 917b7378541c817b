"""Short runs that still reach every method's main path: method options for a few dozen steps.

The defaults of the methods are the papers' (Ok-Topk's 128 dense warm-up steps, SSD-SGD's 500,
K-step periods of 16 and more), so a run of a few dozen steps would only ever take their warm-up
branch. Each method declares on its class the options that shorten them
(``quick_run``, a :class:`commlab.algorithms.base.QuickRun`), so that a 32-step run on generated
data takes the sparse, compressed, delayed or averaging branch many times, and whether it needs
the wide model; this module reads them from the registry. The GPU suite, the replica, precision
and resume tests run every registered method with them::

    from commlab.testing.quick import quick_run_config
    cfg = quick_run_config("oktopk", out_dir, backend="nccl")   # a run config (a dict), 32 steps

``QUICK_PARAMS`` (method -> options on one worker) and ``WIDE_MODEL`` (the methods that run on
``wide_mlp``) are the same declarations as tables, read afresh from the registry at each use.
"""

from __future__ import annotations

from commlab.algorithms.base import QuickRun
from commlab.registry import ALGORITHMS


def quick_run(method: str) -> QuickRun:
    """``method``'s declared :class:`QuickRun`, naming the method when it declares none."""
    declared = ALGORITHMS.get(method).quick_run
    if declared is None:
        raise ValueError(f"method {method!r} declares no quick_run (commlab.algorithms.base.QuickRun) on its class")
    return declared


def quick_params(method: str, workers: int = 1) -> dict:
    """``method``'s options for a short run on ``workers`` workers (a new dict)."""
    return quick_run(method).options(workers)


def quick_model(method: str) -> str:
    """The model a short run of ``method`` trains: ``wide_mlp`` where the method needs large
    layers to reach every branch, else the CNN."""
    return "wide_mlp" if quick_run(method).wide_model else "cnn"


def __getattr__(name: str):
    # The tables other code reads, derived from the declarations at each use, so that a method
    # registered later (a plugin) is in them too; a method that declares nothing is left out.
    declared = {method: cls.quick_run for method in ALGORITHMS.names()
                if (cls := ALGORITHMS.get(method)).quick_run is not None}
    if name == "QUICK_PARAMS":
        return {method: quick.options() for method, quick in declared.items()}
    if name == "WIDE_MODEL":
        return {method for method, quick in declared.items() if quick.wide_model}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quick_run_config(method: str, out_dir: str, *, workers: int = 1, backend: str = "gloo", device: str = "auto",
                     epochs: int = 2, seed: int = 0, **extra) -> dict:
    """A run config of ``method`` on generated data: 16 steps per epoch (512 samples, batch 32 per
    worker spread over the workers), MLflow off, the run's folder ``out_dir``."""
    return {"method": method, "method_params": quick_params(method, workers), "model": quick_model(method),
            "dataset": "synthetic", "seed": seed, "workers": workers, "backend": backend, "device": device,
            "output_dir": str(out_dir), "tracking": {"enabled": False},
            "train": {"epochs": epochs, "batch_size": 32 // workers if workers <= 32 else 1, "lr": 0.05,
                      "train_subset": 512, "test_subset": 256, "log_every": 4}, **extra}
