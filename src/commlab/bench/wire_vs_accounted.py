"""``commlab bench wire``: every method's accounted volume beside the bytes its emulated links carried.

Every volume figure of the reports (bytes per step, "sends 0.1%", the cost model's inputs) is the
Communicator's accounting: the tensor bytes of the algorithm gloo runs for each collective
(:mod:`commlab.core.costs`). The emulated links count what really crossed them. This benchmark
sets the two side by side for each method, per step of the measured window (after the dense
warm-up) and per worker (the mean over the ranks; the JSON keeps every rank):

* **accounted**: the bytes the Communicator charged;
* **wire**: the bytes the links carried (raw: every frame; payload: minus one set of Ethernet,
  IPv4 and TCP headers per counted frame, :data:`~commlab.launch.netem.FRAME_HEADER_BYTES`);
* **expected**: accounted + gloo's framing (:data:`~commlab.core.costs.GLOO_FRAMING_BYTES` per
  message the Communicator counted) + the collectives each log point runs outside the accounting
  (the loop's control allreduce; the sparse methods' metrics allreduce);
* payload / accounted, payload / expected, and the gloo algorithms that carried the accounted
  bytes (share of each).

A method passes when its payload is within 10% of its accounted bytes; otherwise the table names
what makes up the difference, and flags what the expected volume does not explain either.
Nothing runs twice: the figures come from the throughput benchmark's emulated runs (``--from``,
one or more of its JSON files), or, without ``--from``, from short runs made here on one emulated
link (the throughput benchmark's own measurement, ``--methods``, ``--max-steps``);
``--run-missing`` adds such runs for the methods the files do not have (where emulated links are
unavailable, their rows say "not measured" and why). The default workflow builds the table so:
from the throughput benchmark's files, the methods they lack run here for a few steps past their
warm-up (workflow/rules/bench.smk, ``bench: args: wire`` in config/config.yaml).

    commlab bench wire --from reports/bench/throughput.json reports/bench/throughput_resnet20.json
    commlab bench wire --methods ssgd oktopk --network unshaped --max-steps 16     # runs them (root)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from commlab.bench.common import (
    Workdir,
    add_output_arguments,
    add_training_arguments,
    emulation_unavailable,
    md_table,
    parse_network,
    resolve_dataset,
    resolve_methods,
    write_report,
)
from commlab.core.costs import GLOO_FRAMING_BYTES, ring_allreduce_cost, ring_allreduce_messages
from commlab.registry import ALGORITHMS, BENCHMARKS

TOLERANCE = 0.10  # payload within 10% of the accounted bytes: the accounting describes the wire

#: The gloo algorithm behind each operation the Communicator records (commlab.core.costs).
GLOO_ALGORITHMS = {
    "all_reduce": "ring allreduce", "ddp_all_reduce": "ring allreduce (DDP's buckets)",
    "all_gather": "ring allgather (blocks up to 14 KiB: one direct exchange)", "all_to_all": "direct exchange",
    "all_to_all_counts": "direct exchange",
    "reduce_scatter": "direct exchange", "broadcast": "binomial tree", "send": "point-to-point",
    "recv": "point-to-point", "barrier": "barrier",
}
#: The loop's control allreduce at every log point (commlab.loop.metrics.control): 4 float64.
CONTROL = ("the loop's control allreduce", 4, 8)
#: The sparse methods' metrics allreduce at every log point (max over ranks of 2 float64).
SPARSE_METRICS = ("the metrics allreduce", 2, 8)


def allreduce_wire(n: int, element_size: int, p: int) -> float:
    """Bytes a gloo ring allreduce puts on the wire over all ranks: data and framing."""
    data = sum(ring_allreduce_cost(n, p, i, element_size)[0] for i in range(p)) * element_size
    return data + GLOO_FRAMING_BYTES * sum(ring_allreduce_messages(n, p, i, element_size) for i in range(p))


def unaccounted(method: str, model: str, p: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """What runs outside the accounting, over all ranks: (per log point, per step) lists of
    (name, wire bytes)."""
    from commlab.algorithms.sparse_common import SparseAlgorithm

    per_point = [(CONTROL[0], allreduce_wire(CONTROL[1], CONTROL[2], p))]
    if issubclass(ALGORITHMS.get(method), SparseAlgorithm):  # sparse_common's _max_over_ranks
        per_point.append((SPARSE_METRICS[0], allreduce_wire(SPARSE_METRICS[1], SPARSE_METRICS[2], p)))
    # Nothing per step: the ddp methods sync no buffers at a forward (algorithms/ddp.py).
    return per_point, []


def run_figures(run: dict, model: str) -> dict:
    """One emulated run's window as per-worker, per-step figures and what explains them."""
    w, p = run["wire"], run["workers"]
    total = w["sum"]
    per_point, per_step = unaccounted(run["method"], model, p)
    outside = {name: b * w["log_points"] / w["steps"] for name, b in per_point}
    outside.update(dict(per_step))
    figures = {"workers": p, "accounted": total["bytes_sent"] / p, "payload": total["wire_tx_payload"] / p,
               "raw": total["wire_tx_bytes"] / p, "messages": total["messages_sent"] / p,
               "framing": GLOO_FRAMING_BYTES * total["messages_sent"] / p,
               "outside": sum(outside.values()) / p}
    figures["expected"] = figures["accounted"] + figures["framing"] + figures["outside"]
    # An asynchronous collective is accounted when it starts and crosses the wire later: at each
    # edge of the window up to one collective is counted on one side only.
    collectives = run.get("collectives_per_step") or 0
    asynchronous = bool(run.get("blocked_s")) and collectives > 0
    figures["in_flight"] = figures["accounted"] / collectives / w["steps"] if asynchronous else 0.0
    if getattr(ALGORITHMS.get(run["method"]), "comm_pattern", None) == "parameter_server":
        # A server thread's replies reach rank 0's counts at rank 0's next step, not when they are
        # sent: at each edge of the window up to one reply per remote worker, (P-1) 4n bytes, is
        # on the wire and not yet accounted (or the other way round). Per worker and step that is
        # (P-1) 4n / (P steps), with 4n = accounted P / (2 (P-1)) (a push and a reply per step).
        figures["in_flight"] = figures["accounted"] / (2 * w["steps"])
        figures["in_flight_cause"] = "the server's replies in flight at the window's edges"
    figures["outside_by_name"] = {k: v / p for k, v in outside.items()}
    figures["by_op"] = {op: f["bytes_sent"] / p for op, f in (total.get("by_op") or {}).items()}
    run_total = w.get("run", {}).get("sum", {})
    figures["whole_run_mb"] = run_total.get("wire_tx_bytes", 0) / 1e6
    return figures


