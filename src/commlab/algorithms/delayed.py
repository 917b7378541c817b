"""The delayed-update replicas of OD-SGD and SSD-SGD: a synchronous global update delayed behind local
compensation steps (Xu et al., arXiv 2005.06728 and 2012.05396). The methods themselves are
``odsgd`` (:mod:`commlab.algorithms.odsgd`, k = 1) and ``ssdsgd`` (:mod:`commlab.algorithms.ssdsgd`).

The released systems run the global update on an MXNet parameter server. Without a server, every
rank keeps two replicas:

* the **global replica** (``eval_model``): updated every step by synchronous SGD (the run's
  optimizer and learning rate) on the allreduce-averaged gradient. The allreduce is launched with
  ``comm.all_reduce_async`` right after backward and waited only when its result is needed, so it
  overlaps the following steps' compute. Every rank applies the same averaged gradients in the
  same order, so the global replicas are identical on every rank.
* the **local replica** (the model the loop trains): forward/backward run on it, and the loop's
  optimizer moves it with the worker's *own* gradient through a local rule
  (:mod:`commlab.algorithms.local_compensation`: plain, DC-ASGD or GLU, with their formulas and
  sources) at ``local_lr_scale`` times the run's learning rate: the method declares that
  optimizer (SGD with ``local_momentum``, the run's weight decay and ``lr_scale =
  local_lr_scale``) and the loop builds and steps it. GLU as released instead overwrites the
  local replica with its kernel's output at that local rate, and the loop's optimizer skips the
  step. The global replica's optimizer is the run's, built with the context's builder
  (``ctx.build_optimizer``).

The local step size. The released scripts pass ``--lr-local`` = 4 x ``--lr``, but the release's
local optimizer is given the gradient divided by batch x workers (``rescale_grad``, SSD-SGD
``python/mxnet/module/module.py:511-530``): its step on the worker's mean gradient is
``lr_local / N``, 1x the global rate at N = 4. ``local_rescale: release`` divides the local
direction by the number of workers (not the weight decay), so the scripts' values give the
release's step; ``local_rescale: mean`` (default) applies ``local_lr_scale`` to the mean gradient.

Every ``k`` steps (``odsgd``: k = 1, ``ssdsgd``: k = 5 by default) the local replica is overwritten
by the latest global replica *before* the local step, so at a refresh step ``t``::

    launch allreduce A_t of g_t                      # g_t computed on the local replica
    wait A_j for all j < t, apply them in order      # global replica now holds t updates: w^g_t
    w^l <- w^g_t                                     # refresh
    w^l <- w^l - local_lr * d(g_t)                   # local compensation (the loop's step)

and between refreshes only the launch and the local step happen. The one wait per period is for
A_{t-1}, launched a step earlier, so a collective slower than a step of compute does not block
as long as the k collectives of a period fit in k steps of compute. OD-SGD with a zero local
learning rate is thus exactly SSGD with a one-step-delayed gradient:
``w^g_{t+1} = opt(w^g_t, avg_i grad_i(w^g_{t-1}))``.

The local learning rate follows the run's schedule (``local_lr_scale`` times it) unless
``local_lr`` is given: the released scripts' ``--lr-local`` on steps of its own
(``--lr-step-epochs-local``: ``local_milestones``, times ``local_gamma`` at each), which the method
applies by scaling the local direction (weight decay included) to that rate, so it needs
``local_momentum: 0``, as the releases run.

The first ``warmup_steps`` steps are plain SSGD (blocking allreduce, same buckets and arithmetic
as ``ssgd``); both replicas are then equal. BatchNorm running statistics are local: the global
replica is evaluated with this rank's buffers (rank 0's in the loop's evaluation), as ``ssgd``.

Deviation from the released code, by design: the refreshed global replica is the newest one that
does not need the collective launched in the same step (the server pull of the released code may
return an older version); which version is used is deterministic, so runs are reproducible. The
release's refresh pull (``src/kvstore/kvstore_dist.h:300-330``, at iterations ``t % 5 == 4``)
hands the devices the local copy before it is overwritten, and its local step
(``kvstore_dist.h:423-433``) runs before the push, so the global weights reach the devices one
iteration later, moved by one local step with a gradient taken on the old copy: the order here,
one iteration later.

Per-step metrics (``algo_``): ``warmup``, ``staleness`` (global updates the gradient's base
weights lack), ``staleness_mean``, ``refreshes``, ``refresh_distance`` (L2 distance between the
local and global replicas just before a refresh, and its mean), ``overlapped_seconds`` (time the
async collectives were in flight before their wait was called, on the device clock: device time
on CUDA), ``in_flight``, ``global_version``. Time blocked in waits is the Communicator's
``blocked_seconds``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch

from commlab.algorithms.base import Algorithm, OptimizerSettings, StepInfo
from commlab.algorithms.local_compensation import GLU_READINGS, LOCAL_RULES, build_rule
from commlab.algorithms.tensors import flatten, grad_buckets, restore_into, unflatten_into
from commlab.core.clock import Span
from commlab.core.communicator import Pending

# Where GLU's "latest global gradient" comes from: the global replica's latest update divided by
# its learning rate (momentum included; what a parameter-server worker sees from two successive
# pulls, as the released code's weight-difference term), or the latest averaged gradient.
GLU_SOURCES = ("update", "gradient")
# What the local rule is given: the worker's mean gradient, or that over the number of workers (the
# release's local optimizer rescales the gradient by 1 / (batch x workers)).
LOCAL_RESCALES = ("mean", "release")


@dataclass
class DelayedOptions:
    """Options shared by ``odsgd`` and ``ssdsgd``."""

    warmup_steps: int = 200  # synchronous SSGD steps at the start (released code: 200 OD, 500 SSD)
    local_optimizer: str = "dcasgd"  # local rule: sgd | dcasgd | glu
    local_lr_scale: float = 4.0  # local learning rate = this x the run's (scheduled) learning rate
    local_momentum: float = 0.0  # momentum of the local optimizer (launch scripts: 0)
    dc_lambda: float = 2.0  # dcasgd: lambda (DC-ASGD-a's lambda_0 when dc_adaptive)
    dc_adaptive: bool = True  # dcasgd: divide lambda by the root mean square of the gradient
    dc_ms_decay: float = 0.95  # dcasgd: decay of that mean square
    glu_weight: float = 0.5  # glu: weight of the latest global gradient in the local direction
    glu_source: str = "gradient"  # glu: gradient (latest average) | update (latest global step / its lr)
    # glu: described (our hypothesis: a local step with the global gradient) | released (the release's
    # kernel output written over the local replica; see commlab.algorithms.local_compensation)
    glu_reading: str = "described"
    local_rescale: str = "mean"  # mean | release: the local direction divided by the workers, as the release's
    bucket_mb: float = 25.0  # allreduce bucket size in MB (as ssgd, so warm-up equals ssgd)
    # A local learning rate on a step schedule of its own (the released scripts' --lr-local and
    # --lr-step-epochs-local) instead of local_lr_scale x the run's scheduled one; needs local_momentum 0.
    local_lr: float | None = None
    local_milestones: list = field(default_factory=list)  # with local_lr: epochs where it is x local_gamma
    local_gamma: float = 0.1

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.local_optimizer not in LOCAL_RULES:
            raise ValueError(
                f"local_optimizer must be one of {sorted(LOCAL_RULES)}, got {self.local_optimizer!r}")
        if not (self.local_lr_scale >= 0 and math.isfinite(self.local_lr_scale)):
            raise ValueError(f"local_lr_scale must be a finite number >= 0, got {self.local_lr_scale}")
        if not 0 <= self.local_momentum < 1:
            raise ValueError(f"local_momentum must be in [0, 1), got {self.local_momentum}")
        if self.dc_lambda < 0:
            raise ValueError(f"dc_lambda must be >= 0, got {self.dc_lambda}")
        if not 0 <= self.dc_ms_decay < 1:
            raise ValueError(f"dc_ms_decay must be in [0, 1), got {self.dc_ms_decay}")
        if not 0 <= self.glu_weight <= 1:
            raise ValueError(f"glu_weight must be in [0, 1], got {self.glu_weight}")
        if self.glu_source not in GLU_SOURCES:
            raise ValueError(f"glu_source must be one of {GLU_SOURCES}, got {self.glu_source!r}")
        if self.glu_reading not in GLU_READINGS:
            raise ValueError(f"glu_reading must be one of {GLU_READINGS}, got {self.glu_reading!r}")
        if self.local_rescale not in LOCAL_RESCALES:
            raise ValueError(f"local_rescale must be one of {LOCAL_RESCALES}, got {self.local_rescale!r}")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {self.bucket_mb}")
        if self.local_lr is not None:
            if not (self.local_lr > 0 and math.isfinite(self.local_lr)):
                raise ValueError(f"local_lr must be a finite number > 0, got {self.local_lr}")
            if self.local_momentum:
                raise ValueError(f"local_lr needs local_momentum 0 (a schedule of its own is applied to the "
                                 f"local direction), got local_momentum {self.local_momentum}")
        elif self.local_milestones:
            raise ValueError("local_milestones needs local_lr (without it the local lr follows the run's schedule)")
        if not all(isinstance(m, (int, float)) and m >= 0 for m in self.local_milestones):
            raise ValueError(f"local_milestones must be epochs >= 0, got {self.local_milestones}")
        if not self.local_gamma > 0:
            raise ValueError(f"local_gamma must be > 0, got {self.local_gamma}")


@dataclass
class _InFlight:
    """One step's gradient allreduce (one async op per bucket), not yet applied."""

    step: int
    lr: float
    ops: list[Pending]
    launched: Span  # the device clock at launch


