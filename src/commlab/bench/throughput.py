"""``commlab bench throughput``: samples/s of every registered method, as ratios to dense ``ssgd``,
and ``ssgd`` against PyTorch DDP.

docs/network.md, section 4. Every registered method (or ``--methods``) trains the same short run
(``--max-steps`` steps of the laptop CNN, 4 workers) on loopback and on emulated links of 1 Gbit/s
and 100 Mbit/s (:mod:`commlab.launch.netem`), all in this one invocation, so each ratio compares
runs measured minutes apart on the same machine. Samples/s is taken between the first and the last
logged point of each run (start-up, the first steps and the final evaluation drop out); the JSON
also keeps per-step compute, communication, bytes and collectives, which feed the cost model
(``commlab bench scaling``). The timing fields mean the same for every method, synchronous or
overlapping (``timing_fields`` in the JSON, docs/network.md section 7): ``comm_s`` is the time a
step spent communicating, the collectives' own time (``collective_s``: an asynchronous one's launch)
plus the waits on asynchronous ones (``blocked_s``); a figure a run did not log is null. Methods run
with the options the laptop-scale paper grids give them (``--options defaults``: their own
defaults), dense warm-up included, and the rate is taken after the warm-up ends (``--max-steps``
steps of the method itself; ``--no-warmup`` skips the warm-up instead). With ``--repeats R`` the
methods are interleaved R times, in the given order on even repeats and in reverse on odd ones (so
that no method always runs first after a link is set up, or always right after the same neighbour),
and the median is reported; each method's ratio to ``ssgd`` within each repeat is kept too
(``ratio_per_repeat``), to show the spread that one short window has. ``ddp`` always runs beside
``ssgd`` (added when ``--methods`` leaves it out): ``ssgd / ddp``, per network, says how the dense
reference every ratio divides by compares with what a PyTorch user runs. ``ddp_bf16`` runs beside
them too (added likewise): DDP with its bf16 compression hook, the strongest dense baseline of the
suite (Agarwal et al., MLSys'22: a 16-bit, overlapped DDP is what compression has to beat). Per
network the summary names the fastest of ``ssgd``, ``ddp`` and ``ddp_bf16`` there
(``strongest_dense``) and gives every method's samples/s over it (``ratio_to_strongest_dense``)
beside its ratio to ``ssgd``.
Emulated links need root and iproute2; without them those columns are skipped with the reason.
On emulated links each run also records the bytes its links carried in the measured window, per
rank and summed, beside the accounted bytes (``wire`` in the JSON; ``commlab bench wire`` turns
them into a table).

    commlab bench throughput                                   # all methods, loopback/1000/100
    commlab bench throughput --methods ssgd ddp --networks loopback --max-steps 10
"""

from __future__ import annotations

import argparse
import statistics

from commlab.bench.common import (
    TIMING_FIELDS,
    Workdir,
    add_output_arguments,
    add_training_arguments,
    emulation_unavailable,
    md_table,
    network_context,
    network_name,
    parse_network,
    resolve_dataset,
    resolve_methods,
    run_training,
    steady_config,
    step_summary,
    wire_summary,
    write_report,
)
from commlab.registry import BENCHMARKS

#: The dense baselines every invocation measures; the fastest on a link is the strongest there.
DENSE_BASELINES = ("ssgd", "ddp", "ddp_bf16")


def with_dense_baselines(methods: list[str]) -> list[str]:
    """``methods`` (ssgd first) with every dense baseline of :data:`DENSE_BASELINES` right after
    ssgd, in that order."""
    return [methods[0], *DENSE_BASELINES[1:], *(m for m in methods[1:] if m not in DENSE_BASELINES)]


def strongest_dense(table: list[dict], net: str) -> dict | None:
    """The summary entry of the fastest dense baseline measured on ``net`` (None without one)."""
    dense = [e for e in table if e["network"] == net and e["method"] in DENSE_BASELINES and e.get("samples_per_s")]
    return max(dense, key=lambda e: e["samples_per_s"]) if dense else None


def run_order(methods: list[str], repeat: int) -> list[str]:
    """The order of one repeat: as given on even repeats, reversed on odd ones (counterbalanced)."""
    return list(methods) if repeat % 2 == 0 else list(reversed(methods))


