"""Runs through the training loop's own pieces inside a test's gloo ranks (as ``commlab.loop.train``
runs them, in the rank's existing process group): the run configs the workload tests build and
the function each rank runs."""

from __future__ import annotations

from pathlib import Path

import torch

from commlab.config import load_config


def run_config(data_dir: Path, out: Path, name: str, dataset: str, model: str, batch: int, workers: int = 2,
               **extra) -> dict:
    """A run config on ``data_dir``'s prepared data: gloo, MLflow off, one epoch, a log point every
    step and the loss curve kept; ``extra`` are ``dotted.key: value`` overrides."""
    overrides = [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, [f"dataset={dataset}", f"model={model}", f"data_dir={data_dir}", f"workers={workers}",
                              "backend=gloo", "seed=3", "tracking.enabled=false", f"output_dir={out / name}",
                              f"golden={out / name}.json", f"train.batch_size={batch}", "train.lr=0.05",
                              "train.epochs=1", "train.log_every=1", *overrides])


def run(config: dict, stop_at: int | None = None, keep=None):
    """One run; ``stop_at``: stop there as a SIGTERM would, checkpointing at the next log point
    (returns the step and position then). Otherwise returns the final metrics, this rank's
    parameters, the loss curve and ``keep(run)`` (what a test wants of the finished run)."""
    from commlab.core import init_runtime, seed_everything
    from commlab.loop.loop import Run, steps
    from commlab.loop.precision import configure_tf32
    from commlab.loop.runstate import Preempted, StopSignal

    rt = init_runtime("gloo", device=config["device"])
    seed_everything(config["seed"], rt.rank)
    configure_tf32(config["train"])
    loop, stop = Run(config, rt), StopSignal()
    if stop_at is not None:
        step = loop.step

        def stepping(batch):
            step(batch)
            stop.requested = loop.progress.step >= stop_at

        loop.step = stepping
    try:
        steps(loop, stop)
        loop.finish()
    except Preempted:
        return loop.progress.step, loop.progress.pos
    finally:
        loop.logger.close("FINISHED")
    params = {k: v.detach().clone() for k, v in loop.model.named_parameters()}
    progress = loop.progress
    return {**progress.final, "step": progress.step}, params, progress.golden, keep(loop) if keep else None


def runs(rank: int, world: int, configs: list[dict]) -> list:
    """Every config in turn on this rank (imports and the process group paid once)."""
    return [run(c) for c in configs]


def replicas_equal(results) -> None:
    """Rank 1's parameters equal rank 0's, bit for bit."""
    for key, value in results[0][1].items():
        assert torch.equal(results[1][1][key], value), key
