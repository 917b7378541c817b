"""Count-bounded thresholds over values spread across ranks (Ok-Topk's global selection, Li & Hoefler,
PPoPP'22, section 3, with the bounded threshold control of :mod:`commlab.algorithms.oktopk`).

:func:`distributed_threshold` finds a threshold t such that the number of entries with
|x| >= t (x != 0), summed over every rank, lies in [k_min, k_max], without moving the values: a
radix search on the bit pattern of |x| (a non-negative float's bits order like the float).
Every round counts ``bins`` candidate thresholds at once: each rank histograms the bit patterns
of its entries that fall in the current interval into ``bins`` equal slices, one allreduce sums
the histograms, and every rank reads the same global counts at the slice edges. An edge whose
count lies in the band answers; otherwise the interval shrinks to the slice where the count
crosses k_max, and the next round splits that slice. The interval starts at the ranks' smallest
and largest non-zero patterns (their :func:`local_spread`, combined), so with 256 bins any
float32 band is found in at most 4 rounds (256^4 = 2^32 patterns); float64 needs up to 8.

Invariants: with k_min = k_max = k the result selects exactly the global top-k (an edge strictly
above the (k+1)-th largest and at most the k-th); when ties at the boundary make the band
unreachable it is the smallest threshold selecting at most k_max, so the cap holds whatever the
data; every rank gets the same threshold. Each round is one allreduce of ``bins`` int64 counts
and one host read of them; nothing else leaves the device. :func:`probe_cost_bound` is the
worst-case number of elements a search sends. :func:`threshold_search` takes an element budget
instead: it stops before a round the budget cannot pay, under the cap (Ok-Topk's bounded
control gives a search what the reserve for its allgather leaves of the 6k budget), and
:func:`bins_within` chooses the bins for a budget.

    t = distributed_threshold(comm, region_values, k_max=k, k_min=k)   # exact global top-k
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from commlab.compress.floatbits import from_bits, to_bits
from commlab.core.communicator import ring_allreduce_cost

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
DEFAULT_BINS = 256


def _int_view(dtype: torch.dtype) -> torch.dtype:
    if dtype.itemsize not in _BITS or not dtype.is_floating_point:
        raise ValueError(f"no integer view for values of dtype {dtype}")
    return _BITS[dtype.itemsize]


def _patterns(dtype: torch.dtype) -> int:
    """Bit patterns of the non-negative values of ``dtype`` (the sign bit is 0)."""
    return 2 ** (8 * dtype.itemsize - 1)


def search_rounds(span: int, bins: int) -> int:
    """Rounds that split an interval of ``span`` bit patterns into single patterns, ``bins`` slices
    a round: the most any search over it takes."""
    rounds, reach = 1, bins
    while reach < span:
        rounds, reach = rounds + 1, reach * bins
    return rounds


def max_rounds(dtype: torch.dtype, bins: int = DEFAULT_BINS) -> int:
    """Worst-case rounds of :func:`distributed_threshold` for ``dtype`` values (any spread)."""
    return search_rounds(_patterns(dtype), bins)


def probe_cost_bound(dtype: torch.dtype, p: int, bins: int = DEFAULT_BINS, spread: Spread | None = None) -> int:
    """Worst-case elements sent per rank by :func:`distributed_threshold`: its rounds' ring
    allreduces of ``bins`` counts (as many rounds as ``spread``'s interval can take, or any
    interval of ``dtype`` with the allgather of the spread when the caller has not gathered it;
    nothing alone)."""
    if p == 1:
        return 0
    per_round = round_cost(bins, p)
    if spread is None:
        return max_rounds(dtype, bins) * per_round + SPREAD_FIELDS * (p - 1)
    return search_rounds(spread.hi + 1 - spread.lo, bins) * per_round


def round_cost(bins: int, p: int) -> int:
    """Elements the busiest rank sends in one round of a search: a ring allreduce of ``bins`` counts."""
    return max(ring_allreduce_cost(bins, p, i)[0] for i in range(p)) if p > 1 else 0


BINS = (4, 8, 16, 32, 64, 128, 256)  # the bins a search may count per round
SEARCH_ROUNDS = 8  # the most rounds a budgeted search takes (each is a host read): float64's worst case at 256 bins


def bins_within(budget: float, dtype: torch.dtype, p: int, spread: Spread | None = None,
                rounds: int = SEARCH_ROUNDS) -> int:
    """Bins per round for a search that may send ``budget`` elements in ``rounds`` rounds: the
    most of :data:`BINS` whose worst case over ``spread`` (:func:`probe_cost_bound`) fits both;
    when none does, those that split the interval finest in the rounds the budget pays (the more
    bins among equals): few bins cost fewer elements per bit found, more bins fewer rounds."""
    if p == 1:
        return DEFAULT_BINS
    span = _patterns(dtype) if spread is None else spread.hi + 1 - spread.lo
    fitting = [bins for bins in BINS
               if probe_cost_bound(dtype, p, bins, spread) <= budget and search_rounds(span, bins) <= rounds]
    if fitting:
        return max(fitting)
    return max(BINS, key=lambda bins: (min(int(budget // round_cost(bins, p)), rounds) * math.log2(bins), bins))


SPREAD_FIELDS = 3  # non-zero count, largest and minus the smallest non-zero bit pattern


def _magnitude_bits(values: torch.Tensor) -> torch.Tensor:
    """The bit patterns of |values| as int64 (order like the magnitudes)."""
    flat = values.reshape(-1)
    return flat.abs().view(_int_view(flat.dtype)).to(torch.int64)


def local_spread(values: torch.Tensor) -> torch.Tensor:
    """This rank's [non-zero count, largest pattern, -smallest non-zero pattern] of |values| (int64,
    on the values' device): what :class:`Spread` combines over ranks (sum, max, max)."""
    bits = _magnitude_bits(values)
    inf = _inf_bits(values.dtype)
    if bits.numel() == 0:
        return torch.tensor([0, 0, -(inf + 1)], dtype=torch.int64, device=bits.device)
    live = (bits > 0) & (bits <= inf)  # non-zero and not NaN
    top = torch.where(live, bits, 0).amax()
    low = torch.where(live, bits, inf + 1).amin()
    return torch.stack([live.sum(), top, -low])