def measure_methods(args, methods: list[str], networks: list, workers: int, workdir: Workdir) -> tuple[list, dict]:
    """One row per (network, method, repeat); plus {network: reason} for networks skipped."""
    rows, skipped = [], {}
    for net in networks:
        name = network_name(net)
        reason = emulation_unavailable() if net != "loopback" else None
        if reason:
            skipped[name] = reason
            print(f"[throughput] {name}: skipped ({reason})", flush=True)
            continue
        with network_context(net, workers) as emulated:
            link = emulated.params if emulated else {}
            for repeat in range(args.repeats):
                for method in run_order(methods, repeat):
                    config, warm = steady_config(args, method, workers)
                    config["train"]["test_subset"] = args.test_subset
                    result = run_training(config, workdir, emulated)
                    row = {"network": name, "method": method, "repeat": repeat, "workers": workers,
                           "measured_link_mbit": link.get("network_measured_mbit"),
                           "run_seconds": round(result["seconds"], 2)}
                    if "error" in result:
                        row["error"] = result["error"][-600:]
                    else:
                        row.update(step_summary(result["points"], workers, args.batch_size, from_step=warm))
                        row["warmup_steps"] = warm
                        row["final_train_loss"] = result["final"].get("train_loss")
                        if emulated:
                            row["wire"] = wire_summary(result, from_step=warm)
                    rows.append(row)
                    print(f"[throughput] {name} {method} (repeat {repeat}): "
                          + (f"{row['samples_per_s']:.0f} samples/s" if "samples_per_s" in row else "FAILED"),
                          flush=True)
    return rows, skipped


#: Summary keys from each emulated run's wire window (summed over ranks, per step): median over repeats.
WIRE_SUMMARY = {"accounted_bytes_all_ranks": "bytes_sent", "wire_bytes_all_ranks": "wire_tx_bytes",
                "wire_payload_all_ranks": "wire_tx_payload", "wire_over_accounted": "payload_over_accounted"}


#: The per-step figures of each run that the summary takes the median of (timing fields: TIMING_FIELDS).
SUMMARY_KEYS = ("samples_per_s", "step_s", "compute_s", "collective_s", "blocked_s", "comm_s", "bytes_per_step",
                "collectives_per_step", "reductions_per_step")


def median_or_none(values: list) -> float | None:
    """The median over repeats; None (not measured) when a repeat did not measure it."""
    return None if not values or any(v is None for v in values) else statistics.median(values)


def ssgd_over_ddp(table: list[dict], networks: list[str]) -> dict[str, float | None]:
    """Per network: ssgd's samples/s over ddp's (None where either failed)."""
    rate = {(e["network"], e["method"]): e.get("samples_per_s") for e in table}
    out = {}
    for net in networks:
        ours, theirs = rate.get((net, "ssgd")), rate.get((net, "ddp"))
        out[net] = ours / theirs if ours and theirs else None
    return out


def per_repeat_ratios(rows: list[dict], net: str, method: str, reference: str = "ssgd") -> list[float]:
    """``method``'s samples/s over ``reference``'s within each repeat on ``net`` (repeats where both
    ran), to 4 decimals."""
    rate = {(r["method"], r["repeat"]): r["samples_per_s"] for r in rows
            if r["network"] == net and r.get("samples_per_s")}
    repeats = sorted({repeat for _, repeat in rate})
    return [round(rate[method, i] / rate[reference, i], 4) for i in repeats
            if (method, i) in rate and (reference, i) in rate]


def summarise(rows: list[dict], methods: list[str], networks: list[str]) -> list[dict]:
    """Median over repeats per (network, method), the ratio of the medians to ssgd's on the same
    network, the ratio within each repeat, and the ratio to the strongest dense baseline there
    (:func:`strongest_dense`, named)."""
    table = []
    for net in networks:
        dense = [r["samples_per_s"] for r in rows if r["network"] == net and r["method"] == "ssgd"
                 and r.get("samples_per_s")]
        dense_rate = statistics.median(dense) if dense else None
        for method in methods:
            mine = [r for r in rows if r["network"] == net and r["method"] == method]
            if not mine:
                continue
            ok = [r for r in mine if r.get("samples_per_s")]
            entry = {"network": net, "method": method, "runs": len(mine)}
            if not ok:
                entry["error"] = mine[0].get("error", "no measurement")
            else:
                for key in SUMMARY_KEYS:
                    entry[key] = median_or_none([r.get(key) for r in ok])
                entry["ratio_to_ssgd"] = entry["samples_per_s"] / dense_rate if dense_rate else None
                entry["ratio_per_repeat"] = per_repeat_ratios(rows, net, method)
                entry["measured_link_mbit"] = ok[0].get("measured_link_mbit")
                wired = [r["wire"]["sum"] for r in ok if "wire" in r]
                for key, source in WIRE_SUMMARY.items():
                    if values := [w[source] for w in wired if source in w]:
                        entry[key] = statistics.median(values)
            table.append(entry)
        strongest = strongest_dense(table, net)
        for entry in (e for e in table if e["network"] == net and e.get("samples_per_s") and strongest):
            entry["strongest_dense"] = strongest["method"]
            entry["ratio_to_strongest_dense"] = entry["samples_per_s"] / strongest["samples_per_s"]
    return table