def explain(row: dict) -> str:
    """What makes up a gap between the payload and the accounted bytes, by name."""
    accounted, payload = row["accounted"], row["payload"]
    if accounted <= 0:
        return "nothing accounted in the window" + ("" if payload < 1 else ": the wire carries only the "
                                                    "collectives outside the accounting and gloo's framing")
    ratio = payload / accounted
    parts = [f"gloo framing {row['messages']:.1f} msgs x {GLOO_FRAMING_BYTES} B = {row['framing'] / accounted:.1%}"]
    parts += [f"{name} {value / accounted:.1%}" for name, value in row["outside_by_name"].items() if value]
    if row.get("in_flight"):
        cause = row.get("in_flight_cause", "asynchronous collectives in flight at the window's edges")
        parts.append(f"{cause} up to {row['in_flight'] / accounted:.1%}")
    left = payload / row["expected"] - 1
    unexplained = abs(left) > TOLERANCE and abs(payload - row["expected"]) > row.get("in_flight", 0)
    verdict = "within 10%" if abs(ratio - 1) <= TOLERANCE else "gap of " + f"{ratio - 1:+.1%}"
    tail = f"; left over {left:+.1%}" + (" (beyond 10%: UNEXPLAINED)" if unexplained else "")
    return f"{verdict}: " + ", ".join(parts) + tail


def algorithms(by_op: dict) -> str:
    """'ring allreduce 98%, direct exchange 2%': the gloo algorithms carrying the accounted bytes."""
    shares: dict[str, float] = {}
    for op, size in by_op.items():
        shares[GLOO_ALGORITHMS.get(op, op)] = shares.get(GLOO_ALGORITHMS.get(op, op), 0) + size
    total = sum(shares.values())
    if not total:
        return ""
    return ", ".join(f"{name} {v / total:.0%}" for name, v in sorted(shares.items(), key=lambda x: -x[1]) if v)


def table(sources: list[dict], methods: list[str], unmeasured: dict[str, str] | None = None) -> list[dict]:
    """One row per (method, model, network) with emulated runs in ``sources`` (throughput
    payloads): the median over repeats of each figure; a row saying so for methods never run
    (``unmeasured``: why, per method)."""
    groups: dict[tuple, list[dict]] = {}
    for source in sources:
        model = source.get("model", "cnn")
        for run in source.get("runs", []):
            if "wire" in run:
                groups.setdefault((run["method"], model, run["network"]), []).append(run_figures(run, model))
    rows = []
    for method in methods:
        keys = sorted(k for k in groups if k[0] == method)
        if not keys:
            rows.append({"method": method, "note": (unmeasured or {}).get(
                method, "not measured: no emulated run of this method in the inputs")})
        for key in keys:
            runs = groups[key]
            row = {"method": method, "model": key[1], "network": key[2], "workers": runs[0]["workers"],
                   "runs": len(runs)}
            for field in ("accounted", "payload", "raw", "messages", "framing", "outside", "expected", "in_flight",
                          "whole_run_mb"):
                row[field] = statistics.median(r[field] for r in runs)
            row["outside_by_name"] = runs[0]["outside_by_name"]
            row["by_op"] = runs[0]["by_op"]
            if "in_flight_cause" in runs[0]:
                row["in_flight_cause"] = runs[0]["in_flight_cause"]
            row["payload_over_accounted"] = row["payload"] / row["accounted"] if row["accounted"] else None
            row["payload_over_expected"] = row["payload"] / row["expected"] if row["expected"] else None
            row["within_tolerance"] = (row["payload_over_accounted"] is not None
                                       and abs(row["payload_over_accounted"] - 1) <= TOLERANCE)
            row["algorithms"] = algorithms(row["by_op"])
            row["note"] = explain(row)
            rows.append(row)
    return rows