class DelayedGlobalSGD(Algorithm):
    """Global replica by overlapped synchronous SGD, local replica by compensated local steps."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)

    Options = DelayedOptions

    @property
    def period(self) -> int:
        """Steps between refreshes of the local replica."""
        return 1

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def loop_optimizer(cls, options: DelayedOptions, run: OptimizerSettings) -> OptimizerSettings:
        """The local optimizer: SGD at ``local_lr_scale`` times the run's (scheduled) learning rate,
        with ``local_momentum`` and the run's weight decay. With ``local_lr`` the method scales the
        direction to the local schedule's rate itself and adds the weight decay there (SGD at the
        run's rate, no weight decay)."""
        if options.local_lr is not None:
            return dataclasses.replace(run, name="sgd", lr_scale=1.0, momentum=0.0, nesterov=False, weight_decay=0.0)
        return dataclasses.replace(run, name="sgd", lr_scale=options.local_lr_scale,
                                   momentum=options.local_momentum, nesterov=False)

    def setup(self) -> None:
        super().setup()  # every replica starts from rank 0's parameters
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.global_model = copy.deepcopy(self.model)
        self.global_params = [p for p in self.global_model.parameters() if p.requires_grad]
        for gp in self.global_params:
            gp.grad = torch.zeros_like(gp)
        self.global_opt = self.ctx.build_optimizer(self.global_params)  # the run's optimizer
        position = {id(p): i for i, p in enumerate(self.params)}
        self.buckets = [[position[id(p)] for p in bucket]
                        for bucket in grad_buckets(self.params, int(self.options.bucket_mb * 2**20))]
        self.rule = build_rule(self.options)
        self.in_flight: list[_InFlight] = []
        self.version = 0  # global updates applied to the global replica
        self.base_version = 0  # version of the global replica the local replica last copied
        self.global_grad: torch.Tensor | None = None  # the global signal the local rule uses (GLU)
        self.last_update: torch.Tensor | None = None  # latest global step / its lr (glu_source update)
        self.counters = {"steps": 0, "staleness_sum": 0.0, "refreshes": 0, "overlapped_seconds": 0.0}
        self.last = {"staleness": 0.0, "warmup": 1.0}
        # The refresh distances stay on the device, read at log points: a refresh reads no number.
        device = self.params[0].device
        self.distance_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.distance_last = torch.zeros((), dtype=torch.float64, device=device)

    @property
    def eval_model(self) -> torch.nn.Module:
        """The global replica with every launched gradient applied, with this rank's buffers."""
        self._complete(before=None)
        with torch.no_grad():
            for mine, local in zip(self.global_model.buffers(), self.model.buffers(), strict=True):
                mine.copy_(local)
        return self.global_model

    # ---- the hooks ----------------------------------------------------------------------------
    def after_backward(self, info: StepInfo) -> None:
        t = info.step
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        staleness = t - self.base_version
        if t < self.options.warmup_steps:
            self._synchronous_step(grads, info.lr)
            staleness = 0
        else:
            self._launch(grads, t, info.lr)
            shift = None
            if (t - self.options.warmup_steps + 1) % self.period == 0:
                shift = self._refresh(t)
            if self.rule.writes_replica:
                self._write_local_replica(grads, info)
            else:
                self._set_local_direction(self.rule.direction(flatten(grads), shift, self.global_grad), info)
        self.counters["steps"] += 1
        self.counters["staleness_sum"] += staleness
        self.last["staleness"] = float(staleness)
        self.last["warmup"] = float(t < self.options.warmup_steps)

    def finish(self) -> None:
        self._complete(before=None)

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {
            "warmup": self.last["warmup"],
            "staleness": self.last["staleness"],
            "staleness_mean": c["staleness_sum"] / max(1, c["steps"]),
            "refreshes": float(c["refreshes"]),
            "refresh_distance": float(self.distance_last),
            "refresh_distance_mean": float(self.distance_sum) / max(1, c["refreshes"]),
            "overlapped_seconds": c["overlapped_seconds"],
            "in_flight": float(len(self.in_flight)),
            "global_version": float(self.version),
        }

    def _set_local_direction(self, direction: torch.Tensor, info: StepInfo) -> None:
        """Hand the local rule's direction to the loop's optimizer through the gradients."""
        if self.options.local_rescale == "release":
            # The release's local optimizer sees the gradient summed over the batch and divided by
            # batch x workers (module.py:511-530): the mean gradient / workers. Weight decay is not divided.
            direction = direction / self.comm.size
        if self.options.local_lr is not None:
            direction = self._on_local_schedule(direction, info)
        for p in self.params:
            if p.grad is None:  # a parameter unused in this forward still gets its direction
                p.grad = torch.zeros_like(p)
        unflatten_into(direction, [p.grad for p in self.params])

    def _write_local_replica(self, grads: list[torch.Tensor], info: StepInfo) -> None:
        """The rule overwrites the local replica (GLU as released) from the gradient the release's
        local optimizer is given (over the workers with ``local_rescale: release``) at the local
        learning rate; the loop's optimizer then skips the step."""
        if self.options.local_rescale == "release":
            grads = [g / self.comm.size for g in grads]
        with torch.no_grad():
            self.rule.write_replica([p.detach() for p in self.params], grads, self._local_rate(info))
        self._skip_local_step()

    def _skip_local_step(self) -> None:
        """Gradients set to None, which torch optimizers skip, weight decay included."""
        for p in self.params:
            p.grad = None

    def _local_rate(self, info: StepInfo) -> float:
        """The local learning rate at this step: ``local_lr`` times ``local_gamma`` per milestone
        passed when given, else ``local_lr_scale`` times the run's rate (the loop's optimizer's)."""
        if self.options.local_lr is None:
            return self.options.local_lr_scale * info.lr
        epoch = info.step / self.ctx.steps_per_epoch
        return self.options.local_lr * self.options.local_gamma ** sum(1 for m in self.options.local_milestones
                                                                        if epoch >= m)

    def _on_local_schedule(self, direction: torch.Tensor, info: StepInfo) -> torch.Tensor:
        """The direction the loop's SGD (at the run's rate ``info.lr``, no weight decay) turns into
        a step of ``local_lr`` on its own schedule with the run's weight decay:
        ``(local_lr(t) / lr(t)) * (d + weight_decay * w)``. A step whose run rate is 0 stays put."""
        rate = self._local_rate(info)
        decay = self.ctx.run_optimizer.weight_decay
        if decay:
            direction = direction + decay * flatten([p.detach() for p in self.params])
        return direction * (rate / info.lr) if info.lr > 0 else torch.zeros_like(direction)

    # ---- the steps ----------------------------------------------------------------------------
    def _synchronous_step(self, grads: list[torch.Tensor], lr: float) -> None:
        """Warm-up: exactly ssgd (blocking bucketed allreduce, the run's optimizer), applied to
        the global replica and copied into the local one; the local optimizer then has nothing
        to do (gradients set to None, which torch optimizers skip)."""
        with self.comm.reduction():
            for bucket in self.buckets:
                flat = torch.cat([grads[i].reshape(-1) for i in bucket])
                self.comm.all_reduce(flat, op="avg")
                unflatten_into(flat, [self.global_params[i].grad for i in bucket])
        self._global_step(lr)
        if self.rule.needs_global_grad:
            self.global_grad = self._global_signal()
        self._copy_global_to_local()
        self._skip_local_step()

    def _launch(self, grads: list[torch.Tensor], step: int, lr: float) -> None:
        """Start this step's gradient allreduce (copies: the own gradient is still needed)."""
        t0 = self.ctx.clock.start(self.params[0].device)
        with self.comm.reduction():
            ops = [self.comm.all_reduce_async(torch.cat([grads[i].reshape(-1) for i in bucket]), op="avg")
                   for bucket in self.buckets]
        self.in_flight.append(_InFlight(step, lr, ops, t0))

    def _refresh(self, t: int) -> torch.Tensor:
        """Overwrite the local replica by the global one holding updates 0..t-1; return the
        shift ``w_now - w_grad`` of the local weights (for delay compensation)."""
        before = flatten([p.detach() for p in self.params])
        self._complete(before=t)
        self._copy_global_to_local()
        after = flatten([p.detach() for p in self.params])
        shift = after - before
        self.distance_last.copy_(shift.norm())
        self.distance_sum += self.distance_last
        self.counters["refreshes"] += 1
        if self.rule.needs_global_grad:
            # From A_{t-1}, whatever completed it earlier (evaluation, checkpoint).
            self.global_grad = self._global_signal()
        return shift

    def _complete(self, before: int | None) -> None:
        """Wait for and apply, in launch order, every in-flight allreduce of a step < ``before``
        (all of them when None)."""
        while self.in_flight and (before is None or self.in_flight[0].step < before):
            job = self.in_flight.pop(0)
            self.ctx.clock.stop(job.launched, self._overlapped)
            for bucket, op in zip(self.buckets, job.ops, strict=True):
                flat = op.wait()  # blocked time goes to comm.stats
                unflatten_into(flat, [self.global_params[i].grad for i in bucket])
            self._global_step(job.lr)

    def _overlapped(self, seconds: float) -> None:
        """A clock sink: how long an allreduce was in flight before its wait was called."""
        self.counters["overlapped_seconds"] += seconds

    def _global_step(self, lr: float) -> None:
        """One synchronous SGD update of the global replica with the averaged gradient."""
        for group in self.global_opt.param_groups:
            group["lr"] = lr
        if self.ctx.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.global_params, self.ctx.grad_clip)
        track = self.rule.needs_global_grad and self.options.glu_source == "update" and lr > 0
        before = flatten([gp.detach() for gp in self.global_params]) if track else None
        self.global_opt.step()
        self.version += 1
        if track:
            self.last_update = (before - flatten([gp.detach() for gp in self.global_params])) / lr

    def _global_signal(self) -> torch.Tensor | None:
        """GLU's latest global gradient: the last global step over its lr, or the last average."""
        if self.options.glu_source == "update":
            return self.last_update
        return flatten([gp.grad for gp in self.global_params])

    def _copy_global_to_local(self) -> None:
        with torch.no_grad():
            for p, gp in zip(self.params, self.global_params, strict=True):
                p.copy_(gp)
        self.base_version = self.version

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Completes the in-flight allreduces first (applying them now or at the next refresh
        gives the same replica), then saves the global replica and everything needed to go on."""
        self._complete(before=None)
        self.ctx.clock.resolve()  # their overlap times into the counters saved below
        return {"global_model": self.global_model.state_dict(),
                "global_optimizer": self.global_opt.state_dict(),
                "global_grads": [gp.grad.clone() for gp in self.global_params],
                "global_grad": self.global_grad, "last_update": self.last_update,
                "rule": self.rule.state_dict(),
                "version": self.version, "base_version": self.base_version,
                "counters": dict(self.counters), "last": dict(self.last),
                "distance": {"sum": self.distance_sum.clone(), "last": self.distance_last.clone()}}

    replica_key = "algorithm.global_model"

    def replicated_tensors(self) -> list[torch.Tensor]:
        """The global replica: every rank applies the same averaged gradient to it (the local
        replicas differ by design between refreshes)."""
        return list(self.global_model.parameters())

    def load_state_dict(self, state: dict) -> None:
        self.in_flight = []
        self.global_model.load_state_dict(state["global_model"])
        self.global_opt.load_state_dict(state["global_optimizer"])
        for gp, g in zip(self.global_params, state["global_grads"], strict=True):
            gp.grad.copy_(g)
        device = self.global_params[0].device
        self.global_grad = restore_into(self.global_grad, state["global_grad"], device)
        self.last_update = restore_into(self.last_update, state["last_update"], device)
        self.rule.load_state_dict(state["rule"], device)
        self.version, self.base_version = state["version"], state["base_version"]
        self.counters.update(state["counters"])
        self.last.update(state["last"])
        restore_into(self.distance_sum, state["distance"]["sum"])
        restore_into(self.distance_last, state["distance"]["last"])
