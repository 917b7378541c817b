"""TopkA: allgather of every rank's exact top-k (the sparse baseline of Ok-Topk, Li & Hoefler,
PPoPP'22, Table 1; ``topkA`` in Shigangli/Ok-Topk).

Each rank selects the exact top-k of acc = g + eps, all ranks allgather the k (index, value)
pairs of every rank (one ring allgather of packed pairs: every rank has exactly k, so no counts
are exchanged), sum them and divide by P. Everything a rank sent is applied, so its residual is acc
with its top-k zeroed. Volume per rank: 2k(P-1) elements sent and received, growing with P
(Ok-Topk's stays below 6k).
"""

from __future__ import annotations

import torch

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.sparse_common import SparseAlgorithm, SparseUpdate
from commlab.compress.topk import exact_topk
from commlab.core.sparse import allgatherv_pairs, reduce_pairs
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("topk_allgather")
class TopkAllgather(SparseAlgorithm):
    """Exact local top-k, allgather, average."""

    comm_pattern = "allgather"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "sparse"
    host_sync_budget = SyncBudget({"step": 8})
    quick_run = QuickRun({"warmup_steps": 4, "density": 0.02})
    resume = ResumeState("the residuals and the selection's totals")

    def sparse_step(self, acc: torch.Tensor, step: int) -> SparseUpdate:
        with self.selecting():
            idx = torch.sort(exact_topk(acc, self.k)).values
        self.record_selected(idx.numel())
        with self.phase("allgather"):  # exactly k pairs from every rank: no counts to exchange
            all_idx, all_val, _ = allgatherv_pairs(self.comm, idx, acc[idx], self.n, [idx.numel()] * self.comm.size)
        u_idx, u_val = reduce_pairs(all_idx, all_val, self.n)
        self.note("global_selected", u_idx.numel())
        return SparseUpdate(u_idx, u_val / self.comm.size, idx)
