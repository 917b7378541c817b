"""``commlab bench selection``: every registered selector against torch.topk and one read of the
tensor (PAPERS.md section 3: Ok-Topk's estimated threshold vs exact top-k; section 4: RedSync's
selectors), on CPU and, when available, on CUDA.

For each device and size n (default 1M, 10M and 100M float32 normal entries) and k = density·n:

* ``read``: ``x.sum()``, one pass over the tensor: the memory-bandwidth floor of any selection;
* ``torch.topk``: ``torch.topk(x.abs(), k)``, the exact reference;
* every selector in ``SELECTORS`` (selectors registered later appear by themselves), a fresh
  instance called up to ``--calls`` times on the same tensor (or until ``--budget`` seconds):
  ``first`` is the first call (for stateful selectors the exact one), ``median`` the median of the
  later calls (their steady state: a reused threshold), and for selectors that recompute every
  ``recompute_every`` calls ``amortized`` = (first + (T-1)·median)/T.

The JSON holds every timing with ``ratio_topk`` = median / torch.topk and ``ratio_read`` =
median / read (both < 1 is impossible for ratio_read: it is the floor); the markdown table is
printed. Timings on CUDA are synchronised around every call.

    commlab bench selection                                   # 1M, 10M, 100M on cpu (and cuda)
    commlab bench selection --sizes 1000000 10000000 --calls 5 --json /tmp/sel.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from commlab.bench.common import add_output_arguments, md_table, parse_size, write_report
from commlab.compress.base import k_for_density
from commlab.registry import BENCHMARKS, SELECTORS

DEFAULT_SIZES = [1_000_000, 10_000_000, 100_000_000]


def _timed(fn, device: torch.device):
    """(seconds, result) of one call, synchronised on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def _repeat(fn, device: torch.device, calls: int, budget: float) -> tuple[list[float], object]:
    """Call ``fn`` up to ``calls`` times (at least twice) or until ``budget`` seconds are spent."""
    times, out, spent = [], None, 0.0
    for i in range(calls):
        seconds, out = _timed(fn, device)
        times.append(seconds)
        spent += seconds
        if i >= 1 and spent > budget:
            break
    return times, out


def measure(x: torch.Tensor, k: int, calls: int, budget: float) -> list[dict]:
    """Reference timings and every selector's on one tensor."""
    device = x.device
    read, _ = _repeat(lambda: x.sum(), device, max(calls, 5), budget)
    ref, _ = _repeat(lambda: torch.topk(x.abs(), k, sorted=False), device, calls, budget)
    read_s, topk_s = statistics.median(read[1:] or read), statistics.median(ref[1:] or ref)
    rows = [{"selector": "read (x.sum)", "first_s": read[0], "median_s": read_s},
            {"selector": "torch.topk", "first_s": ref[0], "median_s": topk_s, "selected": k}]
    for name in SELECTORS.names():
        select = SELECTORS.get(name)()
        times, idx = _repeat(lambda select=select: select(x, k), device, calls, budget)
        later = times[1:] or times
        row = {"selector": name, "first_s": times[0], "median_s": statistics.median(later),
               "mean_s": statistics.fmean(times), "calls": len(times), "selected": int(idx.numel())}
        period = getattr(select, "recompute_every", None)
        if period:
            row["recompute_every"] = int(period)
            row["amortized_s"] = (times[0] + (period - 1) * row["median_s"]) / period
            row["ratio_topk_amortized"] = row["amortized_s"] / topk_s
        rows.append(row)
        del select, idx
    for row in rows:
        row["ratio_topk"] = row["median_s"] / topk_s
        row["ratio_read"] = row["median_s"] / read_s
        if "selected" in row:
            row["selected_over_k"] = row["selected"] / k
    return rows


@BENCHMARKS.register("selection")
def selection(argv: list[str], json_path: str | None = None) -> int:
    """Exact top-k vs threshold estimation vs Gaussian-k vs every other registered selector."""
    parser = argparse.ArgumentParser(prog="commlab bench selection", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=DEFAULT_SIZES,
                        help="tensor sizes in elements (default 1000000 10000000 100000000)")
    parser.add_argument("--density", type=float, default=0.01, help="k = density * n (default 0.01)")
    parser.add_argument("--calls", type=int, default=8, help="calls per selector and size (default 8)")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="stop calling a selector after this many seconds (at least 2 calls; default 20)")
    parser.add_argument("--devices", nargs="+", choices=["cpu", "cuda"],
                        help="devices (default: cpu, and cuda when available)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.calls < 2 or not 0 < args.density <= 1:
        parser.error("need --calls >= 2 and 0 < --density <= 1")
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    if "cuda" in devices and not torch.cuda.is_available():
        parser.error("--devices cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)

    results, skipped = [], []
    for dev in devices:
        device = torch.device(dev)
        for n in args.sizes:
            k = k_for_density(n, args.density)
            try:
                g = torch.Generator(device=device).manual_seed(args.seed)
                x = torch.randn(n, generator=g, device=device)
                rows = measure(x, k, args.calls, args.budget)
            except (RuntimeError, MemoryError) as err:  # out of memory at the largest sizes
                skipped.append({"device": dev, "elements": n, "reason": str(err).splitlines()[0]})
                continue
            finally:
                x = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for row in rows:
                results.append({"device": dev, "elements": n, "k": k, **row})
    if not torch.cuda.is_available():
        skipped.append({"device": "cuda", "reason": "no CUDA device on this machine: not measured"})

    table = [{**r, "first_ms": 1000 * r["first_s"], "median_ms": 1000 * r["median_s"],
              "amortized_ms": 1000 * r["amortized_s"] if "amortized_s" in r else None} for r in results]
    md = [f"Selection of k = {args.density:g}·n of n normal float32 entries; median of later calls "
          f"(first call apart), ratios to torch.topk(|x|, k) and to one read of x (x.sum()).", "",
          md_table(table, [("device", "device"), ("elements", "n"), ("selector", "selector"),
                           ("first_ms", "first ms"), ("median_ms", "median ms"), ("amortized_ms", "amortized ms"),
                           ("ratio_topk", "x topk"), ("ratio_read", "x read"), ("selected_over_k", "selected / k")])]
    md += [f"\nNot measured: {s['device']} {s.get('elements', '')}: {s['reason']}" for s in skipped]
    payload = {"density": args.density, "calls": args.calls, "budget_s": args.budget,
               "threads": torch.get_num_threads(), "results": results, "skipped": skipped}
    write_report("selection", payload, "\n".join(md), args.json_path or json_path, args.out_dir)
    return 0
