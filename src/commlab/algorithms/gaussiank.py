"""Gaussian-k: threshold from a normal fit, then allgatherv (the Gaussiank baseline of Ok-Topk,
Li & Hoefler, PPoPP'22; ``gaussiank`` in Shigangli/Ok-Topk).

Each rank selects the entries of acc = g + eps above the Gaussian-fit threshold
(:mod:`commlab.compress.gaussiank`: no top-k, one pass for the moments and one per correction),
all ranks allgatherv the pairs (counts differ across ranks), sum them and divide by P. Everything
sent is applied, so the residual is acc with the selected entries zeroed. Volume per rank:
about 2k(P-1), like TopkA, but with a cheaper selection whose count is only approximately k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.sparse_common import SparseAlgorithm, SparseOptions, SparseUpdate
from commlab.compress.gaussiank import GaussianOptions, gaussian_select
from commlab.core.sparse import allgatherv_pairs, reduce_pairs
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("gaussiank")
class GaussianK(SparseAlgorithm):
    """Gaussian-fit threshold selection, allgatherv, average."""

    comm_pattern = "allgather"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "sparse"
    host_sync_budget = SyncBudget({"step": 8})
    quick_run = QuickRun({"warmup_steps": 4, "density": 0.02})
    resume = ResumeState("the residuals and the selection's totals")

    @dataclass
    class Options(SparseOptions):
        lower: float = 0.75  # lower the threshold while fewer than lower*k entries pass
        down: float = 1.012  # factor the threshold is divided by per correction
        max_loops: int = 50  # at most this many corrections per step

        def validate(self) -> None:
            super().validate()
            self.selector().validate()

        def selector(self) -> GaussianOptions:
            return GaussianOptions(self.lower, self.down, self.max_loops)

    def setup_sparse(self) -> None:
        self.selector_options = self.options.selector()
        self.threshold = 0.0

    def sparse_step(self, acc: torch.Tensor, step: int) -> SparseUpdate:
        with self.selecting():
            idx, self.threshold = gaussian_select(acc, self.k, self.selector_options)
        self.record_selected(idx.numel())
        with self.phase("allgather"):
            all_idx, all_val, _ = allgatherv_pairs(self.comm, idx, acc[idx], self.n)
        u_idx, u_val = reduce_pairs(all_idx, all_val, self.n)
        self.note("global_selected", u_idx.numel())
        return SparseUpdate(u_idx, u_val / self.comm.size, idx)

    def extra_metrics(self) -> dict[str, float]:
        return {"local_threshold": self.threshold}
