"""The one training loop. Every method of every paper runs through it.

Launch (4 CPU workers, gloo)::

    torchrun --standalone --nproc-per-node 4 -m commlab train --config run.yaml train.epochs=1
    python -m commlab train --config run.yaml          # alone: a world of one worker

Each rank builds its data shard, model, optimizer and algorithm, then per step: forward, backward,
``algo.after_backward`` (gradient sync), optimizer step, ``algo.after_step`` (model sync). Rank 0
alone logs to MLflow and prints progress. Every ``train.log_every`` steps one small control
allreduce (outside the Communicator's accounting: it is instrumentation, not the method's traffic)
averages the loss, spreads a SIGTERM to every rank so all checkpoint at the same step, and stops
the run on a non-finite loss anywhere.

Resume and faults (docs/cluster.md): a checkpoint at every epoch end (and on SIGTERM) holds the
model, optimizer, algorithm state, communication counters, RNG states, data position, running
sums and the MLflow run id, per rank; launching the same config again continues from it, logging
to the same run, and ends with the parameters and metrics of an uninterrupted run. SIGTERM/SIGINT
exits with 143 (preempted, resumable) and marks the run KILLED; an error marks it FAILED.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from commlab.algorithms.base import AlgoContext, StepInfo, parse_options
from commlab.checkpoint import load_checkpoint, save_checkpoint
from commlab.core import CommStats, Communicator, init_runtime, seed_everything, shutdown_runtime
from commlab.core.runtime import name_worker_process
from commlab.data import load_dataset, shard_indices
from commlab.models import build_model
from commlab.optim import lr_at, set_lr
from commlab.registry import ALGORITHMS
from commlab.runstate import (
    EXIT_PREEMPTED,
    Preempted,
    Progress,
    StopSignal,
    check_fingerprint,
    fingerprint,
    rng_state,
    set_rng_state,
)

__all__ = ["EXIT_PREEMPTED", "train", "output_dir"]


class NonFiniteLoss(RuntimeError):
    pass


def output_dir(config: dict) -> Path:
    if config.get("output_dir"):
        return Path(config["output_dir"])
    return Path("results") / config["paper"] / (config.get("name") or config["method"]) / f"seed{config['seed']}"


@torch.no_grad()
def evaluate(model: torch.nn.Module, data, x: torch.Tensor, y: torch.Tensor, batch: int,
             device: torch.device) -> tuple[float, float]:
    """Test loss and accuracy (%) of ``model`` on ``(x, y)``."""
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for i in range(0, len(y), batch):
        xb = data.normalise(x[i:i + batch]).to(device)
        yb = y[i:i + batch].to(device)
        out = model(xb)
        loss_sum += F.cross_entropy(out, yb, reduction="sum").item()
        correct += (out.argmax(1) == yb).sum().item()
    model.train(was_training)
    return loss_sum / len(y), 100.0 * correct / len(y)


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random 4-pixel-padded crop and horizontal flip (the CIFAR recipe), per sample."""
    n, _, h, w = x.shape
    padded = F.pad(x, (4, 4, 4, 4))
    dx = torch.randint(0, 9, (n,), generator=gen)
    dy = torch.randint(0, 9, (n,), generator=gen)
    flip = torch.rand(n, generator=gen) < 0.5
    out = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    out[flip] = out[flip].flip(-1)
    return out


def train(config: dict, sentinel: str | Path | None = None) -> dict:
    """Run one experiment; return the final metrics (on every rank). A SIGTERM/SIGINT ends it
    with a checkpoint and ``SystemExit(EXIT_PREEMPTED)``; launching it again resumes it."""
    rt = init_runtime(config["backend"], config["timeout_s"])
    name_worker_process(rt.rank)
    stop = StopSignal()
    stop.install()
    try:
        torch.set_num_threads(config["threads"])
        seed_everything(config["seed"], rt.rank)
        return _run(config, rt, stop, sentinel)
    except Preempted:
        raise SystemExit(EXIT_PREEMPTED) from None
    except RuntimeError as err:
        if isinstance(err, dist.DistError) or any(k in str(err) for k in ("gloo", "NCCL", "Connection")):
            print(f"[commlab] rank {rt.rank}: a collective failed: a peer died, or stalled for more than "
                  f"timeout_s={config['timeout_s']} s ({str(err).splitlines()[0][:160]})", file=sys.stderr, flush=True)
        raise
    finally:
        stop.uninstall()
        shutdown_runtime()


