"""DGC-style top-k with momentum correction: the baseline that isolates RedSync's selectors
(Fang et al., RedSync, arXiv 1808.04357: RGC without RedSync's selectors).

Deep Gradient Compression (Lin et al., ICLR 2018) as RedSync builds on it: momentum correction,
residual accumulation, momentum factor masking, local gradient clipping and density warm-up,
with an **exact top-k** (``torch.topk``) on every compressed layer, whatever its size. Everything
else (the variable-length allgather with integer indices, scatter-add / P, dense tiny layers,
plain SGD step, Nesterov as ``v += m*u + g``) is the code RedSync runs
(:class:`~commlab.algorithms.momentum_correction.MomentumCorrectedCompression`), so a ``redsync``
vs ``dgc`` comparison differs only in how the k entries are found: selection time
(``selection_seconds``, ``algo_select_ms_*``) and the binary search's count (between k/2 and 2k
instead of exactly k).

Launch::

    torchrun --standalone --nproc-per-node 4 -m commlab train --config run.yaml method=dgc \\
        method_params.density=0.001
"""

from __future__ import annotations

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.momentum_correction import CompressionOptions, MomentumCorrectedCompression
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("dgc")
class DGC(MomentumCorrectedCompression):
    """RedSync's machinery with exact top-k on every compressed layer and no quantised variant."""

    comm_pattern = "allgather"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "sparse"
    host_sync_budget = SyncBudget({"step": 8})
    quick_run = QuickRun({"density": 0.01}, wide_model=True)  # wide layers: above dense_at_most, compressed
    resume = ResumeState("the momentum-corrected residuals u and v and the totals")

    Options = CompressionOptions

    def selector_for(self, n: int) -> str | None:
        return None if n <= self.options.dense_at_most else "exact_topk"
