"""``commlab bench selection``: every registered selector against torch.topk and one read of the
tensor (Ok-Topk's estimated threshold vs exact top-k, Li & Hoefler, PPoPP'22, section 4; RedSync's
selectors, Fang et al., arXiv 1808.04357), on CPU and, when available, on CUDA.

For each device and size n (default 1M, 10M and 100M float32 normal entries) and k = density·n:

* ``read``: ``x.sum()``, one pass over the tensor: the memory-bandwidth floor of any selection;
* ``torch.topk``: ``torch.topk(x.abs(), k)``, the exact reference;
* every selector in ``SELECTORS`` (selectors registered later appear by themselves), a fresh
  instance called ``--calls`` rounds or more, all entries interleaved round by round (so that
  drift in the machine's load hits all alike): ``first`` is the first call (for stateful selectors
  the exact one), ``median`` the median of the later calls (their steady state), and for
  selectors that recompute every ``recompute_every`` calls ``amortized`` = (first + (T-1)·median)/T.

The tensor changes from round to round (``--stream drifting``, the default) as a residual does in
training: x ← 0.9·x + s_t·noise with a scale s_t that grows by ``--drift`` per round, so a selector
that reuses a threshold pays for its corrections, and one that does not correct selects too many
or too few: ``selected_over_k`` is the median count over k and ``selected_over_k_max`` the worst
call. ``--stream fixed`` calls every entry on one tensor (the lower bound of a reused threshold).

Beside them, ``order_statistics``: the order statistic Ok-Topk's re-aim reads (its bounded
control's exact-k selection, :meth:`commlab.compress.threshold.ThresholdEstimator.select_pairs`):
when more than 5k/4 entries pass a reused threshold, the threshold kept is the ⌈9k/8⌉-th largest
among them, read from an unsorted top-⌈9k/8⌉ of those entries. Here the entries passing are the
⌈5k/4⌉ + 1 largest |x| (the fewest that call for a re-aim), in the order an unsorted top-k leaves
them; the rank is read by ``torch.kthvalue``, by numpy's partition (the CPU's way) and by one
sort (the GPU's; :func:`commlab.compress.threshold.largest_at_ranks`), in shuffled rounds like the
selectors'.

The JSON holds every timing with ``ratio_topk`` = median / torch.topk and ``ratio_read`` =
median / read (both < 1 is impossible for ratio_read: it is the floor), and each entry's
``bytes_per_element``: the bytes its torch calls read and write in one steady-state call, over n,
on torch's passes (:func:`commlab.compress.scan.portable_passes`: the kernels of our own that the
timings use, numpy and C on the CPU and Triton on a GPU, are not seen by
:class:`commlab.bench.opcount.TrafficCounter`); one read of float32 is 4; work inside one kernel,
such as topk's radix passes, is not seen either. The markdown table is printed. Timings on
CUDA are synchronised around every call.

    commlab bench selection                                   # 1M, 10M, 100M on cpu (and cuda)
    commlab bench selection --sizes 1000000 10000000 --calls 5 --json /tmp/sel.json
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from commlab.bench.common import add_output_arguments, bench_parser, md_table, parse_size, write_report
from commlab.bench.opcount import TrafficCounter
from commlab.compress.base import k_for_density
from commlab.compress.scan import portable_passes
from commlab.compress.threshold import largest_by_partition, largest_by_sort
from commlab.registry import BENCHMARKS, SELECTORS

DEFAULT_SIZES = [1_000_000, 10_000_000, 100_000_000]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _timed(fn, device: torch.device, clock=time.perf_counter):
    """(seconds, result) of one call, synchronised on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - t0, out


class TensorStream:
    """The tensors of successive rounds: one fixed tensor, or a drifting residual-like stream
    x ← 0.9·x + s_t·noise, s_t = drift^t (seeded, on ``device``)."""

    def __init__(self, n: int, device: torch.device, seed: int, drifting: bool = True, drift: float = 1.02):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.randn(n, generator=self.generator, device=device)
        self.drifting, self.drift, self.scale = drifting, drift, 1.0

    def next(self) -> torch.Tensor:
        if self.drifting:
            self.scale *= self.drift
            noise = torch.randn(self.x.shape, generator=self.generator, device=self.x.device)
            self.x.mul_(0.9).add_(noise, alpha=self.scale)
        return self.x