def _run(config: dict, rt, stop: StopSignal, sentinel) -> dict:
    tcfg = config["train"]
    out = output_dir(config)
    ckpt_dir = out / "checkpoints"

    # ---- data: every rank loads the same tensors and takes its own slice of each batch --------
    data = load_dataset(config["dataset"], config["data_dir"], verify=config.get("verify_data", False))
    train_x, train_y = data.train_x, data.train_y
    if tcfg.get("train_subset"):
        train_x, train_y = train_x[: tcfg["train_subset"]], train_y[: tcfg["train_subset"]]
    test_x, test_y = data.test_x, data.test_y
    if tcfg.get("test_subset"):
        test_x, test_y = test_x[: tcfg["test_subset"]], test_y[: tcfg["test_subset"]]
    batch = tcfg["batch_size"]
    steps_per_epoch = len(train_y) // (rt.world_size * batch)
    if steps_per_epoch == 0:  # before anything is recorded: more workers than samples
        raise ValueError(f"{len(train_y)} training samples of {config['dataset']!r} cannot fill one step of "
                         f"{rt.world_size} workers x batch {batch}; lower workers or train.batch_size")
    total_steps = steps_per_epoch * tcfg["epochs"]
    if tcfg.get("max_steps"):
        total_steps = min(total_steps, tcfg["max_steps"])
    aug_gen = torch.Generator().manual_seed(config["seed"] * 7919 + rt.rank)

    # ---- model, communicator, algorithm, optimizer ----------------------------------------------
    spec = data.spec
    model = build_model(config["model"], spec.channels, spec.num_classes, spec.image_size).to(rt.device)
    comm = Communicator(stats=CommStats())
    algo_cls = ALGORITHMS.get(config["method"])
    options = parse_options(algo_cls.Options, config.get("method_params"))
    ctx = AlgoContext(rt, tcfg, config["seed"], steps_per_epoch, total_steps,
                      extras={"workers_per_node": config["workers"]})
    algo = algo_cls(model, comm, options, ctx)
    optimizer = algo.optimizer = algo.build_optimizer()
    algo.setup()

    # ---- resume: everything a step depends on comes back from this rank's checkpoint -----------
    p = Progress()
    state = load_checkpoint(ckpt_dir, rt.rank, rt.world_size)
    if state is not None:
        check_fingerprint(state.get("fingerprint"), config, str(ckpt_dir))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        algo.load_state_dict(state["algorithm"])
        comm.stats.load_state_dict(state["stats"])
        set_rng_state(state["rng"])
        aug_gen.set_state(state["aug_rng"])
        p = Progress.from_state(state["progress"])
        if rt.is_main:
            print(f"[commlab] resuming from the checkpoint at step {p.step} (epoch {p.epoch})"
                  + (f", torchrun restart {rt.restart}" if rt.restart else ""), file=sys.stderr, flush=True)
        if p.done and p.step != total_steps:
            raise ValueError(f"the run in {out} finished after {p.step} steps but the config now asks for "
                             f"{total_steps}; use another output_dir for a longer run")

    # MLflow gets every method option, the defaults included, so that runs compare on all of them.
    logged_config = {**config, "method_params": dataclasses.asdict(options)}
    if config["tracking"].get("enabled", True) and rt.world_size > 1:
        # Every rank learns the run id, so that rank 1 can mark the run FAILED if rank 0 dies. The
        # others wait for rank 0's MLflow set-up on a group of their own with a generous timeout:
        # a slow tracking server is not a dead peer.
        waiting = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(600.0, config["timeout_s"])))
        tracker = _open_tracker(logged_config, rt, data, p.run_id)
        box = [tracker.run_id if tracker else None]
        dist.broadcast_object_list(box, src=0, group=waiting)
        p.run_id = box[0]
    else:
        tracker = _open_tracker(logged_config, rt, data, p.run_id)

    t_start = time.perf_counter()

    def checkpoint() -> None:
        save_checkpoint(ckpt_dir, p.step, rt.rank, rt.world_size, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "algorithm": algo.state_dict(), "stats": comm.stats.state_dict(), "rng": rng_state(),
            "aug_rng": aug_gen.get_state(), "fingerprint": fingerprint(config),
            "progress": {**p.state_dict(), "wall_s": p.wall_s + time.perf_counter() - t_start},
        })

    def end_epoch() -> None:
        p.epoch, p.pos = p.epoch + 1, 0
        test_loss, test_acc = _evaluate_on_main(algo, data, test_x, test_y, tcfg, rt)
        p.final.update(test_loss=test_loss, test_accuracy=test_acc, epoch=p.epoch)
        if tracker:
            tracker.log_metrics({"test_loss": test_loss, "test_accuracy": test_acc}, p.step)
            tracker.flush()
        every = tcfg.get("checkpoint_every_epochs", 1)
        if every and p.epoch % every == 0 and p.step < total_steps:
            checkpoint()

    # ---- the loop ------------------------------------------------------------------------------
    log_every = tcfg["log_every"]
    delay = float(os.environ.get("COMMLAB_STEP_DELAY_S", 0))  # fault tests: time to signal mid-epoch
    bar = tqdm(total=total_steps, initial=p.step, disable=not rt.is_main, desc=config.get("name") or config["method"],
               unit="step", dynamic_ncols=True, mininterval=2.0)
    status = "FAILED"
    try:
        # A checkpoint taken on SIGTERM at an epoch's last step resumes with pos == steps_per_epoch:
        # the epoch's evaluation is still due.
        while p.step < total_steps or p.pos == steps_per_epoch:
            if p.pos == steps_per_epoch:
                end_epoch()
                continue
            batches = shard_indices(len(train_y), rt.world_size, rt.rank, batch, p.epoch, config["seed"])
            while p.pos < steps_per_epoch and p.step < total_steps:
                idx = batches[p.pos]
                xb = train_x[idx]
                if spec.augment:
                    xb = augment(xb, aug_gen)
                xb, yb = data.normalise(xb).to(rt.device), train_y[idx].to(rt.device)
                lr = lr_at(p.step, steps_per_epoch, total_steps, tcfg)
                set_lr(optimizer, lr)
                info = StepInfo(p.step, p.epoch, lr)

                t0 = time.perf_counter()
                comm0 = comm.stats.counters["comm_seconds"] + comm.stats.counters["blocked_seconds"]
                optimizer.zero_grad(set_to_none=False)
                loss = F.cross_entropy(algo.forward_model(xb), yb)
                loss.backward()
                algo.after_backward(info)
                if tcfg.get("grad_clip"):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg["grad_clip"])
                optimizer.step()
                algo.after_step(info)
                # Compute is the step minus the time in collectives and in waits for asynchronous ones.
                comm1 = comm.stats.counters["comm_seconds"] + comm.stats.counters["blocked_seconds"]
                p.compute_s += (time.perf_counter() - t0) - (comm1 - comm0)

                loss_value = loss.item()
                p.window_loss += loss_value if math.isfinite(loss_value) else float("inf")
                p.window_n += 1
                p.step += 1
                p.pos += 1
                bar.update(1)
                if delay:
                    time.sleep(delay)

                if p.step % log_every == 0 or p.step == total_steps:
                    mean_loss, stop_now, bad = _control(p.window_loss, p.window_n, stop.requested, rt)
                    if bad:
                        raise NonFiniteLoss(
                            f"non-finite training loss at step {p.step} (epoch {p.epoch}) on {bad} rank(s); "
                            f"lower train.lr or enable train.grad_clip")
                    metrics = _step_metrics(comm.stats.totals(), algo.metrics(), mean_loss, lr, p.step, p.epoch,
                                            p.step * rt.world_size * batch, p.compute_s,
                                            p.wall_s + time.perf_counter() - t_start)
                    p.final.update(metrics)
                    if tracker:
                        tracker.log_metrics(metrics, p.step)
                    if config.get("golden"):
                        p.golden.append({"step": p.step, "train_loss": round(mean_loss, 6)})
                    bar.set_postfix(loss=f"{mean_loss:.4f}")
                    p.window_loss, p.window_n = 0.0, 0
                    if stop_now:
                        if tracker:
                            tracker.flush()
                        checkpoint()
                        status = "KILLED"
                        raise Preempted()
        if not p.done:
            algo.finish()
            if p.pos != 0 or "test_accuracy" not in p.final:  # stopped by max_steps mid-epoch
                test_loss, test_acc = _evaluate_on_main(algo, data, test_x, test_y, tcfg, rt)
                p.final.update(test_loss=test_loss, test_accuracy=test_acc)
                if tracker:
                    tracker.log_metrics({"test_loss": test_loss, "test_accuracy": test_acc}, p.step)
            p.done = True
            checkpoint()
        bar.close()
        status = "FINISHED"
        if rt.is_main:
            _write_outputs(config, out, sentinel, tracker, p.final, p.golden, data, ckpt_dir)
        return p.final
    finally:
        bar.close()
        _close_run(tracker, status, p.run_id, rt, config)


