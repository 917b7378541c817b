"""``commlab bench collectives``: allreduce through the Communicator vs raw torch.distributed.

Two checks (docs/network.md, section 5): the Communicator costs at most 5% over raw torch.distributed at >= 1M
elements, and under a 1 Gbit/s emulated link (section 1) a 10M-float allreduce on 4 ranks
takes the bandwidth-limited time; unshaped it is several times faster.

Overhead table: 4 gloo ranks (``commlab.launch.ranks.run_ranks``) on loopback; per size, after
warm-up, ``--repeats`` pairs of calls, the order of the two alternating from pair to pair
(interleaved, so drift in machine load hits both alike), each call started after a barrier. A
call's time is the slowest rank's; the table shows medians and ``ratio = communicator / raw``.
Beside them, ``clock ms``: the seconds the Communicator itself recorded for the call on the run's
device clock (:mod:`commlab.core.clock`; host time on the CPU, CUDA events on a GPU).

``--backend nccl``: the same on NCCL ranks with CUDA tensors, one GPU per rank (``--workers`` at
most the visible GPUs; 1 on a one-GPU machine). Both calls are timed to completion the same way:
``torch.cuda.synchronize`` before the clock starts and after the call, so the table compares the
raw collective with the Communicator's, and ``clock ms`` (its CUDA events, read after the call)
with that completion time. Without CUDA it says so and measures nothing.

Network check (when root and iproute2 are available): the same measurement of ``--check-elements``
floats on loopback, in unshaped namespaces and on ``--check-mbit`` links, against the ring bound
``2(P-1)/P * n * 4 bytes / rate`` (from the nominal rate and from the measured link throughput).
It prints the shaped allreduce's time over the nominal bound and flags a ratio above
:data:`BOUND_CEILING`: the link is then not what limits the allreduce (a loaded machine, or
shaping not in force). The ratio is a measurement of the machine, so it is reported here and never
asserted by a test; tests/test_netem.py keeps only the floor, which no load can break.

    commlab bench collectives                                  # defaults: 1K..16M, 20 repeats
    commlab bench collectives --sizes 1K 1M --repeats 5 --check-mbit 0    # quick, no namespaces
    commlab bench collectives --backend nccl --workers 1 --check-mbit 0    # one GPU, NCCL
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from commlab.bench.common import (
    add_output_arguments,
    emulation_unavailable,
    md_table,
    network_context,
    parse_size,
    write_report,
)
from commlab.registry import BENCHMARKS

DEFAULT_SIZES = ["1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M"]
BOUND_CEILING = 2.0  # a shaped allreduce slower than this many ring bounds is flagged: not bandwidth-limited


def measure(rank: int, world: int, sizes: list[int], repeats: int, warmup: int, device: str = "cpu") -> dict:
    """This rank's seconds per call: ``{size: {"raw": [...], "communicator": [...], "clock": [...]}}``
    (``clock``: what the Communicator recorded for its calls). On CUDA every call is timed from a
    synchronised device to the completion of its work."""
    from commlab.core import CommStats, Communicator

    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")

    def settle() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    comm = Communicator(stats=CommStats())
    out = {}
    for n in sizes:
        x = torch.ones(n, dtype=torch.float32, device=dev)
        calls = {"raw": lambda x=x: dist.all_reduce(x), "communicator": lambda x=x: comm.all_reduce(x)}
        times = {"raw": [], "communicator": []}
        for i in range(warmup + repeats):
            order = ("raw", "communicator") if i % 2 == 0 else ("communicator", "raw")
            for name in order:
                x.fill_(1.0)  # sums of sums would overflow over many repeats
                dist.barrier()
                settle()
                t0 = time.perf_counter()
                calls[name]()
                settle()
                elapsed = time.perf_counter() - t0
                if i >= warmup:
                    times[name].append(elapsed)
        comm.stats.resolve()
        times["clock"] = [c.seconds for c in comm.stats.drain()[warmup:]]
        out[n] = times
    return out


def combine(per_rank: list[dict]) -> dict:
    """Per size: the slowest rank's time of each call, then medians and the ratio."""
    rows = {}
    for n in per_rank[0]:
        row = {"elements": n, "mbytes": n * 4 / 1e6}
        for name in ("raw", "communicator", "clock"):
            slowest = [max(ts) for ts in zip(*(r[n][name] for r in per_rank), strict=True)]
            row[f"{name}_ms"] = statistics.median(slowest) * 1e3
            row[f"{name}_ms_iqr"] = _iqr(slowest) * 1e3
            row[f"{name}_samples"] = len(slowest)
        row["ratio"] = row["communicator_ms"] / row["raw_ms"]
        row["clock_over_completion"] = row["clock_ms"] / row["communicator_ms"]
        row["extra_us"] = (row["communicator_ms"] - row["raw_ms"]) * 1e3
        row["overhead_pct"] = (row["ratio"] - 1) * 100
        # Each Communicator call is paired with the raw call next to it in time (same load):
        # the median of the per-pair ratios is less sensitive to load drift than a ratio of medians.
        pairs = [max(c) / max(r) for c, r in zip(zip(*(x[n]["communicator"] for x in per_rank), strict=True),
                                                 zip(*(x[n]["raw"] for x in per_rank), strict=True), strict=True)]
        row["ratio_paired"] = statistics.median(pairs)
        rows[n] = row
    return rows