def measure(args, methods: list[str]) -> dict:
    """Short emulated runs of ``methods`` (the throughput benchmark's measurement), as its payload."""
    from commlab.bench.throughput import measure_methods

    reason = emulation_unavailable()
    if reason:
        raise SystemExit(f"commlab bench wire: cannot run on emulated links ({reason}); give --from FILE")
    args.repeats, args.test_subset = 1, 256
    workdir = Workdir(keep=args.keep)
    try:
        runs, _ = measure_methods(args, methods, [args.network], args.workers, workdir)
    finally:
        workdir.close()
    return {"model": args.model, "workers": args.workers, "runs": runs}


@BENCHMARKS.register("wire")
def wire(argv: list[str], json_path: str | None = None) -> int:
    """Accounted bytes per step beside the bytes on the emulated links, per method."""
    parser = argparse.ArgumentParser(prog="commlab bench wire", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="sources", nargs="+", metavar="FILE",
                        help="throughput benchmark JSON files whose emulated runs to read (no runs here)")
    parser.add_argument("--run-missing", action="store_true",
                        help="with --from: run here the methods that have no emulated run in the files")
    parser.add_argument("--workers", type=int, default=4, help="workers per run made here (default 4)")
    parser.add_argument("--network", type=parse_network, default="unshaped",
                        help="the emulated link of the runs made here (default unshaped; Mbit/s to shape)")
    parser.add_argument("--max-steps", type=int, default=16, help="measured steps per run made here (default 16)")
    add_training_arguments(parser)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.network == "loopback":
        parser.error("--network must be an emulated link (unshaped or Mbit/s): loopback has no counters")
    methods = resolve_methods(args.methods)
    unmeasured: dict[str, str] = {}
    if args.sources:
        missing = [s for s in args.sources if not Path(s).exists()]
        if missing:
            parser.error(f"--from: no such file(s) {missing}")
        sources = [json.loads(Path(s).read_text()) for s in args.sources]
        names = list(args.sources)
        measured = {r["method"] for source in sources for r in source.get("runs", []) if "wire" in r}
        missing = [m for m in methods if m not in measured]
        if args.run_missing and missing:
            if reason := emulation_unavailable():  # the table still comes out, saying why
                print(f"[wire] not run here ({reason}): {', '.join(missing)}", flush=True)
                unmeasured = {m: f"not measured: emulated links unavailable ({reason})" for m in missing}
            else:
                args.dataset = resolve_dataset(args)
                sources.append(measure(args, missing))
                names.append(f"runs made here ({', '.join(missing)}; {args.max_steps} steps after the warm-up, "
                             f"log points every {args.log_every})")
    else:
        args.dataset = resolve_dataset(args)
        sources, names = [measure(args, methods)], ["runs made here"]
    rows = table(sources, methods, unmeasured)
    write_report("wire", {"sources": names, "tolerance": TOLERANCE, "framing_bytes": GLOO_FRAMING_BYTES,
                          "methods": methods, "rows": rows}, markdown(rows, names), args.json_path or json_path,
                 args.out_dir)
    return 0


def markdown(rows: list[dict], names: list[str]) -> str:
    columns = [("method", "method"), ("model", "model"), ("network", "link"), ("accounted", "accounted B"),
               ("payload", "wire payload B"), ("raw", "wire raw B"), ("payload_over_accounted", "payload / accounted"),
               ("payload_over_expected", "payload / expected"), ("algorithms", "gloo algorithms (accounted bytes)"),
               ("note", "what makes up the difference")]
    failing = [r["method"] for r in rows if "UNEXPLAINED" in r.get("note", "")]
    lines = ["Bytes per step and worker in the measured window (after the dense warm-up; the mean over the "
             "ranks): what the Communicator accounted beside what the emulated links carried (payload: "
             "minus Ethernet/IPv4/TCP headers per frame; raw: every frame), from " + ", ".join(names) + ".",
             "Expected = accounted + gloo's framing per message + the collectives outside the accounting.", "",
             md_table(rows, columns), "",
             "Outside the measured window and not in this table: start-up (the rendezvous through the TCP "
             "store at rank 0, gloo's connection setup), the initial model broadcast, the dense warm-up, the "
             "final evaluation's broadcast and allreduce, and the checkpoint's barriers; `whole_run_mb` in the "
             "JSON has each run's total.",
             "", "Periodic methods reduce every K steps and at the run's last step: a window shorter than K holds "
             "one reduction (the final one), so their bytes per step are the window's, not a period's; their "
             "ratios hold all the same."]
    if failing:
        lines += ["", "Payload off the accounting by more than 10% with no named cause: " + ", ".join(failing)]
    return "\n".join(lines)