def _open_tracker(config: dict, rt, data, run_id: str | None):
    """Rank 0's MLflow run: the checkpoint's run reopened, or a new one."""
    if not rt.is_main or not config["tracking"].get("enabled", True):
        return None
    from commlab.tracking import RunTracker, git_commit

    tags = {"paper": config["paper"], "method": config["method"],
            "name": config.get("name") or config["method"], "seed": str(config["seed"]),
            "workers": str(rt.world_size), "backend": rt.backend, "git_commit": git_commit(),
            "data_hash": str(data.meta.get("content_hash")), "model": config["model"],
            "dataset": config["dataset"]}
    # Under an emulated network the launcher passes the link's settings and its measured
    # throughput (commlab.netem): they are params of the run, next to the config.
    network = json.loads(os.environ.get("COMMLAB_NETWORK_JSON") or "{}")
    if network:
        tags["network"] = str(network.get("network_label", network.get("network_bandwidth_mbit")))
    return RunTracker({**config, **network}, tags, run_id=run_id)


def _close_run(tracker, status: str, run_id: str | None, rt, config: dict) -> None:
    """Set the run's final status; never masks the error that ended the run.

    Rank 0 marks its run. When rank 0 died, nobody else would: rank 1 marks a failed run FAILED
    too (a no-op when rank 0 already did)."""
    try:
        if tracker:
            tracker.finish(status)
        elif status == "FAILED" and rt.rank == 1 and run_id:
            from commlab.tracking import mark_failed

            mark_failed(run_id, config["tracking"].get("uri"))
    except Exception as err:  # noqa: BLE001 - never mask the original error
        print(f"[commlab] rank {rt.rank}: could not mark the MLflow run {run_id} {status}: {err}",
              file=sys.stderr, flush=True)


