"""Ok-Topk: sparse allreduce with residuals, reused thresholds and balanced regions (Li & Hoefler,
PPoPP'22, sections 3 and 4; released as Shigangli/Ok-Topk, LSTM/VGG allreducer).

Per step, after ``warmup_steps`` dense steps, every rank holds acc = g + eps (eps: its residual):

1. **Local selection**: the entries of acc above a local threshold, about its top-k.
2. **Regions**: every ``repartition_every`` steps the index space is re-split into P regions
   holding balanced numbers of selected entries (boundaries averaged over the ranks).
3. **Split and reduce**: rank j receives every rank's selected pairs of region j and sums them
   (:func:`commlab.core.sparse.split_and_reduce`, destinations rotated).
4. **Global selection**: the reduced entries above a global threshold, about the top-k of the
   reduced sum (the ranks' selected entries summed, not their whole accumulations); every rank
   allgathers them (balanced first when needed).
5. The update is the kept sums divided by P; eps becomes acc with the entries this rank sent
   *and* that were kept set to zero (:mod:`commlab.algorithms.sparse_common`).

Invariant: with exact thresholds every step (``local_recompute_every`` =
``global_recompute_every`` = 1) both controls below apply the paper's update: the global top-k of
the sum over ranks of every rank's local top-k selection of its acc, divided by P
(tests/test_oktopk_reference.py; the bounded control less what a trim leaves out, below). That
is not the top-k of the summed accumulations sum_r acc_r: an entry just outside every rank's
local top-k is never summed, however large its sum, so the two agree only at P = 1 (the test
pins a case where they differ). The release defines it so
(Shigangli/Ok-Topk, ``LSTM/allreducer.py``, ``AllReducer.run``, the ``oktopk`` branch): each
rank sends only its entries above the local threshold (``compressbythreshold`` per region),
the split-and-reduce sums those, and the tau' step keeps the top-k of the reduced values
(``k2globalthreshold``); the top-k of the dense sum appears there only as a profiling
comparison (``settings.PROFILING_NORM``).

**Threshold control** (``threshold_control``):

* ``release``: the release's. Local: the exact k-th largest |acc| every tau
  (``local_recompute_every``) steps, reused in between, guarded and nudged by ``local_up`` /
  ``local_down`` when the count leaves [``band_lower``·k, ``band_upper``·k]
  (:mod:`commlab.compress.threshold`). Global: every tau' (``global_recompute_every``) steps all
  reduced regions are allgathered and their exact top-k kept; in between the reused threshold is
  nudged by ``global_up`` / ``global_down``. The volume is not bounded: the exact step gathers up
  to P·k pairs, and nudged thresholds lag magnitudes that drift.
* ``bounded`` (the default): the same steps, with every rank sending fewer than
  ``volume_budget`` (6)·k elements in every step, the paper's bound:

  - local: exactly the top-k of |acc| every step (``ThresholdOptions.exact_k``: the reused
    threshold only narrows the candidates), so split-and-reduce sends at most 2k + P-1;
  - count table: one allgather of every rank's kept count at the reused global threshold, the
    spread of its reduced values (:class:`~commlab.compress.bounded.Spread`), the elements it
    has sent in the step, and its histogram around the threshold (:func:`window_bins` slices:
    :class:`~commlab.compress.bounded.Window`);
  - global: the reused threshold stays while the kept total lies in [``band_lower``·k,
    min(``band_upper``·k, K)], K the largest total whose allgather reserve
    (:func:`allgather_reserve`: 2P·ceil(K/P), every rank's share to the others and one share
    of surplus) fits the budget. Otherwise, and every tau' steps, it is recomputed without
    moving values (:func:`search_band`): the exact top-k when due, else a total within k/16 of
    k, both at most K. An edge of the table's histograms answers when its count fits; else a
    radix search on the values' bit patterns (:func:`~commlab.compress.bounded.threshold_search`)
    gets what the reserve leaves and, should that run out first, ends under the cap
    (``threshold_cuts``);
  - allgather: a plain allgatherv while it keeps the busiest rank under the budget
    (``balance_when: over_budget``) or costs less than balancing, else balanced first (surplus
    and equal slices, :func:`allgather_costs`). Every rank knows every count: all choose alike.
    Where the cheaper way does not fit what is left (one rank's region holds far more than its
    share), every count is first capped at the largest M for which it does
    (:func:`trim_counts`, M >= ceil(K/P)): the kept total is sum_r min(c_r, M), an over-full
    rank keeping its M largest, and the rest stays in the residuals (``trimmed``).

  Hence every phase is paid from what the ones before left of the budget: V < 6k at every step,
  whatever the data, the count exchanges, the table and a search included. The worst case of
  an allgather of K entries held by one rank, 4K(P-1)/P + 2P, is not reserved: reserved, it
  would hold the kept total below k wherever the slack 6k/P left by the paper's 6k(P-1)/P does
  not pay the count exchanges, the table and a search (k = 800 at P = 32). K reaches k while
  2P·ceil(k/P) fits what the split, the table, the count gather and one round leave; only
  where a region holds more than M of the kept entries does a step keep fewer.

Where we depart from the release, on purpose: indices travel in integer tensors (the release
packs int32 indices into float32 messages, wrong above 2^24) and nothing is staged through host
numpy; selection is |acc| >= threshold (the release's strict > drops the k-th entry); an exact
threshold is 0 when k reaches the number of candidates, so density 1 equals dense allreduce.

Messages (docs/performance.md): indices and values travel packed in one integer message
(:class:`~commlab.core.sparse.Pairs`). A bounded step is four collectives (the split's counts and
pairs, the count table, the allgather; a fifth when balancing) and four host reads (the local
compaction, the split's counts, the reduction's unique indices, the table); a recompute the table
answers adds nothing, a search one collective and one read per round and one for the new counts.

Metrics (``algo_<key>``, means per sparse step): ``local_selected``, ``region_reduced``,
``global_selected`` (entries applied), ``exact_global_steps``, ``global_recomputes``,
``window_answers``, ``threshold_cuts``, ``trimmed`` (entries the allgather's fit left out),
``recompute_steps`` (a threshold recomputed or regions re-split); ``local_recomputes``
(cumulative), the current ``local_threshold`` and ``global_threshold``; volumes as in
:mod:`commlab.algorithms.sparse_common` (``volume_over_k``, ``step_volume_over_k_max``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.sparse_common import SparseAlgorithm, SparseOptions, SparseUpdate
from commlab.compress.bounded import (
    SEARCH_ROUNDS,
    SPREAD_FIELDS,
    Spread,
    Window,
    bins_within,
    local_spread,
    round_cost,
    threshold_search,
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


def allgather_costs(counts: list[int]) -> tuple[int, int]:
    """Elements the busiest rank sends to allgather the kept entries that the ranks hold
    ``counts`` of: (plain allgatherv, balanced first). Plain: the largest count's pairs to each
    of the P-1 others, 2(P-1)·max. Balanced: its surplus, at most min(max, K - floor(K/P)) pairs,
    then equal slices of ceil(K/P) pairs to the P-1 others."""
    p, total, most = len(counts), sum(counts), max(counts)
    return 2 * (p - 1) * most, 2 * min(most, total - total // p) + 2 * (p - 1) * -(-total // p)


def allgather_reserve(total: int, p: int) -> int:
    """Elements kept back for the allgather of ``total`` kept entries before their counts are
    known: every rank's share ceil(K/P) to the P-1 others and a surplus of one share,
    2P·ceil(K/P) (at most 2K + 2P). What the busiest rank would need beyond it, should one rank
    hold more, is not reserved: :func:`trim_counts` fits the allgather to what is left."""
    return 0 if p == 1 else 2 * p * -(-total // p)


def reserve_cap(allowance: float, p: int, n: int) -> int:
    """Largest total K whose :func:`allgather_reserve` fits ``allowance`` (0 when none does; n alone)."""
    return n if p == 1 else max(0, int(allowance // (2 * p)) * p)


def trim_counts(counts: list[int], allowance: float) -> list[int]:
    """The counts the ranks allgather within ``allowance`` elements: ``counts`` when the cheaper
    way (:func:`allgather_costs`) fits; else every count capped at M, the largest cap whose
    cheaper way fits (both costs grow with the cap: a bisection). With :func:`allgather_reserve`
    left, M >= ceil(K/P): only a rank holding more than its share is ever trimmed. A trimmed rank
    keeps its M largest |values|; every rank knows every count, so all trim alike without a
    message."""
    if len(counts) == 1 or min(allgather_costs(counts)) <= allowance:
        return list(counts)
    lo, hi = 0, max(counts)  # min(costs) at cap lo fits allowance (or lo = 0), at cap hi it does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if min(allgather_costs([min(c, mid) for c in counts])) <= allowance else (lo, mid)
    return [min(c, lo) for c in counts]


def search_band(k: int, p: int, n: int, allowance: float, due: bool, dtype: torch.dtype,
                spread: Spread | None = None) -> tuple[int, int, int]:
    """Where a global recompute aims, given what the busiest rank may still send after the count
    table (``allowance``): (bins of its search, k_min, k_max). Due: exactly k; else within k/16
    of k. Both capped (:func:`reserve_cap`) so that the new counts' gather (P-1 elements), one
    round of ``bins`` and the allgather's reserve (:func:`allgather_reserve`) fit."""
    gather = p - 1
    bins = bins_within(min(k / 2, allowance - gather - allgather_reserve(k, p)), dtype, p, spread)
    k_max = min(k if due else k + k // 16, reserve_cap(allowance - gather - round_cost(bins, p), p, n))
    return bins, (k_max if due else min(k - k // 16, k_max)), k_max


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
        band_upper: float = 1.25  # upper edge of the accepted count band, in units of k (bounded: the local
        # threshold kept between steps passes about (1 + band_upper)/2 * k, of which the top-k is taken)
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
            if self.bounded:  # exactly the local top-k: the reused threshold only narrows the candidates
                return ThresholdOptions(self.local_recompute_every, self.band_lower, self.band_upper,
                                        self.local_up, self.local_down, guard_loops=0, exact_k=True)
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
        with self.selecting():
            selected, values = self.local.select_pairs(acc, k, step)  # release: guarded, nudged; bounded: top-k
        self.record_selected(selected.numel())

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
        """Bounded control: keep the reduced entries above a global threshold that is reused while
        the kept total stays in [lower*k, upper*k] and fits the budget, else recomputed (without
        moving values) to keep the exact top-k when due and about k otherwise; then allgather
        them, balanced when the plain allgatherv would break the budget, and an over-full
        region's rank trimmed to its largest when neither way fits (:func:`trim_counts`)."""
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
        allowance = self._allowance(spent, window)  # what the allgather may spend when nothing else runs
        high = min(int(self.options.band_upper * k), reserve_cap(allowance, p, self.n))
        if due or not min(int(self.options.band_lower * k), high) <= sum(counts) <= high:
            thr, counts, allowance = self._recompute(r_val, table, window, spread, allowance, due)
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
        fitted = trim_counts(counts, allowance)  # only where one rank holds more than the rest leaves it
        if fitted != counts:
            self.note("trimmed", sum(counts) - sum(fitted))
            if fitted[me] < counts[me]:
                with self.selecting():
                    top = torch.sort(torch.topk(s_val.abs(), fitted[me], sorted=False).indices).values
                    s_idx, s_val = s_idx[top], s_val[top]
            counts = fitted
        total = sum(counts)
        if p == 1 or total == 0:
            return s_idx, s_val
        # Busiest rank's elements: a plain allgatherv against balancing + an allgather of equal
        # slices. Balancing costs a collective more: by default it runs only when the plain
        # allgatherv would take the busiest rank past the budget. The cheaper fits (trim_counts).
        # Every rank knows the counts and the table: all choose alike.
        plain, balanced = allgather_costs(counts)
        if plain <= balanced or (self.options.balance_when == "over_budget" and plain <= allowance):
            with self.phase("allgather"):
                g_idx, g_val, _ = allgatherv_pairs(self.comm, s_idx, s_val, self.n, counts)
            return g_idx, g_val
        with self.phase("balance"):
            slices, owned = balance_pairs(self.comm, Pairs.pack(s_idx, s_val, self.n), counts)
        with self.phase("allgather"):
            return allgather_equal(self.comm, slices, owned)

    def _recompute(self, r_val: torch.Tensor, table: list[list[int]], window: Window | None, spread: Spread,
                   allowance: float, due: bool) -> tuple[float, list[int] | None, float]:
        """The new global threshold; every rank's count at it when the table already holds them
        (None: gather them); and what the allgather may still spend. Due: the exact top-k; else
        a total within k/16 of k. Both capped so that the allgather's reserve
        (:func:`allgather_reserve`) fits the budget after the count gather and one round of a
        search: a search gets what the reserve leaves, and ends under the cap if that runs out
        before the band (``threshold_cuts``)."""
        p = self.comm.size
        gather = p - 1  # the new counts, unless the table answers
        bins, k_min, k_max = search_band(self.k, p, self.n, allowance, due, r_val.dtype, spread)
        if spread.nonzero <= k_max:  # every non-zero entry fits: threshold 0, every count in the table
            return 0.0, [row[1] for row in table], allowance
        if k_max == 0:  # the budget is spent: keep nothing this step (above every value, no collective)
            self.note("threshold_cuts", 1)
            return from_bits(spread.hi + 1, r_val.dtype), [0] * p, allowance
        start = None
        if window is not None:
            ranks = [window.at_edges(row[TABLE_FIELDS:]) for row in table]
            every = [sum(col) for col in zip(*ranks, strict=True)]
            fits = [j for j, c in enumerate(every) if k_min <= c <= k_max]
            if fits:
                best = min(fits, key=lambda j: (abs(every[j] - (k_min + k_max) / 2), -j))
                self.note("window_answers", 1)
                return from_bits(window.edges[best], r_val.dtype), [counts[best] for counts in ranks], allowance
            start = window.start(every, k_max, spread)
        budget = allowance - gather - allgather_reserve(k_max, p)
        with self.phase("threshold"):
            found = threshold_search(self.comm, r_val, k_max, k_min, bins=bins, spread=spread, start=start,
                                     budget=int(budget) if p > 1 else None, round_limit=SEARCH_ROUNDS)
        self.note("threshold_cuts", float(found.cut))
        return found.threshold, None, allowance - gather - found.rounds * round_cost(bins, p)

    def _allowance(self, spent: int, window: Window | None = None) -> float:
        """Elements the busiest rank may still send after the count table without reaching the
        budget: it had sent ``spent`` before the table, which costs TABLE_FIELDS + the window's
        bins + 1 elements to each of the P-1 other ranks."""
        p, k = self.comm.size, self.k
        table = (TABLE_FIELDS + (window.bins + 1 if window else 0)) * (p - 1)
        return self.options.volume_budget * k - 1 - spent - table

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