def bookkeeping_seconds(n: int = 2**20, world: int = 4, calls: int = 20000) -> float:
    """What the Communicator adds to one allreduce call besides the collective itself: the device
    clock's interval (host time on the CPU), the standard-cost arithmetic and the record (measured
    without a process group)."""
    from commlab.core.clock import DeviceClock
    from commlab.core.communicator import ring_allreduce_cost
    from commlab.core.stats import CommStats

    stats, clock, cpu = CommStats(), DeviceClock(), torch.device("cpu")
    t0 = time.perf_counter()
    for _ in range(calls):
        span = clock.start(cpu)
        sent, recv = ring_allreduce_cost(n, world, 1)
        clock.stop(span, stats.comm_time(stats.record("all_reduce", "global", sent, recv, 4)))
    return (time.perf_counter() - t0) / calls


def _fmt(x: float | None) -> str:
    return "n/a (no size >= 1M)" if x is None else f"{x:.3f}"


def _iqr(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [0, 0, 0]
    return q[2] - q[0]


def worker_main(argv: list[str] | None = None) -> None:
    """Entry point of one rank inside a namespace: measure and let rank 0 write the JSON."""
    from commlab.core import init_runtime, shutdown_runtime

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", nargs="+", type=int, required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    args = p.parse_args(argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(1)
    rt = init_runtime("gloo", timeout_s=600)
    try:
        mine = measure(rt.rank, rt.world_size, args.sizes, args.repeats, args.warmup)
        gathered = [None] * rt.world_size
        dist.all_gather_object(gathered, mine)
        if rt.rank == 0:
            with open(args.out, "w") as f:
                json.dump({str(k): v for k, v in combine(gathered).items()}, f)
    finally:
        shutdown_runtime()


def _measure_in(net, workers: int, n: int, repeats: int, warmup: int, scratch: str) -> dict:
    from commlab.launch import run_in_network

    out = f"{scratch}/check-{time.monotonic_ns()}.json"
    code = "from commlab.bench.collectives import worker_main; worker_main()"
    argv = ["-c", code, "--out", out, "--sizes", str(n), "--repeats", str(repeats), "--warmup", str(warmup)]
    rc = run_in_network(net, argv, log=f"{scratch}/workers.log")
    if rc:
        raise RuntimeError(f"allreduce workers failed with exit code {rc} (log: {scratch}/workers.log)")
    with open(out) as f:
        return json.load(f)[str(n)]


def network_check(workers: int, n: int, mbit: float, repeats: int, warmup: int) -> dict:
    """Allreduce of ``n`` floats on loopback, unshaped namespaces and ``mbit`` links vs the ring bound."""
    import tempfile

    from commlab.launch.ranks import run_ranks

    reason = emulation_unavailable()
    if reason:
        return {"skipped": reason}
    rows = []
    loop = combine(run_ranks(measure, workers, args=([n], repeats, warmup), timeout_s=600))[n]
    rows.append({"network": "loopback", **loop})
    ring_bytes = 2 * (workers - 1) / workers * n * 4
    with tempfile.TemporaryDirectory(prefix="commlab-coll-") as scratch:
        for net_kind in ("unshaped", mbit):
            with network_context(net_kind, workers) as net:
                row = {"network": "unshaped" if net_kind == "unshaped" else f"{mbit:g}Mbit",
                       "measured_link_mbit": net.params.get("network_measured_mbit"),
                       **_measure_in(net, workers, n, repeats, warmup, scratch)}
            if net_kind != "unshaped":
                row["predicted_nominal_ms"] = ring_bytes / (mbit * 1e6 / 8) * 1e3
                row["predicted_measured_link_ms"] = ring_bytes / (row["measured_link_mbit"] * 1e6 / 8) * 1e3
                row["measured_over_predicted"] = row["raw_ms"] / row["predicted_nominal_ms"]
                row["measured_over_predicted_measured_link"] = row["raw_ms"] / row["predicted_measured_link_ms"]
                row["within_20pct"] = abs(row["measured_over_predicted"] - 1) <= 0.2
                row["bandwidth_limited"] = row["measured_over_predicted"] <= BOUND_CEILING
            rows.append(row)
    shaped, unshaped = rows[-1], rows[1]
    return {"elements": n, "workers": workers, "ring_bytes_per_rank": ring_bytes, "rows": rows,
            "shaped_over_unshaped": shaped["raw_ms"] / unshaped["raw_ms"],
            "measured_over_bound": shaped["measured_over_predicted"], "bound_ceiling": BOUND_CEILING,
            "bandwidth_limited": shaped["bandwidth_limited"]}


def bound_line(check: dict) -> str:
    """The network check's verdict in one line: the shaped allreduce's time over its ring bound,
    flagged when above the ceiling."""
    ratio, ceiling = check["measured_over_bound"], check["bound_ceiling"]
    if check["bandwidth_limited"]:
        return (f"Shaped allreduce / ring bound (nominal rate): {ratio:.2f}, within {ceiling:g}x: "
                f"the link limits it.")
    return (f"FLAG: shaped allreduce / ring bound (nominal rate): {ratio:.2f}, above {ceiling:g}x: the link "
            f"is not what limits it (a loaded machine, or shaping not in force).")


def nccl_unavailable(workers: int | None) -> str | None:
    """Why ``--backend nccl`` cannot run here (None when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (NCCL runs on GPUs)"
    gpus = torch.cuda.device_count()
    if workers is not None and workers > gpus:
        return f"--workers {workers} needs one GPU per rank; this machine has {gpus}"
    return None


@BENCHMARKS.register("collectives")
def collectives(argv: list[str], json_path: str | None = None) -> int:
    """Communicator vs raw torch.distributed allreduce, and the emulated-link check."""
    parser = argparse.ArgumentParser(prog="commlab bench collectives", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=None,
                        help="ranks (default 4 on gloo; on nccl the visible GPUs, at most 4)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="gloo ranks with CPU tensors (default) or NCCL ranks with CUDA tensors, one GPU each")
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[parse_size(s) for s in DEFAULT_SIZES],
                        help="float32 elements per allreduce (default 1K 4K ... 16M)")
    parser.add_argument("--repeats", type=int, default=20, help="measured pairs per size (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured pairs first (default 3)")
    parser.add_argument("--check-mbit", type=float, default=1000.0,
                        help="emulated link of the network check in Mbit/s (default 1000; 0: skip the check)")
    parser.add_argument("--check-elements", type=parse_size, default=parse_size("10M"),
                        help="floats in the network check's allreduce (default 10M)")
    parser.add_argument("--check-repeats", type=int, default=5, help="measured pairs in the check (default 5)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.backend == "nccl":
        reason = nccl_unavailable(args.workers)
        if reason:
            print(f"[collectives] --backend nccl skipped: {reason}", flush=True)
            write_report("collectives", {"backend": "nccl", "skipped": reason},
                         f"Allreduce on NCCL: skipped ({reason}).", args.json_path or json_path, args.out_dir)
            return 0
        args.workers = args.workers or min(4, torch.cuda.device_count())
        device = "cuda"
    else:
        args.workers = 4 if args.workers is None else args.workers
        device = "cpu"
        if args.workers < 2:
            parser.error("need --workers >= 2 on gloo")
    if args.workers < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("need --workers >= 1, --repeats >= 1, --warmup >= 0")

    from commlab.launch.ranks import run_ranks

    per_rank = run_ranks(measure, args.workers, args=(args.sizes, args.repeats, args.warmup, device),
                         timeout_s=600, backend=args.backend, device=device)
    rows = list(combine(per_rank).values())
    book = bookkeeping_seconds(world=args.workers)
    for r in rows:
        r["bookkeeping_pct"] = book / (r["raw_ms"] / 1e3) * 100
    big = [r for r in rows if r["elements"] >= 2**20]
    payload = {"workers": args.workers, "repeats": args.repeats, "warmup": args.warmup, "backend": args.backend,
               "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
               "network": "loopback", "sizes": rows,
               "max_ratio_at_1M_and_more": max((r["ratio"] for r in big), default=None),
               "max_paired_ratio_at_1M_and_more": max((r["ratio_paired"] for r in big), default=None),
               "bookkeeping_us_per_call": book * 1e6,
               "target": "communicator/raw <= 1.05 for >= 1M elements"}
    if args.backend == "nccl":
        payload["network_check"] = {"skipped": "emulated links run gloo only"}
    elif args.check_mbit > 0:
        payload["network_check"] = network_check(args.workers, args.check_elements, args.check_mbit,
                                                 args.check_repeats, 1)
    else:
        payload["network_check"] = {"skipped": "--check-mbit 0"}

    where = (f"{args.workers} NCCL rank(s) with CUDA tensors on {payload['device']}, each call timed to the "
             "device's completion" if args.backend == "nccl" else f"{args.workers} gloo ranks over loopback")
    md = [f"Allreduce (sum, float32) on {where}: median of {args.repeats} interleaved calls per size (slowest "
          "rank per call); 'clock ms' is what the Communicator recorded for its calls on the device clock.", "",
          md_table(rows, [("elements", "elements"), ("mbytes", "MB"), ("raw_ms", "raw ms"),
                          ("communicator_ms", "Communicator ms"), ("ratio", "ratio of medians"),
                          ("ratio_paired", "median paired ratio"), ("clock_ms", "clock ms"),
                          ("bookkeeping_pct", "bookkeeping %")]), "",
          f"Largest ratio at >= 1M elements: {_fmt(payload['max_ratio_at_1M_and_more'])} (ratio of medians), "
          f"{_fmt(payload['max_paired_ratio_at_1M_and_more'])} (median of paired ratios); target <= 1.05. "
          f"The Communicator takes {statistics.median(r['extra_us'] for r in rows):.1f} us more than the raw "
          f"call (median over sizes); its own work per call, measured alone on the CPU (the clock's host "
          f"interval, cost arithmetic and record), is {book * 1e6:.1f} us, the 'bookkeeping %' column"
          + ("; on CUDA the clock records two events on the stream instead. A world of one moves nothing: "
             "there the raw call is its launch alone." if args.backend == "nccl" else
             f"; the rest of any difference is noise of the shared machine (load average "
             f"{os.getloadavg()[0]:.1f}).")]
    check = payload["network_check"]
    if "rows" in check:
        md += ["", f"## Emulated link check: {check['elements']} floats, {check['workers']} ranks", "",
               md_table(check["rows"], [("network", "network"), ("measured_link_mbit", "link Mbit/s (measured)"),
                                        ("raw_ms", "raw ms"), ("communicator_ms", "Communicator ms"),
                                        ("predicted_nominal_ms", "ring bound ms (nominal)"),
                                        ("predicted_measured_link_ms", "ring bound ms (measured link)"),
                                        ("measured_over_predicted", "measured / bound")]), "",
               bound_line(check),
               f"Shaped / unshaped time: {check['shaped_over_unshaped']:.2f}x. The ring bound is a model "
               f"(2(P-1)/P n bytes through each worker's link); the other columns are measured."]
    else:
        md += ["", f"Emulated link check skipped: {check['skipped']}"]
    write_report("collectives", payload, "\n".join(md), args.json_path or json_path, args.out_dir)
    return 0
