"""PowerSGD: rank-r gradient compression with error feedback (Vogels, Karimireddy & Jaggi,
NeurIPS 2019), a baseline beside QSGD and fp16 in the ADPSGD comparison (README's table of papers).

Every step, after ``warmup_steps`` dense steps, each rank forms ``M = g + e`` per layer (``e``: its
error memory) and views it as a matrix (first dimension x the rest). Layers that are vectors, or
whose rank-r factors would not save ``min_compression_rate`` times the elements, are averaged
densely. For the others (the paper's Algorithm 1 with one power iteration, warm-started):

    P = M Q                      Q: the previous step's Q (random on the first compressed step)
    P = allreduce_sum(P);  P̂ = orthonormalise(P)    (Gram-Schmidt, column by column)
    Q = allreduce_sum(Mᵀ P̂) / world
    approximation = P̂ Qᵀ         every rank applies it (the same on every rank)
    e = M - approximation        error feedback: what the approximation missed stays local

This is the arithmetic of torch's ``powerSGD_hook`` (same compression test, the same Gram-Schmidt,
P summed before orthogonalisation, Q averaged, warm start, error = local M minus the shared
approximation). Differences: layers are taken one by one instead of in DDP buckets, the first Q
comes from a generator seeded with the run's seed (identical on every rank), and the dense
layers travel in the same allreduce as the P factors (one collective fewer per step; the bytes
are the same). Two allreduces per step, one global reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.algorithms.base import Algorithm, QuickRun, ResumeState, StepInfo, SyncBudget
from commlab.algorithms.tensors import flatten, grads_of, write_grads
from commlab.registry import ALGORITHMS

Q_INIT_STREAM = 43  # offset of the seed of the first Q's generator (shared by every rank)


def orthonormalize_columns(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``matrix`` in place (torch's hook's procedure): each column
    normalised, then removed from the columns after it. ``epsilon`` guards all-zero columns;
    without it an all-zero column stays zero (divided by 1), decided on the device (no host read
    per column)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        norm = torch.linalg.vector_norm(col)
        col /= norm + epsilon if epsilon else torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col
    return matrix


def compressible(shape: torch.Size, rank: int, min_compression_rate: float) -> bool:
    """Whether a tensor of ``shape`` is compressed: a matrix (not a vector) whose rank-r factors are
    at least ``min_compression_rate`` times smaller than it (torch's ``_should_compress``)."""
    if len(shape) < 2:
        return False
    n, m = shape[0], int(torch.Size(shape[1:]).numel())
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


@ALGORITHMS.register("powersgd")
class PowerSGD(Algorithm):
    """Rank-r PowerSGD with error feedback and warm start; dense allreduce for the first steps."""

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "low_rank"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun({"warmup_steps": 4, "rank": 2})
    resume = ResumeState("the error feedback, the warm-started factors Q and the random generator")

    @dataclass
    class Options:
        rank: int = 2  # r: columns of the low-rank factors P (n x r) and Q (m x r)
        warmup_steps: int = 10  # dense allreduce for this many steps first (torch: start_powerSGD_iter)
        min_compression_rate: float = 2.0  # compress a layer only if its factors are this much smaller
        error_feedback: bool = True  # keep what the approximation missed and add it next step
        warm_start: bool = True  # reuse last step's Q (one power iteration per step); else a new random Q
        epsilon: float = 0.0  # added to column norms in Gram-Schmidt (guards all-zero columns)

        def validate(self) -> None:
            if self.rank < 1:
                raise ValueError(f"rank must be at least 1, got {self.rank}")
            if self.warmup_steps < 0:
                raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
            if self.min_compression_rate <= 0:
                raise ValueError(f"min_compression_rate must be positive, got {self.min_compression_rate}")
            if self.epsilon < 0:
                raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")

    def setup(self) -> None:
        super().setup()
        o = self.options
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.low_rank = [p for p in params if compressible(p.shape, o.rank, o.min_compression_rate)]
        self.dense = [p for p in params if not compressible(p.shape, o.rank, o.min_compression_rate)]
        self.errors = [torch.zeros(p.shape[0], p[0].numel(), dtype=p.dtype, device=p.device)
                       for p in self.low_rank]
        self.qs: list[torch.Tensor] | None = None  # set on the first compressed step
        # host-side: the starting factors are drawn on the CPU from the shared seed, so that every
        # rank, on any device, starts from the same Q (drawn once per restart of the factors)
        self.generator = torch.Generator().manual_seed(self.ctx.seed + Q_INIT_STREAM)

    def _ranks(self) -> list[int]:
        return [min(p.shape[0], p[0].numel(), self.options.rank) for p in self.low_rank]

    def _fresh_qs(self) -> list[torch.Tensor]:
        """Random orthonormal starting factors, drawn on CPU from the shared seed (same on every rank)."""
        return [orthonormalize_columns(torch.randn(p[0].numel(), r, generator=self.generator)  # host-side: shared draw
                                       .to(p.device, p.dtype), self.options.epsilon)
                for p, r in zip(self.low_rank, self._ranks(), strict=True)]

    def compressed_elements(self) -> int:
        """Elements one rank contributes per compressed step: P and Q factors plus dense layers."""
        factors = sum((p.shape[0] + p[0].numel()) * r for p, r in zip(self.low_rank, self._ranks(), strict=True))
        return factors + sum(p.numel() for p in self.dense)

    def after_backward(self, info: StepInfo) -> None:
        world = self.comm.size
        grads = grads_of(self.low_rank + self.dense)
        if info.step < self.options.warmup_steps:
            with self.comm.reduction():
                flat = self.comm.all_reduce(flatten(grads), op="avg")
            write_grads(self.low_rank + self.dense, flat)
            return
        if self.qs is None or not self.options.warm_start:
            self.qs = self._fresh_qs()
        else:
            self.qs = [orthonormalize_columns(q, self.options.epsilon) for q in self.qs]
        ms = []
        for p, e in zip(self.low_rank, self.errors, strict=True):
            m = (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(p.shape[0], -1)
            ms.append(m + e if self.options.error_feedback else m.clone())
        dense = [g.reshape(-1) for g in grads[len(self.low_rank):]]
        with self.comm.reduction():
            # P factors (summed: orthonormalisation does not care about scale) and the dense layers
            # (averaged below) in one allreduce.
            first = torch.cat([(m @ q).reshape(-1) for m, q in zip(ms, self.qs, strict=True)] + dense)
            self.comm.all_reduce(first, op="sum")
            ps, offset = [], 0
            for m, r in zip(ms, self._ranks(), strict=True):
                ps.append(orthonormalize_columns(first[offset:offset + m.shape[0] * r].view(m.shape[0], r),
                                                 self.options.epsilon))
                offset += m.shape[0] * r
            dense_mean = first[offset:] / world
            second = torch.cat([(m.T @ p).reshape(-1) for m, p in zip(ms, ps, strict=True)])
            self.comm.all_reduce(second, op="sum")
        second /= world
        self.qs, offset = [], 0
        for m, p, e, r in zip(ms, ps, self.errors, self._ranks(), strict=True):
            q = second[offset:offset + m.shape[1] * r].view(m.shape[1], r).clone()
            offset += m.shape[1] * r
            approx = p @ q.T
            if self.options.error_feedback:
                e.copy_(m - approx)
            self.qs.append(q)
            m.copy_(approx)
        if ms:
            write_grads(self.low_rank, torch.cat([m.reshape(-1) for m in ms]))
        write_grads(self.dense, dense_mean)

    def metrics(self) -> dict[str, float]:
        dense = sum(p.numel() for p in self.low_rank + self.dense)
        return {"compression_ratio": dense / max(1, self.compressed_elements())}

    def state_dict(self) -> dict:
        return {"errors": [e.clone() for e in self.errors], "qs": None if self.qs is None else
                [q.clone() for q in self.qs], "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "errors" in state:
            for e, saved in zip(self.errors, state["errors"], strict=True):
                e.copy_(saved)
            self.qs = None if state["qs"] is None else \
                [q.to(e.device, copy=True) for q, e in zip(state["qs"], self.errors, strict=True)]
            self.generator.set_state(state["generator"])
