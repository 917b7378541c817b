"""The one training loop. Every method of every paper runs through it.

Launch (4 CPU workers, gloo)::

    torchrun --standalone --nproc-per-node 4 -m commlab.loop --config run.yaml train.epochs=1
    python -m commlab train --config run.yaml          # alone: a world of one worker

Read top to bottom: :func:`train` sets the process up; :class:`Run` builds a rank's data shard,
model, method (with the optimizer it declares: :mod:`.method`) and logger (resuming from the
rank's checkpoint when there is one); :func:`steps` is the step loop. A step
(:func:`~commlab.loop.method.take_step`) is forward, backward, ``algo.after_backward`` (gradient
sync), clipping, optimizer step, ``algo.after_step`` (model sync). Every ``train.log_every``
steps a log point runs on every rank: one small allreduce on the control channel (outside the
Communicator's accounting: it is instrumentation, not the method's traffic) averages the loss
(summed on the device step by step and read by the host only there: docs/performance.md),
spreads a SIGTERM to every rank so all checkpoint at the same step, and stops the run on a
non-finite loss anywhere; then the run's device clock is read (:mod:`.timing`: on CUDA the
collectives', selections' and steps' event pairs of the window, one wait for the device), the
method's ``metrics()`` (on every rank: a method may reduce there) and rank 0's log.

Resume and faults (docs/cluster.md): a checkpoint at every epoch end (and on SIGTERM) holds the
model, optimizer, algorithm state, communication counters, RNG states, data position, the task's
carried state (an LSTM's hidden state), running sums and the MLflow run id, per rank; launching
the same config again continues from it, logging to the same run, and ends with the parameters and
metrics of an uninterrupted run. SIGTERM/SIGINT exits with 143 (preempted, resumable) and marks the
run KILLED; an error marks it FAILED.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time

import torch
import torch.distributed as dist

from commlab import timeline
from commlab.algorithms.base import StepInfo
from commlab.config import run_dir
from commlab.core import (
    CommStats,
    Communicator,
    ControlChannel,
    DeviceClock,
    init_runtime,
    seed_everything,
    shutdown_runtime,
)
from commlab.core.runtime import seed_per_rank
from commlab.loop.checkpoint import load_checkpoint, save_checkpoint
from commlab.loop.display import ProgressDisplay
from commlab.loop.evaluation import evaluate_on_main
from commlab.loop.logger import open_logger
from commlab.loop.method import build_method, take_step
from commlab.loop.metrics import NonFiniteLoss, control, step_metrics
from commlab.loop.optim import lr_at
from commlab.loop.outputs import write_outputs
from commlab.loop.precision import autocast, configure_tf32
from commlab.loop.runstate import (
    EXIT_PREEMPTED,
    Preempted,
    Progress,
    StopSignal,
    check_fingerprint,
    fingerprint,
    rng_state,
    set_rng_state,
)
from commlab.loop.tasks import build_task
from commlab.loop.timing import StepTimer
from commlab.models import build_model
from commlab.tracking import RunFacts

__all__ = ["EXIT_PREEMPTED", "Run", "add_loss", "mid_epoch_evaluations", "steps", "train"]


def train(config: dict, sentinel=None, options=None, tracking_relay: str | None = None) -> dict:
    """Run one experiment; return the final metrics (on every rank). ``options`` are the method's
    parsed Options (parsed here when not given); ``tracking_relay``: the launcher's relay that
    makes rank 0's MLflow calls (:mod:`commlab.tracking_relay`). A SIGTERM/SIGINT ends the run
    with a checkpoint and ``SystemExit(EXIT_PREEMPTED)``; launching it again resumes it."""
    with timeline.phase("process_group"):
        runtime = init_runtime(config["backend"], config["timeout_s"], config["device"])
    if runtime.note and runtime.is_main:
        print(f"[commlab] {runtime.note}", file=sys.stderr, flush=True)
    stop = StopSignal()
    stop.install()
    try:
        torch.set_num_threads(config["threads"])
        seed_everything(config["seed"], runtime.rank)
        configure_tf32(config["train"])
        run = Run(config, runtime, options, tracking_relay)
        status = "FAILED"
        try:
            with timeline.phase("steps"):
                steps(run, stop)
                run.finish()
            status = "FINISHED"
            if runtime.is_main:
                with timeline.phase("outputs"):
                    write_outputs(config, run.out, sentinel, run.logger, run.progress.final, run.progress.golden,
                                  run.data.meta, run.ckpt_dir, runtime.world_size)
            return run.progress.final
        except Preempted:
            status = "KILLED"
            raise
        finally:
            run.display.close()
            run.logger.close(status)
            if runtime.is_main:
                timeline.write_rank0(run.out)  # for the launcher: timeline.json beside the run
    except Preempted:
        raise SystemExit(EXIT_PREEMPTED) from None
    except RuntimeError as err:
        if isinstance(err, dist.DistError) or any(word in str(err) for word in ("gloo", "NCCL", "Connection")):
            print(f"[commlab] rank {runtime.rank}: a collective failed: a peer died, or stalled for more than "
                  f"timeout_s={config['timeout_s']} s ({str(err).splitlines()[0][:160]})", file=sys.stderr, flush=True)
        raise
    finally:
        stop.uninstall()
        shutdown_runtime()


def steps(run: Run, stop: StopSignal) -> None:
    """The step loop: every step of the run, an evaluation (and checkpoint) at each epoch end and
    at the epoch's other ``train.evals_per_epoch`` points, a log point every ``train.log_every``
    steps; all ranks agree there to stop on a SIGTERM."""
    progress, data = run.progress, run.data
    within = mid_epoch_evaluations(data.steps_per_epoch, run.train_config.get("evals_per_epoch", 1))
    # A checkpoint taken on SIGTERM at an epoch's last step resumes with pos == steps_per_epoch:
    # the epoch's evaluation is still due.
    while progress.step < data.total_steps or progress.pos == data.steps_per_epoch:
        if progress.pos == data.steps_per_epoch:
            run.end_epoch()
            continue
        with contextlib.closing(data.batches(progress.epoch, progress.pos)) as batches:  # closed: loader workers stop
            while progress.pos < data.steps_per_epoch and progress.step < data.total_steps:
                run.step(next(batches))
                if progress.pos in within and progress.step < data.total_steps:
                    run.evaluate()  # before the log point: a checkpoint taken there follows it
                at_log_point = progress.step % run.log_every == 0 or progress.step == data.total_steps
                if at_log_point and run.log_point(stop.requested):
                    raise Preempted()


def mid_epoch_evaluations(steps_per_epoch: int, per_epoch: int) -> set[int]:
    """The positions within an epoch (steps taken in it) after which an evaluation runs besides the
    epoch's end: ``per_epoch`` evenly spaced points, the last being the end itself."""
    return {round(i * steps_per_epoch / per_epoch) for i in range(1, per_epoch)} - {0, steps_per_epoch}


