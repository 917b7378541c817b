"""RedSync: residual gradient compression with momentum correction (Fang et al., arXiv 1808.04357).

Fang, Fu, Yang, Hsieh, "RedSync: Reducing Synchronization Traffic for Distributed Deep Learning",
arXiv 1808.04357; released as feifeibear/89757 (CNNs, Horovod). Per layer and step, on every
worker (g: this worker's gradient of the layer, m: momentum; the machinery, which ``dgc`` shares,
is :mod:`commlab.algorithms.momentum_correction`'s)::

    u = m*u + g                      momentum correction (the optimizer itself has no momentum)
    v = v + u                        residual accumulation        (Nesterov: v = v + m*u + g)
    S = select(v, k)                 k = ceil(density * n), selector chosen by layer size
    send (S, v[S]);  u[S] = v[S] = 0 momentum factor masking
    grad = (sum over ranks of scatter(S_j, v_j[S])) / P;   plain SGD step with it

Selectors by layer size (thresholds are options): above ``binary_search_above`` (4M) the
threshold binary search (:mod:`commlab.compress.binary_search`), above ``trimmed_topk_above``
(1M) trimmed top-k (:mod:`commlab.compress.trimmed_topk`), else exact top-k; layers of at most
``dense_at_most`` (1024) elements are averaged dense. All compressed layers of a step travel in
one allgather of variable length: indices and the values' bit patterns packed in one integer
message (int32 words below 2^31 elements in all, int64 above; the release packs indices into
float32, which corrupts them above 2^24), with the counts gathered first
(:func:`commlab.core.sparse.allgatherv_pairs`) unless every compressed layer's selector returns
exactly k entries (exact and trimmed top-k), when every rank already knows them.

Our reading, where it departs from the release:

* **Nesterov as the paper means it**: ``v = v + m*u + g`` with the updated ``u`` (torch's
  Nesterov SGD ``g + m*buf``). The release computes ``rsd.add(momentum, d_p)`` out of place and
  drops the result, so its "Nesterov" runs are plain momentum.
* **Dense layers keep their momentum.** A layer sent dense (tiny, or ``k >= n``, e.g. density
  1.0) sends all of ``v`` by allreduce and is not masked: nothing is delayed, so there is no stale
  momentum to mask, and the update equals momentum SGD on the averaged gradient exactly. (Masking
  every entry would turn momentum SGD into plain SGD.) So ``redsync`` at density 1.0 *is*
  momentum SGD with a dense allreduce.
* **Weight decay** (``train.weight_decay``) is added to the gradient before compression, as torch
  SGD adds it before its momentum: ``g = grad + wd * w``. The optimizer is plain SGD.
* **Local gradient clipping** (``local_clip``, DGC's recipe): each worker scales its gradient so
  that its norm over all layers is at most ``local_clip / sqrt(P)``, before weight decay and
  compression. The loop's ``train.grad_clip`` acts on the synchronised gradient instead.
* **Sign-and-mean quantisation** (``quantize``): of the selected entries only those of one sign
  are sent, positive on even steps and negative on odd ones (the release alternates the same
  way), as indices plus one mean per layer; receivers add the mean at each index. ``u`` is masked
  at the sent indices and ``v`` keeps ``v - mean`` there: the release zeroes ``v``, which loses
  the quantisation error; we keep it so that the residual stays conserved.
* **Density warm-up** (``warmup``): densities 25%, 6.25%, 1.56%, 0.4%, one stage per
  ``warmup_stage_epochs``, then ``density`` (never below it), as DGC and the release schedule it.
* **Threshold reuse** (``reuse_every``): see :class:`commlab.compress.binary_search.BinarySearchSelector`.

``dgc`` (:mod:`commlab.algorithms.dgc`) is the same machinery with exact top-k on every
compressed layer and no quantised variant.

Launch::

    torchrun --standalone --nproc-per-node 4 -m commlab train --config run.yaml method=redsync \\
        method_params.density=0.001
"""

from __future__ import annotations

from dataclasses import dataclass

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.momentum_correction import CompressionOptions, MomentumCorrectedCompression
from commlab.compress.binary_search import BinarySearchSelector
from commlab.registry import ALGORITHMS


@dataclass
class RedSyncOptions(CompressionOptions):
    """RedSync's options: the shared ones plus the selector policy and its variants."""

    binary_search_above: int = 4 * 2**20  # layers above this many elements: threshold binary search
    trimmed_topk_above: int = 2**20  # layers above this (and not above the previous): trimmed top-k
    reuse_every: int = 1  # binary search: reuse the found ratio r for this many steps (release: 10)
    quantize: bool = False  # sign-and-mean: indices of one sign plus one mean per layer

    def validate(self) -> None:
        super().validate()
        if self.trimmed_topk_above < 0 or self.binary_search_above < 0:
            raise ValueError(f"size thresholds must be >= 0, got trimmed_topk_above="
                             f"{self.trimmed_topk_above}, binary_search_above={self.binary_search_above}")
        if self.reuse_every < 1:
            raise ValueError(f"reuse_every must be >= 1, got {self.reuse_every}")


@ALGORITHMS.register("redsync")
class RedSync(MomentumCorrectedCompression):
    """Momentum-corrected residual compression with RedSync's selectors (see the module notes)."""

    comm_pattern = "allgather"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "sparse"
    host_sync_budget = SyncBudget({"step": 8})
    # wide layers: each size policy's selector (binary search above 1M elements, trimmed top-k above 100k)
    quick_run = QuickRun({"density": 0.01, "binary_search_above": 1_000_000, "trimmed_topk_above": 100_000},
                         wide_model=True)
    resume = ResumeState("the momentum-corrected residuals u and v, the selectors' state and the totals")

    Options = RedSyncOptions

    # ---- policy ----------------------------------------------------------------------------------
    def selector_for(self, n: int) -> str | None:
        """Registered selector for a layer of ``n`` elements, or None to send it dense."""
        o = self.options
        if n <= o.dense_at_most:
            return None
        if n > o.binary_search_above:
            return "binary_search"
        if n > o.trimmed_topk_above:
            return "trimmed_topk"
        return "exact_topk"

    def make_selector(self, name: str):
        if name == "binary_search":  # the one selector with an option of its own
            return BinarySearchSelector(reuse_every=self.options.reuse_every)
        return super().make_selector(name)

    @property
    def quantized(self) -> bool:
        return self.options.quantize