def _control(window_loss: float, window_n: int, stop_requested: bool, rt) -> tuple[float, bool, int]:
    """One tiny allreduce: global mean loss, whether any rank was asked to stop, non-finite count."""
    finite = math.isfinite(window_loss)
    t = torch.tensor([window_loss if finite else 0.0, window_n, float(stop_requested), float(not finite)],
                     dtype=torch.float64, device=rt.device if rt.backend == "nccl" else "cpu")
    if rt.world_size > 1:
        dist.all_reduce(t)
    return t[0].item() / max(1.0, t[1].item()), t[2].item() > 0, int(t[3].item())


def _evaluate_on_main(algo, data, test_x, test_y, tcfg, rt) -> tuple[float, float]:
    """Test loss and accuracy of rank 0's evaluation model, computed by all ranks together.

    Replicas can differ (local SGD), so rank 0's parameters and buffers are broadcast into a
    copy on every rank, each rank scores its slice of the test set, and the sums are added.
    This traffic is evaluation, not the method's: it bypasses the Communicator."""
    model = algo.eval_model
    if rt.world_size > 1:
        model = copy.deepcopy(model)
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
    part = torch.arange(rt.rank, len(test_y), rt.world_size)
    loss, acc = evaluate(model, data, test_x[part], test_y[part], tcfg["eval_batch_size"], rt.device)
    sums = torch.tensor([loss * len(part), acc * len(part), len(part)], dtype=torch.float64,
                        device=rt.device if rt.backend == "nccl" else "cpu")
    if rt.world_size > 1:
        dist.all_reduce(sums)
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()


def _step_metrics(totals: dict, extra: dict, loss: float, lr: float, step: int, epoch: int,
                  samples: int, compute_s: float, wall_s: float) -> dict:
    metrics = {"train_loss": loss, "lr": lr, "epoch": epoch, "samples": samples,
               "compute_seconds": compute_s, "wall_seconds": wall_s}
    metrics.update({k: v for k, v in totals.items()})
    metrics.update({f"algo_{k}": v for k, v in extra.items()})
    return metrics


def _write_outputs(config, out: Path, sentinel, tracker, final, golden, data, ckpt_dir) -> None:
    from commlab.config import dump_config
    from commlab.tracking import git_commit

    out.mkdir(parents=True, exist_ok=True)
    dump_config(config, out / "config.yaml")
    if config.get("golden"):
        Path(config["golden"]).parent.mkdir(parents=True, exist_ok=True)
        Path(config["golden"]).write_text(json.dumps(golden, indent=1) + "\n")
    if tracker:
        tracker.log_artifact(out / "config.yaml")
        tracker.log_artifact(ckpt_dir / "latest.json", "checkpoint")
        for f in sorted(ckpt_dir.glob("step_*/rank0.pt")):
            tracker.log_artifact(f, "checkpoint")
        if (out / "train.log").exists():
            tracker.log_artifact(out / "train.log")
    record = {
        "run_id": tracker.run_id if tracker else None,
        "experiment": config["tracking"].get("experiment") or config["paper"],
        "paper": config["paper"], "name": config.get("name") or config["method"],
        "method": config["method"], "seed": config["seed"], "workers": dist.get_world_size(),
        "git_commit": git_commit(), "data_hash": data.meta.get("content_hash"),
        "final": {k: final[k] for k in ("train_loss", "test_loss", "test_accuracy", "bytes_sent",
                                         "reductions_global", "wall_seconds") if k in final},
    }
    target = Path(sentinel) if sentinel else out / "sentinel.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, target)