def add_loss(window: torch.Tensor, loss: torch.Tensor) -> None:
    """Add a step's loss to the log window, on the device (no host read): a non-finite loss makes
    the window infinite, which the log point reports as a non-finite loss."""
    loss = loss.detach().to(window.dtype)
    window.add_(torch.where(torch.isfinite(loss), loss, torch.full_like(loss, math.inf)))


class Run:
    """One rank's experiment: what a step needs, and the step, log point, epoch end and finish.
    ``p`` is the run's :class:`~commlab.loop.runstate.Progress` (step, position, running sums)."""

    def __init__(self, config: dict, runtime, options=None, tracking_relay: str | None = None):
        self.config, self.runtime, self.train_config = config, runtime, config["train"]
        self.out = run_dir(config)
        self.ckpt_dir = self.out / "checkpoints"
        self.log_every = self.train_config["log_every"]
        self.step_delay_s = float((config.get("testing") or {}).get("step_delay_s", 0))
        # The run's task (commlab.loop.tasks): its data on this rank, loss and test metrics.
        with timeline.phase("data"):
            self.data = data = build_task(config, runtime)
        with timeline.phase("build"):
            self._build(options)

        self.progress = Progress()
        with timeline.phase("checkpoints"):
            self.resume()
        # The loss window lives on the device: the host reads it at log points and checkpoints
        # only (a per-step read would make the host wait for every step's kernels).
        self.loss_window = torch.full((), self.progress.window_loss, dtype=torch.float64, device=runtime.device)
        with timeline.phase("mlflow"):
            self.logger = open_logger(config, self.facts(), runtime, self.progress.run_id, tracking_relay)
        self.progress.run_id = self.logger.run_id
        self.display = ProgressDisplay(data.total_steps, self.progress.step, config.get("name") or config["method"],
                                       enabled=runtime.is_main)
        self.lr = 0.0
        self.t_start = time.perf_counter()

    def _build(self, options) -> None:
        """The model, the clock and Communicator, the method with its optimizer."""
        config, runtime, data = self.config, self.runtime, self.data
        self.model = build_model(config["model"], **data.model_inputs(), **config["model_options"]).to(runtime.device)
        # One device clock times the collectives, the method's pieces and the steps; its pending
        # intervals (CUDA events) are read at log points and checkpoints.
        self.clock = DeviceClock()
        self.comm = Communicator(stats=CommStats(), clock=self.clock)
        self.timer = StepTimer(self.clock, self.comm.stats, runtime.device)
        self.control = ControlChannel()  # the log point's allreduce: instrumentation, not counted
        self.algo = build_method(config["method"], self.model, self.comm,
                                 config.get("method_params") if options is None else options,
                                 runtime=runtime, train=self.train_config, seed=config["seed"],
                                 steps_per_epoch=data.steps_per_epoch, total_steps=data.total_steps,
                                 workers_per_node=config["workers"], clock=self.clock, control=self.control)
        # The model was initialised from the shared seed; from here each rank draws its own dropout masks.
        seed_per_rank(config["seed"], runtime.rank)

    def resume(self) -> None:
        """Everything a step depends on comes back from this rank's checkpoint, if there is one."""
        state = load_checkpoint(self.ckpt_dir, self.runtime.rank, self.runtime.world_size)
        if state is None:
            return
        check_fingerprint(state.get("fingerprint"), self.config, str(self.ckpt_dir))
        self.model.load_state_dict(state["model"])
        self.algo.optimizer.load_state_dict(state["optimizer"])
        self.algo.load_state_dict(state["algorithm"])
        self.comm.stats.load_state_dict(state["stats"])
        set_rng_state(state["rng"], self.runtime.device)
        self.data.load_state_dict(state.get("task", {}))
        progress = self.progress = Progress.from_state(state["progress"])
        if self.runtime.is_main:
            print(f"[commlab] resuming from the checkpoint at step {progress.step} (epoch {progress.epoch})"
                  + (f", torchrun restart {self.runtime.restart}" if self.runtime.restart else ""),
                  file=sys.stderr, flush=True)
        if progress.done and progress.step != self.data.total_steps:
            raise ValueError(f"the run in {self.out} finished after {progress.step} steps but the config now asks for "
                             f"{self.data.total_steps}; use another output_dir for a longer run")

    def facts(self) -> RunFacts:
        """What this rank learnt building the run, recorded in MLflow beside the config
        (:func:`commlab.tracking.run_params`, :func:`commlab.tracking.run_tags`)."""
        return RunFacts(workers=self.runtime.world_size, backend=self.runtime.backend,
                        data_hash=self.data.meta.get("content_hash"),
                        method_options=dataclasses.asdict(self.algo.options),
                        method_settings=self.algo.run_params(),
                        model_parameters=sum(t.numel() for t in self.model.parameters()),
                        test_samples=getattr(self.data, "test_samples", None))

    def step(self, batch) -> None:
        """One optimizer step on this rank's ``batch`` (the task's, on the device)."""
        progress = self.progress
        self.lr = lr_at(progress.step, self.data.steps_per_epoch, self.data.total_steps, self.train_config)

        # Compute is the step minus the time in collectives and in waits for asynchronous ones,
        # on the device clock (settled into progress.compute_s at log points and checkpoints).
        with self.timer.step():
            loss = take_step(self.algo, StepInfo(progress.step, progress.epoch, self.lr),
                             lambda: self._backward(batch))

        add_loss(self.loss_window, loss)
        progress.window_n += 1
        progress.step += 1
        progress.pos += 1
        self.display.update()
        if self.step_delay_s:  # testing.step_delay_s: time for a test to signal mid-epoch
            time.sleep(self.step_delay_s)

    def _backward(self, batch) -> torch.Tensor:
        """The task's loss of ``batch`` through the method's forward model (in ``train.precision``:
        :mod:`.precision`), backpropagated."""
        with autocast(self.train_config, self.runtime.device):
            loss = self.data.loss(self.algo.forward_model, batch)
        loss.backward()
        return loss

    def log_point(self, stop_requested: bool) -> bool:
        """Every rank: the control allreduce, the method's metrics, rank 0's log. Returns whether
        all ranks stop now (a SIGTERM reached one of them); the checkpoint is then written."""
        with timeline.phase("log_points"):
            return self._log_point(stop_requested)

    def _log_point(self, stop_requested: bool) -> bool:
        progress = self.progress
        progress.window_loss = float(self.loss_window)
        mean_loss, stop_now, bad_ranks = control(progress.window_loss, progress.window_n, stop_requested,
                                                 self.control)
        if bad_ranks:
            raise NonFiniteLoss(f"non-finite training loss at step {progress.step} (epoch {progress.epoch}) on "
                                f"{bad_ranks} rank(s); lower train.lr or enable train.grad_clip")
        progress.compute_s += self.timer.settle()  # reads the device clock: every figure below is complete
        samples = progress.step * self.runtime.world_size * self.data.batch_size
        metrics = step_metrics(self.comm.stats.totals(), self.algo.metrics(), mean_loss, self.lr, progress.step,
                               progress.epoch, samples, progress.compute_s, self.wall_s())
        progress.final.update(metrics)
        self.logger.log_metrics(metrics, progress.step)
        for step, values in self.algo.sync_events():
            self.logger.log_metrics({f"algo_sync_{name}": value for name, value in values.items()}, step)
        if self.config.get("golden"):
            progress.golden.append({"step": progress.step, "train_loss": round(mean_loss, 6)})
        self.display.show_loss(mean_loss)
        progress.window_loss, progress.window_n = 0.0, 0
        self.loss_window.zero_()
        if stop_now:
            self.logger.flush()
            self.checkpoint()
        return stop_now

    def end_epoch(self) -> None:
        progress = self.progress
        progress.epoch, progress.pos = progress.epoch + 1, 0
        self.evaluate()
        progress.final["epoch"] = progress.epoch
        self.logger.flush()
        every = self.train_config.get("checkpoint_every_epochs", 1)
        if every and progress.epoch % every == 0 and progress.step < self.data.total_steps:
            self.checkpoint()

    def finish(self) -> None:
        """The method's last word, a final evaluation unless an epoch end just did one, the last
        checkpoint (a re-launch of a finished run only rewrites its outputs)."""
        progress = self.progress
        if progress.done:
            return
        self.algo.finish()
        if progress.pos != 0 or "test_loss" not in progress.final:  # stopped by max_steps mid-epoch
            self.evaluate()
        progress.done = True
        self.checkpoint()

    def evaluate(self) -> None:
        with timeline.phase("evaluation"):
            metrics = evaluate_on_main(self.algo, self.data, self.runtime)
        self.progress.final.update(metrics)
        self.logger.log_metrics(metrics, self.progress.step)

    def wall_s(self) -> float:
        return self.progress.wall_s + time.perf_counter() - self.t_start

    def checkpoint(self) -> None:
        with timeline.phase("checkpoints"):
            self._checkpoint()

    def _checkpoint(self) -> None:
        self.progress.compute_s += self.timer.settle()
        self.progress.window_loss = float(self.loss_window)
        save_checkpoint(self.ckpt_dir, self.progress.step, self.runtime.rank, self.runtime.world_size, {
            "model": self.model.state_dict(), "optimizer": self.algo.optimizer.state_dict(),
            "algorithm": self.algo.state_dict(), "stats": self.comm.stats.state_dict(),
            "rng": rng_state(self.runtime.device), "task": self.data.state_dict(),
            "fingerprint": fingerprint(self.config),
            "progress": {**self.progress.state_dict(), "wall_s": self.wall_s()},
        })