def _one_round(calls: dict, device: torch.device, clock: str, shuffler: random.Random) -> list[tuple]:
    """(name, seconds, result) of one call of each of ``calls`` (name -> function), in an order
    ``shuffler`` draws afresh each round (why: :func:`measure`)."""
    return [(name, *_timed(calls[name], device, CLOCKS[clock])) for name in shuffler.sample(list(calls), len(calls))]


def measure(stream: TensorStream, k: int, calls: int, budget: float, min_seconds: float = 2.0,
            clock: str = "wall", seed: int = 0) -> list[dict]:
    """Reference timings and every selector's, interleaved: in every round each entry is called
    once on that round's tensor, in an order shuffled from round to round (seeded by ``seed``),
    so that drift in the machine's load hits all entries alike and no entry always follows the
    same one: what ran just before a call (the caches and the threads it leaves) changes the
    call's time. A rotated order kept every entry behind the same neighbour: at 4M elements
    threshold estimation, always after Gaussian-k, measured 2.36-2.45x one read there against
    1.78-2.05x shuffled (same machine, 4 streams each). At least ``calls`` rounds and
    ``min_seconds``; at most 8x ``calls`` rounds, and no new round once ``budget`` seconds are
    spent."""
    current = [stream.x]
    device = stream.x.device
    entries = {"read (x.sum)": (lambda: current[0].sum(), None),
               "torch.topk": (lambda: torch.topk(current[0].abs(), k, sorted=False), None)}
    for name in SELECTORS.names():
        select = SELECTORS.get(name)()
        entries[name] = (lambda select=select: select(current[0], k), select)
    names, calls_of = list(entries), {name: entry[0] for name, entry in entries.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    selected: dict[str, list[int]] = {}
    spent, rounds, shuffler = 0.0, 0, random.Random(seed)
    while rounds < calls or (spent < min_seconds and rounds < 8 * calls):
        if rounds >= 3 and spent > budget:
            break
        if rounds:
            current[0] = stream.next()
        for name, seconds, out in _one_round(calls_of, device, clock, shuffler):
            times[name].append(seconds)
            spent += seconds
            if isinstance(out, torch.Tensor) and out.dtype == torch.int64:
                selected.setdefault(name, []).append(int(out.numel()))
        rounds += 1
    traffic = TrafficCounter()
    moved = {}
    for name in names:  # one more call of each on the last tensor, its GPU passes counted (not timed)
        traffic.reset()
        with portable_passes(), traffic:
            entries[name][0]()
        moved[name] = traffic.bytes / current[0].numel()
    read_s = statistics.median(times["read (x.sum)"][1:])
    topk_s = statistics.median(times["torch.topk"][1:])
    rows = []
    for name in names:
        ts = times[name]
        row = {"selector": name, "first_s": ts[0], "median_s": statistics.median(ts[1:]),
               "mean_s": statistics.fmean(ts), "calls": len(ts), "bytes_per_element": moved[name]}
        if name == "torch.topk":
            row["selected"] = k
        elif name in selected:
            row["selected"] = int(statistics.median(selected[name]))
            row["selected_over_k_max"] = max(selected[name]) / k
        period = getattr(entries[name][1], "recompute_every", None)
        if period:
            row["recompute_every"] = int(period)
            row["amortized_s"] = (ts[0] + (period - 1) * row["median_s"]) / period
            row["ratio_topk_amortized"] = row["amortized_s"] / topk_s
        row["ratio_topk"] = row["median_s"] / topk_s
        row["ratio_read"] = row["median_s"] / read_s
        if "selected" in row:
            row["selected_over_k"] = row["selected"] / k
        rows.append(row)
    return rows


MAX_CPU_KTHVALUE = 100_000  # k above which the CPU leaves kthvalue out (quadratic there)


def _largest_by_kthvalue(values: torch.Tensor, ranks: list[int]) -> list[float]:
    return torch.stack([torch.kthvalue(values, values.numel() - r + 1).values for r in ranks]).tolist()


def reaim_ranks(k: int, n: int) -> tuple[int, int]:
    """(entries passing, rank read) of Ok-Topk's re-aim at k of n entries: the fewest that call for
    one, ⌈5k/4⌉ + 1 (more than 5k/4), and the ⌈9k/8⌉-th largest among them."""
    passing = min(n, math.ceil(5 * k / 4) + 1)
    return passing, min(passing, math.ceil(9 * k / 8))


def order_statistics(x: torch.Tensor, k: int, rounds: int, clock: str = "wall", seed: int = 0) -> dict:
    """Median seconds of Ok-Topk's re-aim (:func:`reaim_ranks`): the ⌈9k/8⌉-th largest of the
    unsorted top-⌈9k/8⌉ of the entries passing (the ⌈5k/4⌉ + 1 largest |x|, in the order an
    unsorted top-k leaves them) by kthvalue, by numpy's partition (CPU only) and by one sort, in
    ``rounds`` rounds of one call each, shuffled as in :func:`measure` (the first round apart).
    kthvalue is left out on the CPU above k = :data:`MAX_CPU_KTHVALUE`: its quickselect is
    quadratic on the order in which an unsorted top-k leaves its values (docs/performance.md,
    section 2), a cost the benchmark's large sizes cannot afford."""
    passing, rank = reaim_ranks(k, x.numel())
    entries = torch.topk(x.abs(), passing, sorted=False).values
    top = torch.topk(entries, rank, sorted=False).values
    ranks = [rank]
    ways = {"sort": largest_by_sort}
    if x.device.type != "cpu" or k <= MAX_CPU_KTHVALUE:
        ways["kthvalue"] = _largest_by_kthvalue
    if x.device.type == "cpu":
        ways["partition"] = largest_by_partition
    calls = {name: (lambda way=way: way(top, ranks)) for name, way in ways.items()}
    times: dict[str, list[float]] = {name: [] for name in ways}
    shuffler = random.Random(seed)
    for _ in range(rounds + 1):
        for name, seconds, _out in _one_round(calls, x.device, clock, shuffler):
            times[name].append(seconds)
    return {"k": k, "passing": passing, "rank": rank,
            **{f"{name}_s": statistics.median(ts[1:]) for name, ts in times.items()}}


@BENCHMARKS.register("selection")
def selection(argv: list[str], json_path: str | None = None) -> int:
    """Exact top-k vs threshold estimation vs Gaussian-k vs every other registered selector."""
    parser = bench_parser("selection", __doc__)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=DEFAULT_SIZES,
                        help="tensor sizes in elements (default 1000000 10000000 100000000)")
    parser.add_argument("--density", type=float, default=0.01, help="k = density * n (default 0.01)")
    parser.add_argument("--calls", type=int, default=8,
                        help="rounds of calls per size, each entry once per round (default 8; more, up to 8x, "
                             "until 2 s are spent)")
    parser.add_argument("--budget", type=float, default=180.0,
                        help="no new round after this many seconds per size (at least 3 rounds; default 180)")
    parser.add_argument("--devices", nargs="+", choices=["cpu", "cuda"],
                        help="devices (default: cpu, and cuda when available)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time (default); cpu: this process's CPU time, robust to other "
                             "load on a shared machine (with --threads 1 it approximates an idle core; CPU only)")
    parser.add_argument("--stream", choices=["drifting", "fixed"], default="drifting",
                        help="drifting: a new residual-like tensor every round, its scale growing (default); "
                             "fixed: one tensor for every call")
    parser.add_argument("--drift", type=float, default=1.02,
                        help="growth of the drifting stream's noise scale per round (default 1.02)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the tensors and the order of the calls in each round (default 0)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.calls < 3 or not 0 < args.density <= 1:
        parser.error("need --calls >= 3 and 0 < --density <= 1")
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    if "cuda" in devices and not torch.cuda.is_available():
        parser.error("--devices cuda: no CUDA device here")
    if "cuda" in devices and args.clock == "cpu":
        parser.error("--clock cpu measures host CPU time: use it with --devices cpu")
    if args.threads:
        torch.set_num_threads(args.threads)

    results, skipped, ranked = [], [], []
    for dev in devices:
        device = torch.device(dev)
        for n in args.sizes:
            k = k_for_density(n, args.density)
            try:
                stream = TensorStream(n, device, args.seed, args.stream == "drifting", args.drift)
                rows = measure(stream, k, args.calls, args.budget, clock=args.clock, seed=args.seed)
                ranked.append({"device": dev, "elements": n,
                               **order_statistics(stream.x, k, max(args.calls, 5), args.clock, args.seed)})
            except (RuntimeError, MemoryError) as err:  # out of memory at the largest sizes
                skipped.append({"device": dev, "elements": n, "reason": str(err).splitlines()[0]})
                continue
            finally:
                stream = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for row in rows:
                results.append({"device": dev, "elements": n, "k": k, **row})
    if not torch.cuda.is_available():
        skipped.append({"device": "cuda", "reason": "no CUDA device on this machine: not measured"})

    table = [{**r, "first_ms": 1000 * r["first_s"], "median_ms": 1000 * r["median_s"],
              "amortized_ms": 1000 * r["amortized_s"] if "amortized_s" in r else None} for r in results]
    stream_text = (f"a drifting stream (x <- 0.9 x + s_t noise, s_t x{args.drift:g} per round)"
                   if args.stream == "drifting" else "one fixed tensor")
    md = [f"Selection of k = {args.density:g}·n of n float32 entries, {stream_text}; median of later calls "
          f"(first call apart), ratios to torch.topk(|x|, k) and to one read of x (x.sum()), bytes torch's "
          f"passes move per element in one steady-state call (the kernels of our own, C on the CPU and Triton on a "
          f"GPU, which the timings use, read about 4 plus what they select); "
          f"{args.clock} clock, {torch.get_num_threads()} thread(s).", "",
          md_table(table, [("device", "device"), ("elements", "n"), ("selector", "selector"),
                           ("first_ms", "first ms"), ("median_ms", "median ms"), ("amortized_ms", "amortized ms"),
                           ("ratio_topk", "x topk"), ("ratio_read", "x read"), ("bytes_per_element", "bytes/elem"),
                           ("selected_over_k", "selected / k"),
                           ("selected_over_k_max", "worst / k")])]
    md += ["", "Ok-Topk's re-aim: the ⌈9k/8⌉-th largest of the entries passing a reused threshold when more "
           "than 5k/4 pass (here the ⌈5k/4⌉ + 1 largest), read from their unsorted top-⌈9k/8⌉, median ms: "
           "torch.kthvalue, numpy's partition (the CPU's way), one sort (a GPU's).", "",
           md_table([{**r, **{f"{w}_ms": 1000 * r[f"{w}_s"] for w in ("kthvalue", "partition", "sort")
                              if f"{w}_s" in r}} for r in ranked],
                    [("device", "device"), ("elements", "n"), ("k", "k"), ("passing", "passing"),
                     ("rank", "rank read"), ("kthvalue_ms", "kthvalue ms"),
                     ("partition_ms", "partition ms"), ("sort_ms", "sort ms")])]
    md += [f"\nNot measured: {s['device']} {s.get('elements', '')}: {s['reason']}" for s in skipped]
    payload = {"density": args.density, "calls": args.calls, "budget_s": args.budget, "clock": args.clock,
               "stream": args.stream, "drift": args.drift if args.stream == "drifting" else None,
               "threads": torch.get_num_threads(), "results": results, "order_statistics": ranked,
               "skipped": skipped}
    write_report("selection", payload, "\n".join(md), args.json_path or json_path, args.out_dir)
    return 0
