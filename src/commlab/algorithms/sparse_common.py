"""Plumbing shared by the sparse-gradient methods (Ok-Topk, TopkA, Gaussian-k, gTop-k; Li & Hoefler,
PPoPP'22, section 3).

Every step of such a method, as in Shigangli/Ok-Topk: flatten all gradients into one tensor,
add the residual (acc = g + eps), synchronise a sparse average of acc, keep in the residual
exactly the part of acc this rank did not get applied, and hand the averaged sparse update to the
optimizer as the gradient (momentum and weight decay apply to it, as in the release). The first
``warmup_steps`` steps are dense (one allreduce of acc), for every method, as in the release.

A method subclasses :class:`SparseAlgorithm` and implements ``sparse_step(acc, step)`` returning
a :class:`SparseUpdate`. Communication is wrapped in ``with self.phase("name"):`` so that the
elements sent in each phase are reported; selection in ``with self.selecting():`` so that its time
is recorded (``comm.stats.add_selection``). Per-step metrics (``algo_<key>`` in MLflow), as means
over the sparse steps since the previous log point unless named ``*_mean`` (over all sparse steps
so far): ``volume`` (elements sent per step by this rank, indices + values + counts),
``volume_over_k`` and ``recv_over_k`` (the paper's volume per worker in units of k),
``sent_<phase>``, ``local_selected``, ``select_ms``, ``residual_norm``, and ``probe_error`` when
the selection-accuracy probe runs: ||top-k(dense average of acc) - update|| / ||dense average||,
computed every ``probe_every`` steps with a dense allreduce on the uncounted control channel.

Worst cases over ranks and steps (a claim such as "< 6k per worker" must hold at every step on
every rank, not on average on rank 0): each rank tracks the largest volume it sent in one sparse
step since the previous log point, and ``metrics()`` (called by every rank at the same log points)
reduces it and the cumulative mean with MAX over the ranks in one allreduce of two numbers on the
control channel (``ctx.control``), outside the Communicator's accounting like the training
loop's log-point allreduce:
``step_volume_over_k`` (this rank's largest step in the window, / k), ``step_volume_over_k_max``
(the same, max over ranks) and ``volume_over_k_max`` (cumulative mean per sparse step, max over
ranks).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from commlab.algorithms.base import Algorithm, StepInfo
from commlab.algorithms.tensors import flat_grads, write_grads
from commlab.compress.base import k_for_density
from commlab.compress.residual import ResidualMemory
from commlab.core.sparse import scatter_dense


@dataclass
class SparseOptions:
    density: float = 0.02  # k = ceil(density * n) entries per step (2%: the release's VGG/LSTM runs)
    warmup_steps: int = 128  # dense steps first (release: 128 LSTM, 512 VGG, 0 BERT)
    residual: bool = True  # error feedback: keep what was not applied for later steps
    probe_every: int = 0  # selection-accuracy probe every this many steps (0: off; costs a dense allreduce)

    def validate(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.probe_every < 0:
            raise ValueError(f"probe_every must be >= 0, got {self.probe_every}")


@dataclass
class SparseUpdate:
    """The averaged update of one step and what it consumed of this rank's acc."""

    indices: torch.Tensor | None  # int64 positions of the update; None: dense update in `values`
    values: torch.Tensor  # averaged values at `indices` (or the dense averaged tensor)
    applied: torch.Tensor | None  # positions of acc that were applied, or a boolean mask of them (None: all)


