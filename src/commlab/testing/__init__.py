"""The test kit: what the tests (and a developer rehearsing by hand) use, never the shipped code.

* :func:`run_distributed`: run a function on several gloo ranks in separate processes
  (:func:`commlab.launch.ranks.run_ranks`, with this kit preloaded in the fork server);
* :func:`drive` (:mod:`.driver`): build a method and run its hooks exactly as the training loop
  does, on batches or on gradients a test chooses;
* :mod:`.jobs`: start, signal and reap whole ``commlab launch`` jobs; :mod:`.localslurm`: a SLURM
  cluster on this machine (``make slurm-up``).

Production code never imports this package (tests/test_architecture.py checks)::

    from commlab.testing import drive, run_distributed

    def body(rank, world):
        driven = drive("ssgd", None, model=torch.nn.Linear(4, 2), steps=3, train={"lr": 0.1},
                       grads=lambda step: [torch.full((2, 4), float(rank)), torch.zeros(2)])
        return driven.model.weight.grad          # the average over the ranks: 0.5 everywhere

    results = run_distributed(body, world_size=2)
"""

from __future__ import annotations

__all__ = ["Driven", "drive", "run_distributed", "set_grads"]

# Imported once by the ranks' fork server: torch, the core, and the driver (with the loop's step).
# torch._dynamo: torch.optim imports it on the first optimizer it builds (seconds of CPU per rank).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "commlab.core", "commlab.testing.driver")


def run_distributed(fn, world_size: int, args: tuple = (), timeout_s: float = 60.0, backend: str = "gloo",
                    device: str = "cpu") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return per-rank results (an
    exception on any rank is re-raised here with its traceback). gloo on the CPU unless ``backend``
    / ``device`` say otherwise: ``device="cuda"`` puts gloo ranks on the GPUs, NCCL needs a GPU per rank."""
    from commlab.launch.ranks import run_ranks

    return run_ranks(fn, world_size, args, timeout_s, preload=PRELOAD, backend=backend, device=device)


def __getattr__(name: str):
    # The driver imports torch and the loop: only when asked for (localslurm and jobs need neither).
    if name in ("Driven", "drive", "set_grads"):
        from commlab.testing import driver

        return getattr(driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
