"""``commlab bench time_to_accuracy``: seconds to a target test accuracy per method on an emulated link.

docs/network.md, section 4. Each method trains the laptop CNN on a Fashion-MNIST subset (short epochs, so that
test accuracy is evaluated often) with its workers in an emulated network (:mod:`commlab.launch.netem`,
default 100 Mbit/s links). The time to accuracy is the training wall-clock (rank 0, from the
first step; earlier evaluations included) at the end of the first epoch whose test accuracy
reaches ``--target``; it is compared with dense ``ssgd`` in the same invocation, and with the
strongest dense baseline that ran there (the fastest to the target of ``ssgd``, ``ddp`` and
``ddp_bf16``: ``strongest_dense``, ``speedup_vs_strongest_dense``). Methods that never reach the
target report their best accuracy instead. Without root or iproute2 the runs fall back to
loopback and say so.

    commlab bench time_to_accuracy                              # every method, 100 Mbit/s, target 80%
    commlab bench time_to_accuracy --methods ssgd kstep --network loopback --target 70 --epochs 2
"""

from __future__ import annotations

import argparse

from commlab.bench.common import (
    Workdir,
    add_output_arguments,
    add_training_arguments,
    base_config,
    emulation_unavailable,
    md_table,
    network_context,
    network_name,
    parse_network,
    resolve_dataset,
    resolve_methods,
    run_training,
    write_report,
)
from commlab.bench.throughput import DENSE_BASELINES
from commlab.registry import BENCHMARKS


def time_to_target(points: list[dict], target: float) -> dict:
    """First evaluated step whose test accuracy reaches ``target`` and the wall time at that step."""
    evals = [p for p in points if "test_accuracy" in p]
    walls = {p["step"]: p["wall_seconds"] for p in points if "wall_seconds" in p}
    curve = [{"step": p["step"], "test_accuracy": p["test_accuracy"], "wall_seconds": walls.get(p["step"])}
             for p in evals]
    hit = next((c for c in curve if c["test_accuracy"] >= target), None)
    return {"reached": hit is not None, "seconds": hit["wall_seconds"] if hit else None,
            "step": hit["step"] if hit else None,
            "best_accuracy": max((c["test_accuracy"] for c in curve), default=None), "curve": curve}


def add_speedups(results: list[dict]) -> None:
    """Each result that reached the target gets its speed-up over ssgd and over the strongest dense
    baseline (:data:`commlab.bench.throughput.DENSE_BASELINES`: the fastest of them to the target,
    named as ``strongest_dense``), where those reached it."""
    reached = {r["method"]: r for r in results if r.get("reached")}
    dense = [reached[m] for m in DENSE_BASELINES if m in reached]
    strongest = min(dense, key=lambda r: r["seconds"]) if dense else None
    for r in reached.values():
        if "ssgd" in reached:
            r["speedup_vs_ssgd"] = reached["ssgd"]["seconds"] / r["seconds"]
        if strongest:
            r["strongest_dense"] = strongest["method"]
            r["speedup_vs_strongest_dense"] = strongest["seconds"] / r["seconds"]


@BENCHMARKS.register("time_to_accuracy")
def time_to_accuracy(argv: list[str], json_path: str | None = None) -> int:
    """Seconds to a target test accuracy per method on an emulated link."""
    parser = argparse.ArgumentParser(prog="commlab bench time_to_accuracy", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="workers per run (default 4)")
    parser.add_argument("--network", type=parse_network, default=100.0,
                        help="link rate in Mbit/s, unshaped or loopback (default 100)")
    parser.add_argument("--target", type=float, default=80.0, help="test accuracy to reach, %% (default 80)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs at most (default 3)")
    parser.add_argument("--train-subset", type=int, default=8192,
                        help="training samples per epoch (default 8192: short epochs, frequent evaluation)")
    parser.add_argument("--test-subset", type=int, default=2000, help="test samples per evaluation (default 2000)")
    add_training_arguments(parser)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.dataset = resolve_dataset(args)
    methods = resolve_methods(args.methods)
    steps_per_epoch = args.train_subset // (args.workers * args.batch_size)
    if steps_per_epoch < 1:
        parser.error(f"--train-subset {args.train_subset} cannot fill one step of {args.workers} x {args.batch_size}")
    args.log_every = steps_per_epoch  # one wall-clock point at every evaluation
    args.max_steps = None

    net = args.network
    note = ""
    if net != "loopback":
        reason = emulation_unavailable()
        if reason:
            note = f"emulated link unavailable ({reason}): measured on loopback instead"
            print(f"[time_to_accuracy] {note}", flush=True)
            net = "loopback"
    results = []
    workdir = Workdir(keep=args.keep)
    try:
        with network_context(net, args.workers) as emulated:
            link = emulated.params if emulated else {}
            for method in methods:
                config = base_config(args, method, args.workers, steady=False)  # the full recipe
                config["train"].update(train_subset=args.train_subset, test_subset=args.test_subset)
                run = run_training(config, workdir, emulated)
                entry = {"method": method, "run_seconds": round(run["seconds"], 1)}
                if "error" in run:
                    entry["error"] = run["error"][-600:]
                else:
                    entry.update(time_to_target(run["points"], args.target))
                results.append(entry)
                print(f"[time_to_accuracy] {method}: " + (
                    f"{entry['seconds']:.1f} s" if entry.get("reached") else
                    f"not reached (best {entry.get('best_accuracy')})" if "error" not in entry else "FAILED"),
                    flush=True)
    finally:
        workdir.close()
    add_speedups(results)
    payload = {"workers": args.workers, "network": network_name(net), "requested_network": network_name(args.network),
               "network_note": note, "measured_link_mbit": link.get("network_measured_mbit"),
               "target_accuracy": args.target, "model": args.model, "dataset": args.dataset,
               "train_subset": args.train_subset, "test_subset": args.test_subset, "epochs": args.epochs,
               "batch_per_worker": args.batch_size, "lr": args.lr,
               "strongest_dense": next((r["strongest_dense"] for r in results if "strongest_dense" in r), None),
               "results": results}
    md = [f"Training seconds until the test accuracy reaches {args.target:g}% ({args.model}, {args.dataset} "
          f"subset of {args.train_subset}, evaluated every epoch on {args.test_subset} test samples, "
          f"{args.workers} workers, network {network_name(net)}"
          + (f", measured link {link.get('network_measured_mbit')} Mbit/s" if link else "") + ").", ""]
    if note:
        md += [note, ""]
    md.append(md_table(results, [("method", "method"), ("seconds", "seconds to target"), ("step", "step"),
                                 ("speedup_vs_ssgd", "speed-up vs ssgd"),
                                 ("speedup_vs_strongest_dense", "vs strongest dense"),
                                 ("best_accuracy", "best accuracy %"),
                                 ("error", "error")]))
    write_report("time_to_accuracy", payload, "\n".join(md), args.json_path or json_path, args.out_dir)
    return 0
