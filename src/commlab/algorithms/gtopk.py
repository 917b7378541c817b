"""gTop-k: global top-k by a reduction tree in ceil(log2 P) rounds, then a broadcast (Shi et al.,
ICDCS'19; a sparse baseline of Ok-Topk, Li & Hoefler, PPoPP'22; ``gtopk`` in Shigangli/Ok-Topk).

Each rank takes the exact top-k of acc = g + eps. In round r (step s = 2^r) every rank whose
index is an odd multiple of s sends its k pairs to rank - s and drops out; the receiver adds the
values of common indices and keeps the top-k of the union (always exactly k entries). Rank 0
ends with the global top-k and broadcasts it; the update is its values divided by P. The release
only handles powers of two; the tree here takes any P (a rank without a partner skips a round).

Residuals, two readings (option ``exact_values``):

* ``False`` (the release): a rank zeroes its residual where its own top-k meets the final global
  top-k. A contribution dropped inside the tree (its partial sum lost a merge) while the index
  survived through another branch is then neither applied nor kept: error feedback leaks.
* ``True``: rank 0 broadcasts only the k global indices, and one allreduce of k values sums every
  rank's acc at those indices where it had selected them; then the update holds exactly the
  contributions whose residuals are zeroed (sum of updates + residuals = sum of gradients).

Volume per rank: up to 2k per tree round (rank 0 receives in all ceil(log2 P) rounds) plus the
broadcast of 2k (or k indices + an allreduce of k values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.sparse_common import SparseAlgorithm, SparseOptions, SparseUpdate
from commlab.compress.base import index_dtype
from commlab.compress.topk import exact_topk
from commlab.core.communicator import Communicator
from commlab.core.sparse import Pairs, reduce_pairs, wire_dtype
from commlab.registry import ALGORITHMS


def merge_topk(a_idx: torch.Tensor, a_val: torch.Tensor, b_idx: torch.Tensor, b_val: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k by magnitude of the sum of two sparse vectors; indices returned sorted (int64)."""
    idx, val = reduce_pairs(torch.cat([a_idx.long(), b_idx.long()]), torch.cat([a_val, b_val]))
    if idx.numel() > k:
        keep = torch.sort(torch.topk(val.abs(), k, sorted=False).indices).values
        idx, val = idx[keep], val[keep]
    return idx, val


def tree_topk(comm: Communicator, idx: torch.Tensor, val: torch.Tensor, k: int, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce every rank's k pairs up a binary tree to rank 0 (the others return their last
    message's pairs, unused). Every message is exactly k pairs, indices and values packed in
    one integer tensor (:class:`~commlab.core.sparse.Pairs`)."""
    p, me = comm.size, comm.rank
    for r in range(math.ceil(math.log2(p)) if p > 1 else 0):
        s = 2 ** r
        if me % s:
            break                                   # left the tree in an earlier round
        if (me // s) % 2 == 1:
            comm.send(Pairs.pack(idx, val, n).packed, me - s)
            comm.stats.relabel_last("gtopk_tree_pairs")
            break
        if me + s < p:
            got = comm.recv(torch.empty((k, 2), dtype=wire_dtype(n, val.dtype), device=val.device), me + s)
            comm.stats.relabel_last("gtopk_tree_pairs")
            o_idx, o_val = Pairs(got, val.dtype).unpack()
            idx, val = merge_topk(idx, val, o_idx, o_val, k)
    return idx, val


@ALGORITHMS.register("gtopk")
class GlobalTopk(SparseAlgorithm):
    """Tree-reduced global top-k, broadcast from rank 0."""

    comm_pattern = "tree"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "sparse"
    host_sync_budget = SyncBudget({"step": 8})
    quick_run = QuickRun({"warmup_steps": 4, "density": 0.02})
    resume = ResumeState("the residuals and the selection's totals")

    @dataclass
    class Options(SparseOptions):
        exact_values: bool = False  # True: allreduce exact sums at the global indices (no residual leak)

    def sparse_step(self, acc: torch.Tensor, step: int) -> SparseUpdate:
        k, n = self.k, self.n
        with self.selecting():
            idx = torch.sort(exact_topk(acc, k)).values
        self.record_selected(idx.numel())
        with self.phase("tree"):
            t_idx, t_val = tree_topk(self.comm, idx, acc[idx], k, n)
        with self.phase("broadcast"):
            if self.options.exact_values:
                g_idx = self.comm.broadcast(t_idx.to(index_dtype(n)).contiguous(), src=0).long()
                self.comm.stats.relabel_last("gtopk_broadcast_indices")
                mine = torch.zeros(n, dtype=torch.bool, device=acc.device)
                mine[idx] = True
                g_val = torch.where(mine[g_idx], acc[g_idx], torch.zeros_like(acc[g_idx]))
                self.comm.all_reduce(g_val, op="sum")
                self.comm.stats.relabel_last("gtopk_allreduce_values")
            else:  # rank 0's k pairs, packed in one message
                every = self.comm.broadcast(Pairs.pack(t_idx, t_val, n).packed, src=0)
                self.comm.stats.relabel_last("gtopk_broadcast_pairs")
                g_idx, g_val = Pairs(every, t_val.dtype).unpack()
        order = torch.argsort(g_idx)
        g_idx, g_val = g_idx[order], g_val[order]
        in_global = torch.zeros(n, dtype=torch.bool, device=acc.device)
        in_global[g_idx] = True
        applied = torch.zeros_like(in_global)  # this rank's top-k entries that made the global top-k
        applied[idx] = in_global[idx]
        self.note("global_selected", g_idx.numel())
        return SparseUpdate(g_idx, g_val / self.comm.size, applied)
