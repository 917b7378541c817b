"""Ok-Topk: near-optimal sparse allreduce (Li & Hoefler, PPoPP'22, sections 3 and 4).

Implements the algorithm as released in Shigangli/Ok-Topk (LSTM/VGG allreducer; every interval
and factor below is an option with that release's value). Per step, after ``warmup_steps`` dense
steps, with residual eps and acc = g + eps:

1. **Local selection**: every ``local_recompute_every`` (tau = 32) steps the local threshold is
   the exact k-th largest |acc|; in between the previous one is reused (guarded and nudged by
   1.012, band [3k/4, 5k/4]: see :mod:`commlab.compress.threshold`). Selected: |acc| >= threshold.
2. **Regions**: every ``repartition_every`` (64) steps the index space is re-split into P regions
   with balanced numbers of selected entries (boundaries averaged over ranks).
3. **Split and reduce**: rank j receives every rank's selected pairs of region j and sums them
   (:func:`commlab.core.sparse.split_and_reduce`, destinations rotated).
4. **Global selection**: every ``global_recompute_every`` (tau' = 32) steps every rank's reduced
   region is allgathered and the exact top-k of it is the result (its k-th value the new global
   threshold); in between each rank keeps its region's entries above the reused global threshold
   (nudged by 1.01 / 1.008), optionally **balances** them, and all ranks allgatherv them.
5. The update is the kept sums divided by P; eps = acc with the entries that this rank sent
   *and* that were kept globally set to zero (:mod:`commlab.algorithms.sparse_common`).

Where we differ from the release, on purpose: indices travel in integer tensors (the release
packs int32 indices into float32 messages, wrong above 2^24) and nothing is staged through host
numpy; selection is |acc| >= threshold (the release's strict > drops the k-th entry), and an exact
threshold is 0 when k reaches the number of candidates, so density 1 equals dense allreduce.

Volume per rank (paper): split-and-reduce 2k(P-1)/P, balancing + allgatherv <= 4k(P-1)/P, so
below 6k whatever P; TopkA's allgather is 2k(P-1). ``algo_volume_over_k`` measures it (mean per
sparse step), ``algo_step_volume_over_k_max`` the largest step of any rank.

**Threshold control.** ``threshold_control: release`` is the release's behaviour above. Its
reused thresholds move by at most 1.2% / 1% per step, slower than the residuals grow after the
dense warm-up or when the gradient scale drifts, and its exact tau' step allgathers every reduced
region (up to P·k pairs in all when the ranks select different entries): on i.i.d. heavy-tailed
gradients at P = 8 a rank sends up to 17k elements in one step. ``threshold_control: bounded``
(the default) keeps every step of every rank below ``volume_budget`` (6) · k by construction:

* local: at most k selected (the cap of :class:`~commlab.compress.threshold.ThresholdOptions`:
  when more than k pass the reused threshold the exact top-k of those is taken, when fewer than
  3k/4 pass the exact threshold; ties trimmed), so split-and-reduce sends at most 2k + (P-1)
  count elements;
* global: one allgather of a count table: every rank's kept count, elements sent so far, where
  its non-zero reduced values lie (their number, largest and smallest bit patterns) and, once a
  global threshold exists, its histogram around it (``window_bins`` slices of 1/32 octave,
  +-1 octave: :class:`~commlab.compress.bounded.Window`). Every rank then knows the busiest
  rank's spend s and sets the cap K <= k on the kept total so that
  s + table + probes + 4K(P-1)/P + 2P < 6k. When due (tau'), or when the reused threshold keeps
  a total outside [3k/4, K], the threshold is recomputed, aiming at exactly the top-K when due,
  else at a total in the middle half of [3k/4, K] (so that a drifting count stays in the band):
  from the table alone when an edge of the gathered histograms has a count in that band (every
  rank's count at the edge is in the table too: no collective), else by
  :func:`~commlab.compress.bounded.distributed_threshold` (a radix search on the values' bit
  patterns, started in the histogram's slice where the count crosses the cap: one allreduce of
  ``bins`` counts per round, at most 4 rounds for float32 with 256 bins) and one allgather of
  the new counts, instead of allgathering the regions. ``bins`` is the most (up to 256) whose
  rounds over the gathered spread cost at most k/2 elements, so a small k gets more, cheaper
  rounds; the cap reserves that search's worst case only on a step that may run one, and when
  every non-zero entry fits under the cap the threshold is 0 with no search at all;
* allgather: the kept pairs in a plain allgatherv (2(P-1) times the largest count, every slice
  padded to it) when that keeps the busiest rank under the budget or is the cheaper, else balanced
  first (surplus <= 2(K - floor(K/P)), then equal slices 2(P-1)ceil(K/P): <= 4K(P-1)/P + 2P in
  all, which the cap K reserves). Balancing costs a collective more, so by default
  (``balance_when: over_budget``) it runs only when needed; ``balance_when: cheaper`` balances
  whenever that sends fewer elements. Every rank knows every count, so all choose alike.

Hence V <= 2k + 4k(P-1)/P + O(P) and, whatever P and the data, V < 6k. K = k unless k is small
against P (the O(P) count and probe terms): with the tiny MLP's k = 509 at P = 32 the cap is
0.8-0.97k; entries not kept stay in the residuals. With exact thresholds every step both controls compute the same
update (tests/test_oktopk_reference.py).

**Messages and host syncs** (docs/performance.md). Indices and values travel packed in one
integer message (:class:`~commlab.core.sparse.Pairs`). A typical bounded step is four
collectives (the split's counts and pairs, the count table, the allgather; a fifth when
balancing) and four host reads: the local selection's compaction, the split's counts (sent and
received, read together), the reduction's unique indices and the table (the kept entries'
positions need none: their number is in the table). A recompute answered by the table costs
nothing more; a search adds one collective and one read per round and one for the new counts.
Metrics: ``recompute_steps`` is the fraction of sparse steps that recomputed a threshold (exact
or corrected, local or global) or re-split the regions, ``window_answers`` the fraction whose
global threshold the table's histograms answered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.sparse_common import SparseAlgorithm, SparseOptions, SparseUpdate
from commlab.compress.bounded import (
    SPREAD_FIELDS,
    Spread,
    Window,
    bins_within,
    distributed_threshold,
    local_spread,
    probe_cost_bound,
)
from commlab.compress.floatbits import from_bits
from commlab.compress.scan import at_least, compact
from commlab.compress.threshold import ThresholdEstimator, ThresholdOptions
from commlab.core.sparse import (
    SCHEDULES,
    Pairs,
    Regions,
    allgather_equal,
    allgatherv_pairs,
    balance_pairs,
    balanced_boundaries,
    equal_boundaries,
    gather_counts,
    split_and_reduce,
)
from commlab.registry import ALGORITHMS

CONTROLS = ("bounded", "release")
BALANCE_WHEN = ("over_budget", "cheaper")
TABLE_FIELDS = 2 + SPREAD_FIELDS  # per rank: kept count, spread, elements sent so far (then the window)


def window_bins(k: int, p: int) -> int:
    """Slices of the histogram around the global threshold that every rank adds to the count
    table: the most (a power of two, at most 64) costing at most k/8 elements per step; 0 (no
    window) where fewer than 8 would fit, or alone."""
    if p == 1:
        return 0
    bins = 64
    while bins >= 8 and (bins + 1) * (p - 1) > k / 8:
        bins //= 2
    return bins if bins >= 8 else 0


@ALGORITHMS.register("oktopk")
class OkTopk(SparseAlgorithm):
    """Ok-Topk sparse allreduce with residuals, threshold reuse and balanced regions."""

    comm_pattern = "oktopk"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "sparse"
    host_sync_budget = SyncBudget({"step": 8, "recompute": 16})
    quick_run = QuickRun({"warmup_steps": 4, "density": 0.02, "local_recompute_every": 5, "global_recompute_every": 5,
                          "repartition_every": 7})  # thresholds and regions change within a few dozen steps
    resume = ResumeState("the residuals, the local and global thresholds and the regions' boundaries")

    @dataclass
    class Options(SparseOptions):
        local_recompute_every: int = 32  # tau: steps between exact local thresholds (128 for BERT)
        global_recompute_every: int = 32  # tau': steps between exact global top-k (128 for BERT)
        repartition_every: int = 64  # steps between region re-partitions
        local_up: float = 1.012  # local threshold x this when > band_upper*k selected (BERT 1.025)
        local_down: float = 1.012  # local threshold / this when < band_lower*k selected
        global_up: float = 1.008  # global threshold x this when > band_upper*k kept (BERT 1.025)
        global_down: float = 1.01  # global threshold / this when < band_lower*k kept (BERT 1.036)
        band_lower: float = 0.75  # lower edge of the accepted count band, in units of k
        band_upper: float = 1.25  # upper edge of the accepted count band, in units of k
        guard_factor: float = 1.5  # reused local threshold raised while > guard_factor*k pass
        guard_scale: float = 1.03  # factor of each guard raise
        guard_loops: int = 5  # at most this many guard raises per step (0: off)
        balance: bool = False  # release control: balance kept entries before the allgather (BERT: on)
        schedule: str = "alltoall"  # split-and-reduce: one all_to_all, or P-1 explicit rotated rounds
        threshold_control: str = "bounded"  # bounded: volume < volume_budget*k every step; release: nudges
        volume_budget: float = 6.0  # bounded control: elements sent per rank and step stay below this * k
        balance_when: str = "over_budget"  # bounded control: balance when the plain allgatherv would break the
        # budget ("over_budget": a collective fewer on most steps) or whenever it sends fewer elements ("cheaper")

        def validate(self) -> None:
            super().validate()
            for name in ("local_recompute_every", "global_recompute_every", "repartition_every"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.schedule not in SCHEDULES:
                raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
            if self.threshold_control not in CONTROLS:
                raise ValueError(f"threshold_control must be one of {CONTROLS}, got {self.threshold_control!r}")
            if self.balance_when not in BALANCE_WHEN:
                raise ValueError(f"balance_when must be one of {BALANCE_WHEN}, got {self.balance_when!r}")
            if self.volume_budget < 2:
                raise ValueError(f"volume_budget must be >= 2 (units of k), got {self.volume_budget}")
            self.local_thresholds().validate()
            self.global_thresholds().validate()

        @property
        def bounded(self) -> bool:
            return self.threshold_control == "bounded"

        def local_thresholds(self) -> ThresholdOptions:
            if self.bounded:  # no guard: the cap replaces it (exact threshold when out of [lower*k, k])
                return ThresholdOptions(self.local_recompute_every, self.band_lower, self.band_upper,
                                        self.local_up, self.local_down, guard_loops=0, cap=1.0)
            return ThresholdOptions(self.local_recompute_every, self.band_lower, self.band_upper,
                                    self.local_up, self.local_down, self.guard_factor, self.guard_scale,
                                    self.guard_loops)

        def global_thresholds(self) -> ThresholdOptions:
            return ThresholdOptions(self.global_recompute_every, self.band_lower, self.band_upper,
                                    self.global_up, self.global_down, guard_loops=0)

    def setup_sparse(self) -> None:
        self.local = ThresholdEstimator(self.options.local_thresholds())
        self.global_ = ThresholdEstimator(self.options.global_thresholds())
        self.regions = Regions(equal_boundaries(self.n, self.comm.size))
        self.window_bins = window_bins(self.k, self.comm.size)

    # ---- one step ------------------------------------------------------------------------------
    def sparse_step(self, acc: torch.Tensor, step: int) -> SparseUpdate:
        o, k = self.options, self.k
        marks = (self.local.exact_computations, self.local.recomputes, self.global_.exact_computations,
                 self.window["global_recomputes"])
        with self.selecting() as box:
            selected, values = self.local.select_pairs(acc, k, step)  # guarded (or capped), then nudged
            box[0] = selected.numel()
        self.note("local_selected", selected.numel())

        repartition = step % o.repartition_every == 0
        if repartition:
            with self.phase("repartition"):
                self.regions = Regions(balanced_boundaries(self.comm, selected, self.n))
        with self.phase("split"):
            r_idx, r_val = split_and_reduce(self.comm, selected, values, self.regions,
                                            sorted_indices=True, schedule=o.schedule)
        self.note("region_reduced", r_idx.numel())

        if o.bounded:
            g_idx, g_val = self._bounded_global(r_idx, r_val, step)
        elif self.global_.due(step):
            g_idx, g_val = self._exact_global(r_idx, r_val)
            self.note("exact_global_steps", 1)
        else:
            g_idx, g_val = self._thresholded_global(r_idx, r_val)
            self.global_.observe(g_idx.numel(), k)
        self.note("global_selected", g_idx.numel())
        after = (self.local.exact_computations, self.local.recomputes, self.global_.exact_computations,
                 self.window["global_recomputes"])
        self.note("recompute_steps", float(repartition or after != marks))

        # eps keeps acc except where this rank sent the entry and it was kept globally: a mask
        # over acc (no compaction, no host sync).
        kept = torch.zeros(self.n, dtype=torch.bool, device=acc.device)
        kept[g_idx] = True
        applied = torch.zeros_like(kept)
        applied[selected] = kept[selected]
        return SparseUpdate(g_idx, g_val / self.comm.size, applied)

    def _exact_global(self, r_idx: torch.Tensor, r_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Allgather every reduced region; keep the exact global top-k (the release's tau' step)."""
        with self.phase("allgather"):
            all_idx, all_val, _ = allgatherv_pairs(self.comm, r_idx, r_val, self.n)
        with self.selecting():
            if self.k >= all_val.numel():
                keep = compact(all_val != 0)
                self.global_.set_exact(0.0)
            else:
                top = torch.topk(all_val.abs(), self.k, sorted=False)
                keep = torch.sort(top.indices).values   # regions come in index order: stay sorted
                keep = keep[all_val[keep] != 0]
                self.global_.set_exact(float(top.values.min()))
        return all_idx[keep], all_val[keep]

    def _bounded_global(self, r_idx: torch.Tensor, r_val: torch.Tensor, step: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounded control: keep at most ``cap`` (<= k) reduced entries in all, chosen by a threshold
        recomputed (without moving values) when due or when the reused one leaves [lower*k, cap];
        then allgather them, balanced when that is cheaper for the busiest rank."""
        p, k, me = self.comm.size, self.k, self.comm.rank
        thr = self.global_.value
        window = Window.around(thr, r_val.dtype, self.window_bins) if thr is not None and self.window_bins else None
        with self.selecting():
            keep = at_least(r_val, thr) if thr is not None else torch.zeros_like(r_val, dtype=torch.bool)
        with self.phase("allgather"):
            # one allgather, read on the host once: every rank's kept count, the spread of its
            # non-zero values (which starts a threshold search), the elements it sent so far, and
            # its histogram around the threshold (which answers most searches at once)
            parts = [keep.sum().reshape(1), local_spread(r_val),
                     torch.full((1,), self.step_sent(), dtype=torch.int64, device=r_val.device)]
            mine = torch.cat(parts + ([window.local_counts(r_val)] if window else []))
            table = self.comm.all_gather(mine.to(self.comm.device)).tolist() if p > 1 else [mine.tolist()]
            if p > 1:
                self.comm.stats.relabel_last("sparse_counts")
        counts = [row[0] for row in table]
        spent = max(row[TABLE_FIELDS - 1] for row in table)
        spread = Spread.combine([row[1:1 + SPREAD_FIELDS] for row in table])
        due = self.global_.due(step)
        cap = self._global_cap(spent, probes=0, window=window)  # no search this step: none reserved
        allowance = self._allowance(spent, probes=0, window=window)
        low = int(min(self.options.band_lower * k, cap))
        if due or not low <= sum(counts) <= cap:
            if spread.nonzero <= cap:  # every non-zero entry fits: threshold 0, no search, counts known
                thr, counts = 0.0, [row[1] for row in table]
            else:
                thr, counts, probes = self._recompute(r_val, table, window, spread, spent, due)
                allowance = self._allowance(spent, probes, window)
            if due:
                self.global_.set_exact(thr)
                self.note("exact_global_steps", 1)
            else:
                self.global_.value = thr
                self.note("global_recomputes", 1)
            keep = at_least(r_val, thr)
            if counts is None:
                with self.phase("allgather"):
                    counts = gather_counts(self.comm, int(keep.sum()), r_val.device) if p > 1 else [int(keep.sum())]
        # this rank's kept count is known on the host: positions without another host read
        where = torch.nonzero_static(keep, size=counts[me]).view(-1)
        s_idx, s_val = r_idx[where], r_val[where]
        total = sum(counts)
        if p == 1 or total == 0:
            return s_idx, s_val
        # Busiest rank's elements: a plain allgatherv against balancing (its surplus is at most
        # K - floor(K/P)) + an allgather of equal slices. Balancing costs a collective more: by
        # default it runs only when the plain allgatherv would take the busiest rank past the
        # budget. Every rank knows the counts and the table: all choose alike.
        width = -(-total // p)
        balanced = 2 * min(max(counts), total - total // p) + 2 * (p - 1) * width
        plain = 2 * (p - 1) * max(counts)
        if plain <= balanced or (self.options.balance_when == "over_budget" and plain <= allowance):
            with self.phase("allgather"):
                g_idx, g_val, _ = allgatherv_pairs(self.comm, s_idx, s_val, self.n, counts)
            return g_idx, g_val
        with self.phase("balance"):
            slices, owned = balance_pairs(self.comm, Pairs.pack(s_idx, s_val, self.n), counts)
        with self.phase("allgather"):
            return allgather_equal(self.comm, slices, owned)

    def _recompute(self, r_val: torch.Tensor, table: list[list[int]], window: Window | None, spread: Spread,
                   spent: int, due: bool) -> tuple[float, list[int] | None, int]:
        """The new global threshold; when the table already holds them, every rank's count at it
        (None: gather them); and the elements reserved for the search (0 when none ran). The cap
        reserves the worst case of a search over the spread; an edge of the gathered window
        histogram whose count is in the band answers without one."""
        p, k = self.comm.size, self.k
        bins = bins_within(k / 2, r_val.dtype, p, spread)
        probes = probe_cost_bound(r_val.dtype, p, bins, spread) + (p - 1)
        cap = self._global_cap(spent, probes=probes, window=window)
        low = int(min(self.options.band_lower * k, cap))
        quarter = (cap - low) // 4
        # due: the exact top-cap; otherwise the middle half of the band (a drifting count stays in it)
        k_max, k_min = cap - (0 if due else quarter), cap if due else low + quarter
        start = None
        if window is not None:
            ranks = [window.at_edges(row[TABLE_FIELDS:]) for row in table]
            every = [sum(col) for col in zip(*ranks, strict=True)]
            fits = [j for j, c in enumerate(every) if k_min <= c <= k_max]
            if fits:
                best = min(fits, key=lambda j: (abs(every[j] - (k_min + k_max) / 2), -j))
                self.note("window_answers", 1)
                return from_bits(window.edges[best], r_val.dtype), [counts[best] for counts in ranks], 0
            start = window.start(every, k_max, spread)
        with self.phase("threshold"):
            thr = distributed_threshold(self.comm, r_val, k_max, k_min, bins=bins, spread=spread, start=start)
        return thr, None, probes

    def _allowance(self, spent: int, probes: int, window: Window | None = None) -> float:
        """Elements the busiest rank may still send after the count table (and ``probes``, a
        threshold search and its count allgather when one runs) without reaching the budget: it
        had sent ``spent`` before the table, which costs TABLE_FIELDS + the window's bins + 1
        elements to each of the P-1 other ranks."""
        p, k = self.comm.size, self.k
        table = (TABLE_FIELDS + (window.bins + 1 if window else 0)) * (p - 1)
        return self.options.volume_budget * k - 1 - spent - table - probes

    def _global_cap(self, spent: int, probes: int, window: Window | None = None) -> int:
        """Largest total K of kept entries whose allgather keeps every rank below the budget: a
        rank's balance surplus 2(K - floor(K/P)) and the allgather of the balanced slices
        2(P-1)ceil(K/P) are together <= 4K(P-1)/P + 2P, which must fit :meth:`_allowance`."""
        p, k = self.comm.size, self.k
        if p == 1:
            return k
        left = self._allowance(spent, probes, window) - 2 * p
        return max(0, min(k, int(left * p // (4 * (p - 1)))))

    def _thresholded_global(self, r_idx: torch.Tensor, r_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this region's reduced entries above the reused global threshold; allgather them."""
        with self.selecting():
            where = compact(at_least(r_val, self.global_.value))
            s_idx, s_val = r_idx[where], r_val[where]
        if not self.options.balance:
            with self.phase("allgather"):
                g_idx, g_val, _ = allgatherv_pairs(self.comm, s_idx, s_val, self.n)
            return g_idx, g_val
        with self.phase("allgather"):
            counts = gather_counts(self.comm, s_idx.numel(), s_val.device)
        if self.comm.size == 1 or sum(counts) == 0:
            return s_idx, s_val
        with self.phase("balance"):
            slices, owned = balance_pairs(self.comm, Pairs.pack(s_idx, s_val, self.n), counts)
        with self.phase("allgather"):
            return allgather_equal(self.comm, slices, owned)

    # ---- reporting and state -------------------------------------------------------------------
    def extra_metrics(self) -> dict[str, float]:
        out = {}
        if self.local.value is not None:
            out["local_threshold"] = self.local.value
        if self.global_.value is not None:
            out["global_threshold"] = self.global_.value
        if self.options.bounded:
            out["local_recomputes"] = float(self.local.recomputes)   # cumulative
        return out

    def method_state(self) -> dict:
        return {"local": self.local.state_dict(), "global": self.global_.state_dict(),
                "boundaries": list(self.regions.bounds)}

    def load_method_state(self, state: dict) -> None:
        if state:
            self.local.load_state_dict(state["local"])
            self.global_.load_state_dict(state["global"])
            self.regions = Regions(state["boundaries"])