def _inf_bits(dtype: torch.dtype) -> int:
    return to_bits(math.inf, dtype)


@dataclass(frozen=True)
class Spread:
    """Where the non-zero magnitudes of every rank lie: how many there are in all (``nonzero``)
    and the largest and smallest of their bit patterns (``hi``, ``lo``)."""

    nonzero: int
    hi: int
    lo: int

    @classmethod
    def combine(cls, rows: list[list[int]]) -> Spread:
        """From every rank's :func:`local_spread` (as host lists)."""
        return cls(sum(r[0] for r in rows), max(r[1] for r in rows), -max(r[2] for r in rows))


def gather_spread(comm, values: torch.Tensor) -> Spread:
    """Every rank's :func:`local_spread`, combined (one allgather of 3 int64 per rank)."""
    mine = local_spread(values).to(comm.device)
    if comm.size == 1:
        return Spread.combine([mine.tolist()])
    rows = comm.all_gather(mine).tolist()
    comm.stats.relabel_last("sparse_threshold_spread")
    return Spread.combine(rows)


@dataclass(frozen=True)
class Window:
    """``bins`` slices of ``width`` bit patterns from pattern ``lo``: a histogram every rank can
    send along with other counts (Ok-Topk's table), from which every rank then knows every rank's
    count at every slice edge, with no collective of its own."""

    lo: int
    width: int
    bins: int

    @classmethod
    def around(cls, threshold: float, dtype: torch.dtype, bins: int) -> Window:
        """Slices of 1/32 of an octave, ``bins`` of them centred on ``threshold``'s pattern."""
        width = 2 ** max(0, round(-math.log2(torch.finfo(dtype).eps)) - 5)
        return cls(max(1, to_bits(threshold, dtype) - bins // 2 * width), width, bins)

    @property
    def edges(self) -> list[int]:
        return [self.lo + j * self.width for j in range(self.bins + 1)]

    def local_counts(self, values: torch.Tensor) -> torch.Tensor:
        """[entries at or above the last edge, then per slice] of this rank (int64, on device)."""
        bits = _magnitude_bits(values)
        top = self.edges[-1]
        slot = torch.where(bits >= top, 0, torch.where(bits >= self.lo, 1 + (bits - self.lo) // self.width,
                                                       self.bins + 1))
        return torch.zeros(self.bins + 2, dtype=torch.int64, device=bits.device).index_add_(
            0, slot, torch.ones_like(slot))[:self.bins + 1]

    def at_edges(self, counts: list[int]) -> list[int]:
        """Entries at or above each edge, from :meth:`local_counts` (one rank's, or their sum)."""
        out = [counts[0]] * (self.bins + 1)
        for j in range(self.bins - 1, -1, -1):
            out[j] = out[j + 1] + counts[1 + j]
        return out

    def start(self, at_edges: list[int], k_max: int, spread: Spread) -> tuple[int, int, int]:
        """Where a search for a count <= k_max starts, from the global counts at the edges: the
        slice (or the part of the spread outside the window) where the count crosses k_max, as
        (lo, hi, entries above hi): ``distributed_threshold``'s ``start``."""
        edges = self.edges
        first = next((j for j, c in enumerate(at_edges) if c <= k_max), None)
        if first is None:  # still more than k_max at the last edge: above the window
            return edges[-1], spread.hi, 0
        if first == 0:  # below the window
            return spread.lo, edges[0] - 1, at_edges[0]
        return edges[first - 1], edges[first] - 1, at_edges[first]


@dataclass(frozen=True)
class Search:
    """What :func:`threshold_search` found: the threshold, the histogram rounds it ran, and
    whether its element budget ended it before the band was reached (``cut``)."""

    threshold: float
    rounds: int = 0
    cut: bool = False


def distributed_threshold(comm, values: torch.Tensor, k_max: int, k_min: int | None = None, *,
                          bins: int = DEFAULT_BINS, spread: Spread | None = None,
                          start: tuple[int, int, int] | None = None) -> float:
    """A threshold selecting between ``k_min`` and ``k_max`` entries of all ranks' ``values``
    together (|x| >= t, x != 0), the smallest one selecting at most ``k_max`` when no threshold
    fits the band. Every rank of ``comm`` calls it with its own values and gets the same result:
    :func:`threshold_search`'s threshold, without a budget."""
    return threshold_search(comm, values, k_max, k_min, bins=bins, spread=spread, start=start).threshold


def threshold_search(comm, values: torch.Tensor, k_max: int, k_min: int | None = None, *,
                     bins: int = DEFAULT_BINS, spread: Spread | None = None,
                     start: tuple[int, int, int] | None = None, budget: int | None = None,
                     round_limit: int | None = None) -> Search:
    """:func:`distributed_threshold`, reporting its rounds, and with an element budget.

    ``bins`` thresholds are counted per round (one allreduce of ``bins`` counts); ``spread``, when
    the caller already gathered every rank's :func:`local_spread`, saves the allgather that
    starts the search; ``start`` = (lo, hi, entries above hi), patterns between which the count
    is known to cross k_max (from a :class:`Window`), narrows the first round to them.
    ``budget`` (elements this rank may send in all, at least one round's :func:`round_cost` and
    the spread's allgather when it runs) stops the search before a round it cannot afford, and
    ``round_limit`` after that many rounds: the result is then the smallest threshold known to
    select at most ``k_max`` (``cut``), at most one slice of the last round above the band."""
    k_min = k_max if k_min is None else k_min
    if not 0 <= k_min <= k_max:
        raise ValueError(f"need 0 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
    if bins < 2:
        raise ValueError(f"bins must be at least 2, got {bins}")
    if round_limit is not None and round_limit < 1:
        raise ValueError(f"round_limit must be at least 1, got {round_limit}")
    per_round = round_cost(bins, comm.size)
    spent = SPREAD_FIELDS * (comm.size - 1) if spread is None else 0  # the spread's allgather
    if budget is not None and budget < spent + per_round:
        raise ValueError(f"a budget of {budget} elements cannot pay one round ({spent + per_round})")
    spread = gather_spread(comm, values) if spread is None else spread
    if spread.nonzero <= k_max:
        return Search(0.0)
    bits = _magnitude_bits(values)
    target = (k_min + k_max) / 2
    # Invariant: count(lo) > k_max >= count(hi + 1) = above.
    lo, hi, above = start if start is not None else (spread.lo, spread.hi, 0)
    rounds = 0
    while True:
        if (budget is not None and spent + (rounds + 1) * per_round > budget) or rounds == round_limit:
            return Search(from_bits(hi + 1, values.dtype), rounds, cut=True)
        rounds += 1
        width = -(-(hi + 1 - lo) // bins)
        slot = torch.where((bits >= lo) & (bits <= hi), (bits - lo) // width, torch.full_like(bits, bins))
        hist = torch.zeros(bins + 1, dtype=torch.int64, device=bits.device).index_add_(
            0, slot, torch.ones_like(slot))[:bins].to(comm.device)
        if comm.size > 1:
            comm.all_reduce(hist, op="sum")
            comm.stats.relabel_last("sparse_threshold_histogram")
        counts = hist.tolist()
        used = -(-(hi + 1 - lo) // width)  # slices that start inside the interval
        # at_edge[j]: entries with pattern >= lo + j*width (j = used: the interval's end, hi + 1)
        at_edge = [above] * (used + 1)
        for j in range(used - 1, -1, -1):
            at_edge[j] = at_edge[j + 1] + counts[j]
        edges = [min(lo + j * width, hi + 1) for j in range(used + 1)]
        fits = [j for j in range(used + 1) if k_min <= at_edge[j] <= k_max]
        if fits:  # the edge whose count is nearest the band's middle (the higher threshold on ties)
            best = min(fits, key=lambda j: (abs(at_edge[j] - target), -j))
            return Search(from_bits(edges[best], values.dtype), rounds)
        first = next(j for j in range(used + 1) if at_edge[j] <= k_max)  # exists: at_edge[used] = above
        if width == 1:  # single patterns: a tie straddles the band, take the smallest edge under the cap
            return Search(from_bits(edges[first], values.dtype), rounds)
        lo, hi, above = edges[first - 1], edges[first] - 1, at_edge[first]