@BENCHMARKS.register("throughput")
def throughput(argv: list[str], json_path: str | None = None) -> int:
    """Samples/s of every method at loopback and emulated links, as ratios to ssgd."""
    parser = argparse.ArgumentParser(prog="commlab bench throughput", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="workers per run (default 4)")
    parser.add_argument("--networks", nargs="+", type=parse_network, default=["loopback", 1000.0, 100.0],
                        help="loopback, unshaped, or link rates in Mbit/s (default: loopback 1000 100)")
    parser.add_argument("--max-steps", type=int, default=40, help="steps per run (default 40)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repetitions (default 1)")
    parser.add_argument("--test-subset", type=int, default=1000, help="test samples of the final evaluation")
    add_training_arguments(parser)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.max_steps < 2 * args.log_every:
        parser.error(f"--max-steps ({args.max_steps}) must be at least 2 x --log-every ({args.log_every})")
    args.dataset = resolve_dataset(args)
    # ddp: the external reference for ssgd; ddp_bf16: the strongest dense baseline
    methods = with_dense_baselines(resolve_methods(args.methods))
    names = [network_name(n) for n in args.networks]

    workdir = Workdir(keep=args.keep)
    try:
        rows, skipped = measure_methods(args, methods, args.networks, args.workers, workdir)
    finally:
        workdir.close()
    table = summarise(rows, methods, names)
    measured = [n for n in names if n not in skipped]
    versus_ddp = ssgd_over_ddp(table, measured)
    versus_ddp_each = {net: per_repeat_ratios(rows, net, "ssgd", reference="ddp") for net in measured}
    payload = {"workers": args.workers, "model": args.model, "dataset": args.dataset,
               "batch_per_worker": args.batch_size, "max_steps": args.max_steps, "log_every": args.log_every,
               "repeats": args.repeats, "options": args.options, "warmup_steps_zero": args.no_warmup,
               "methods": methods,
               "networks": names, "skipped_networks": skipped,
               "ssgd_over_ddp": versus_ddp, "ssgd_over_ddp_per_repeat": versus_ddp_each, "timing_fields": TIMING_FIELDS,
               "summary": table, "runs": rows}

    wide = []
    for method in methods:
        line = {"method": method}
        for entry in (e for e in table if e["method"] == method):
            net = entry["network"]
            line[f"{net}_rate"] = entry.get("samples_per_s")
            line[f"{net}_ratio"] = entry.get("ratio_to_ssgd") if "error" not in entry else "failed"
            line[f"{net}_strongest"] = entry.get("ratio_to_strongest_dense")
            line["bytes_per_step"] = line.get("bytes_per_step") or entry.get("bytes_per_step")
            line[f"{net}_wire"] = entry.get("wire_over_accounted")
        wide.append(line)
    columns = [("method", "method")]
    for net in names:
        if net not in skipped:
            columns += [(f"{net}_rate", f"{net} samples/s"), (f"{net}_ratio", f"{net} / ssgd"),
                        (f"{net}_strongest", f"{net} / strongest dense")]
    columns.append(("bytes_per_step", "bytes sent/step (rank 0)"))
    columns += [(f"{net}_wire", f"{net} wire payload / accounted") for net in names
                if net != "loopback" and net not in skipped]
    md = [f"Samples/s of each method ({args.model}, {args.dataset}, {args.workers} workers x batch "
          f"{args.batch_size}, {args.max_steps} steps, median of {args.repeats}"
          + (", dense warm-up steps off" if args.no_warmup else ", measured after the dense warm-up")
          + (", the paper grids' method options" if args.options == "grid" else ", default method options")
          + "), and its ratio to dense ssgd measured in the same invocation. On emulated links, the bytes "
          "the links carried (payload, all ranks) over the bytes accounted, in the same steps "
          "(`commlab bench wire` explains each).", "", md_table(wide, columns)]
    md += ["", "ssgd / ddp samples/s (dense ssgd, bucketed allreduces started during backward, against "
           "PyTorch DDP, side by side; the ratio of the medians, then each repeat's): " + "; ".join(
               (f"{net} {ratio:.3f}" if ratio else f"{net} n/a")
               + (f" ({', '.join(f'{x:.3f}' for x in versus_ddp_each[net])})" if versus_ddp_each[net] else "")
               for net, ratio in versus_ddp.items())]
    strongest = {net: strongest_dense(table, net) for net in measured}
    md += ["", "Strongest dense baseline per network (the fastest of " + ", ".join(DENSE_BASELINES) + "): " + "; ".join(
        f"{net} {entry['method']} ({entry['samples_per_s']:.0f} samples/s)" if entry else f"{net} not measured"
        for net, entry in strongest.items())]
    for net, reason in skipped.items():
        md += ["", f"{net}: skipped ({reason})"]
    failed = [e for e in table if "error" in e]
    if failed:
        md += ["", "Failed runs: " + "; ".join(f"{e['method']} on {e['network']}: {e['error'][-200:]}"
                                               for e in failed)]
    write_report("throughput", payload, "\n".join(md), args.json_path or json_path, args.out_dir)
    return 0