class SparseAlgorithm(Algorithm):
    """Base of the sparse-gradient methods: residual, warm-up, accounting, probe."""

    Options = SparseOptions

    # ---- construction --------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        first = self.params[0]
        self.n = sum(p.numel() for p in self.params)
        self.k = k_for_density(self.n, self.options.density)
        self.memory = ResidualMemory(self.n, first.dtype, first.device, enabled=self.options.residual)
        self.window: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}
        self._step_sent0 = 0
        self.setup_sparse()

    def setup_sparse(self) -> None:
        """Method-specific state (thresholds, regions); called at the end of setup()."""

    # ---- the method ----------------------------------------------------------------------------
    def sparse_step(self, acc: torch.Tensor, step: int) -> SparseUpdate:
        """Synchronise a sparse average of ``acc``; ``step`` counts sparse steps from 0."""
        raise NotImplementedError

    def dense_step(self, acc: torch.Tensor) -> SparseUpdate:
        """Warm-up: dense average of acc; everything applied."""
        avg = self.comm.all_reduce(acc.clone(), op="avg")
        return SparseUpdate(None, avg, None)

    def after_backward(self, info: StepInfo) -> None:
        with torch.no_grad():
            acc = self.memory.accumulate(flat_grads(self.params))
            c = self.comm.stats.counters
            sent0, recv0 = c["elements_sent"], c["elements_recv"]
            self._step_sent0 = sent0
            warm = info.step < self.options.warmup_steps
            with self.comm.reduction():
                update = self.dense_step(acc) if warm else \
                    self.sparse_step(acc, info.step - self.options.warmup_steps)
            dense = update.values if update.indices is None else \
                scatter_dense(update.indices, update.values, self.n, accumulate=False)
            if not warm:
                self._count_sparse_step(c["elements_sent"] - sent0, c["elements_recv"] - recv0)
            else:
                self.window["dense_steps"] += 1
            if self.options.probe_every and info.step % self.options.probe_every == 0:
                self.last["probe_error"] = self._probe(acc, dense)
            self.memory.keep(acc, update.applied)
            write_grads(self.params, dense)

    # ---- accounting ----------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str):
        """Attribute the elements sent inside the block to phase ``name``."""
        c = self.comm.stats.counters
        s0 = c["elements_sent"]
        try:
            yield
        finally:
            self.window[f"sent_{name}"] += c["elements_sent"] - s0

    @contextmanager
    def selecting(self):
        """Time a selection on the run's device clock (``ctx.clock``: CUDA events read at the next
        log point, host time on the CPU) into comm.stats.selection_seconds and ``select_ms``; what
        it selected is then recorded with :meth:`record_selected`."""
        with self.ctx.clock.timed(self.params[0].device, self._selection_seconds):
            yield

    def record_selected(self, count: int) -> None:
        """This rank's local selection of the step: the Communicator's ``elements_selected`` and the
        window's ``local_selected``."""
        self.comm.stats.add_selection(count)
        self.note("local_selected", count)

    def _selection_seconds(self, seconds: float) -> None:
        self.comm.stats.add_selection(0, seconds)
        self.window["select_seconds"] += seconds

    def step_sent(self) -> int:
        """Elements this rank has sent so far in the current step (for volume budgets)."""
        return self.comm.stats.counters["elements_sent"] - self._step_sent0

    def note(self, key: str, value: float) -> None:
        """Add a per-step quantity to the window (reported as its mean per sparse step)."""
        self.window[key] += float(value)

    def _count_sparse_step(self, sent: int, recv: int) -> None:
        self.window["sparse_steps"] += 1
        self.window["volume"] += sent
        self.window["recv"] += recv
        self.window["step_volume_max"] = max(self.window["step_volume_max"], sent)
        self.totals["sparse_steps"] += 1
        self.totals["volume"] += sent
        self.totals["recv"] += recv

    def metrics(self) -> dict[str, float]:
        w, out = self.window, {"k": float(self.k), "n": float(self.n)}
        steps = w.get("sparse_steps", 0)
        if steps:
            for key, value in w.items():
                if key not in ("sparse_steps", "dense_steps", "select_seconds", "step_volume_max"):
                    out[key] = value / steps
            out["select_ms"] = 1000 * w.get("select_seconds", 0.0) / steps
            out["volume_over_k"] = out["volume"] / self.k
            out["recv_over_k"] = out["recv"] / self.k
            out["step_volume_over_k"] = w["step_volume_max"] / self.k
        if self.totals.get("sparse_steps"):
            t = self.totals
            out["volume_over_k_mean"] = t["volume"] / (t["sparse_steps"] * self.k)
            out["recv_over_k_mean"] = t["recv"] / (t["sparse_steps"] * self.k)
            out["sparse_steps"] = t["sparse_steps"]
        self._max_over_ranks(out, steps)
        out["dense_steps"] = w.get("dense_steps", 0.0)
        out["residual_norm"] = self.memory.norm()
        out.update(self.last)
        out.update(self.extra_metrics())
        self.window = defaultdict(float)
        return out

    def _max_over_ranks(self, out: dict[str, float], steps: float) -> None:
        """Add ``step_volume_over_k_max`` and ``volume_over_k_max``: this window's largest step
        volume and the cumulative mean volume, max over the ranks (one allreduce of 2 numbers,
        kept out of the method's accounting; every rank calls metrics() at the same steps)."""
        mine = [out.get("step_volume_over_k", -1.0), out.get("volume_over_k_mean", -1.0)]
        control = self.ctx.control
        if control.size > 1:
            mine = control.all_reduce(torch.tensor(mine, dtype=torch.float64, device=control.device), op="max").tolist()
        if steps:
            out["step_volume_over_k_max"] = mine[0]
        if self.totals.get("sparse_steps"):
            out["volume_over_k_max"] = mine[1]

    def extra_metrics(self) -> dict[str, float]:
        """Method-specific instantaneous metrics (thresholds, ...)."""
        return {}

    def _probe(self, acc: torch.Tensor, update: torch.Tensor) -> float:
        """||top-k(dense average of acc) - update|| / ||dense average||, via a dense allreduce on the
        control channel, so that the probe's traffic stays out of the method's accounting."""
        dense = self.ctx.control.all_reduce(acc.clone(), op="avg")
        top = torch.topk(dense.abs(), min(self.k, self.n), sorted=False).indices
        best = torch.zeros_like(dense)
        best[top] = dense[top]
        norm = float(dense.norm())
        return float((best - update).norm()) / norm if norm > 0 else 0.0

    # ---- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"residual": self.memory.state_dict(), "totals": dict(self.totals),
                "method": self.method_state()}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state["residual"])
        self.totals = defaultdict(float, state.get("totals", {}))
        self.load_method_state(state.get("method", {}))

    def method_state(self) -> dict:
        return {}

    def load_method_state(self, state: dict) -> None:
        pass
