"""``commlab bench scaling``: the cost model's predictions to 1024 workers, validated at P = 4 and 8.

docs/network.md, sections 2, 3 and 5. Everything under "predictions" is a MODEL (:mod:`commlab.bench.costmodel`),
fed by measurements:

* method profiles (compute seconds, bytes and collectives per step at 4 workers) come from the
  loopback rows of ``reports/bench/throughput.json`` (``--profiles``), or, when that file is
  missing, from short loopback runs made here;
* predictions: time per step and speed-up over dense ssgd at P = 4 ... 1024 on named links, for
  the laptop CNN as measured and for ResNet-50 on V100 nodes (the method's measured bytes per
  step scaled by the gradient-size ratio; compute from the cluster's assumed throughput);
* validation: dense runs at P = 4 and 8 on loopback (model inputs) and on emulated links (what
  is predicted), predicted vs measured time per step (target: within 25%);
* ratio matching: the emulated bandwidth at which this laptop run has the communication to
  computation ratio of each named cluster, with the arithmetic;
* GPU figures: per-step time of the laptop and paper-scale nets when CUDA is present (skipped
  with a note otherwise).

    commlab bench scaling                                           # default: validate ssgd at 100, 1000
    commlab bench scaling --no-validate                             # predictions only (no runs if profiles exist)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from commlab.bench import costmodel as cm
from commlab.bench.common import (
    OUT_DIR,
    Workdir,
    add_output_arguments,
    add_training_arguments,
    emulation_unavailable,
    gpu_model_step_times,
    md_table,
    network_context,
    resolve_dataset,
    run_training,
    steady_config,
    step_summary,
    write_report,
)
from commlab.registry import BENCHMARKS

DEFAULT_P = [4, 8, 16, 32, 64, 128, 256, 512, 1024]


def profiles_from_throughput(path: Path, batch: int) -> tuple[dict[str, cm.MethodProfile], str]:
    """Method profiles from the loopback summary of a throughput benchmark JSON."""
    data = json.loads(path.read_text())
    rows = [r for r in data.get("summary", []) if r.get("network") == "loopback" and "error" not in r]
    dense = next((r for r in rows if r["method"] == "ssgd"), None)
    out = {}
    for r in rows:
        compute, note = r["compute_s"], "measured"
        if r.get("comm_s") == 0 and r["bytes_per_step"] > 0 and dense:
            # DDP-style: no collective or wait the Communicator saw (communication runs inside
            # backward), so its compute includes the communication; use ssgd's.
            compute, note = dense["compute_s"], "compute from ssgd (communication hidden in backward)"
        pattern, origin = _pattern(r["method"])
        out[r["method"]] = cm.MethodProfile(r["method"], compute, r["bytes_per_step"], r["collectives_per_step"],
                                            data["workers"], pattern, origin, data.get("batch_per_worker", batch),
                                            f"{path} (loopback, {note})")
    return out, str(path)


def _pattern(method: str) -> tuple[str, str]:
    from commlab.registry import ALGORITHMS

    return cm.pattern_for(method, ALGORITHMS.get(method) if method in ALGORITHMS else None)


def measure_profile(args, method: str, workers: int, workdir: Workdir, net=None) -> dict:
    config, warm = steady_config(args, method, workers)
    config["train"]["test_subset"] = 500
    run = run_training(config, workdir, net)
    if "error" in run:
        raise RuntimeError(f"{method} at P={workers} failed: {run['error'][-400:]}")
    return step_summary(run["points"], workers, args.batch_size, from_step=warm)


def measured_communication(measured: dict, predicted) -> dict:
    """What an emulated run spent communicating per step beside the model's communication term:
    ``comm_s`` (the collectives' own time plus the waits on asynchronous ones, the same for every
    method), its share of the step, and the model's error on it; None where the run did not log a
    counter (a method whose collectives run inside backward, as DDP's, shows 0 here)."""
    comm = measured.get("comm_s")
    return {"emulated_comm_s": comm, "emulated_blocked_s": measured.get("blocked_s"),
            "emulated_comm_share": comm / measured["step_s"] if comm is not None and measured["step_s"] else None,
            "comm_error_pct": (predicted.comm_s / comm - 1) * 100 if comm else None}


def validate(args, workdir: Workdir) -> dict:
    """Predicted (model fed by a loopback run at the same P) vs measured step time on emulated links."""
    reason = emulation_unavailable()
    if reason:
        return {"skipped": reason}
    rows = []
    for p in args.validate_workers:
        for method in args.validate_methods:
            base = measure_profile(args, method, p, workdir)
            pattern, origin = _pattern(method)
            prof = cm.MethodProfile(method, base["compute_s"], base["bytes_per_step"], base["collectives_per_step"],
                                    p, pattern, origin, args.batch_size, "loopback run")
            for mbit in args.validate_mbit:
                with network_context(mbit, p) as net:
                    measured = measure_profile(args, method, p, workdir, net)
                    link_mbit = net.params["network_measured_mbit"]
                link = cm.link_from_measurement(f"{mbit:g}Mbit emulated", link_mbit, args.alpha_us * 1e-6)
                pred = cm.predict(prof, p, link)
                own = cm.predict(cm.MethodProfile(method, measured["compute_s"], prof.bytes_per_step,
                                                  prof.collectives_per_step, p, pattern), p, link)
                row = {"method": method, "workers": p, "link_mbit": mbit, "measured_link_mbit": link_mbit,
                       "measured_step_s": measured["step_s"], "predicted_step_s": pred.step_s,
                       "predicted_comm_s": pred.comm_s, "loopback_compute_s": prof.compute_s,
                       "emulated_compute_s": measured["compute_s"], **measured_communication(measured, pred),
                       "predicted_step_s_own_compute": own.step_s,
                       "error_pct": (pred.step_s / measured["step_s"] - 1) * 100,
                       "error_pct_own_compute": (own.step_s / measured["step_s"] - 1) * 100}
                row["within_25pct"] = abs(row["error_pct"]) <= 25
                rows.append(row)
                print(f"[scaling] validate {method} P={p} {mbit:g} Mbit/s: measured {row['measured_step_s']:.4f} s, "
                      f"predicted {row['predicted_step_s']:.4f} s ({row['error_pct']:+.1f}%)", flush=True)
    return {"alpha_s": args.alpha_us * 1e-6, "rows": rows,
            "all_within_25pct": all(r["within_25pct"] for r in rows)}


def predictions(profiles: dict[str, cm.MethodProfile], ps: list[int], links: list[cm.Link]) -> list[dict]:
    dense = profiles.get("ssgd")
    return [cm.predict(prof, p, link, dense).as_dict() for prof in profiles.values() for link in links for p in ps]


def paper_scale(profiles: dict[str, cm.MethodProfile], ps: list[int], cluster: cm.Cluster) -> list[dict]:
    """ResNet-50 on the cluster's GPUs: each method's bytes scaled by gradient size (a MODEL)."""
    dense = profiles.get("ssgd")
    if dense is None or dense.payload_bytes <= 0:
        return []
    scale = cluster.grad_bytes / dense.payload_bytes
    scaled = {m: cm.MethodProfile(m, cluster.compute_s, prof.bytes_per_step * scale, prof.collectives_per_step,
                                  prof.workers, prof.pattern, prof.pattern_source, cluster.batch_per_gpu,
                                  f"{prof.source}; bytes x {scale:.1f}, compute of {cluster.name}")
              for m, prof in profiles.items()}
    rows = [cm.predict(prof, p, cluster.link, scaled["ssgd"]).as_dict() for prof in scaled.values() for p in ps]
    for r in rows:
        r["cluster"] = cluster.name
    return rows


def plot(rows: list[dict], link: str, out: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in sorted({r["method"] for r in rows}):
        pts = sorted((r["workers"], r["speedup_vs_dense"]) for r in rows if r["method"] == method and r["link"] == link)
        ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers P")
    ax.set_ylabel("speed-up over dense ssgd (model)")
    ax.set_title(f"COST MODEL prediction (alpha-beta), not measured: {link}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)


@BENCHMARKS.register("scaling")
def scaling(argv: list[str], json_path: str | None = None) -> int:
    """Cost-model predictions to 1024 workers, validated against emulated runs at P = 4 and 8."""
    parser = argparse.ArgumentParser(prog="commlab bench scaling", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default=f"{OUT_DIR}/throughput.json",
                        help="throughput benchmark JSON with the measured method profiles")
    parser.add_argument("--workers-list", nargs="+", type=int, default=DEFAULT_P, help="P values to predict")
    parser.add_argument("--links", nargs="+", default=list(cm.LINKS), choices=list(cm.LINKS), help="named links")
    parser.add_argument("--validate-workers", nargs="+", type=int, default=[4, 8], help="P of the validation runs")
    parser.add_argument("--validate-mbit", nargs="+", type=float, default=[100.0, 1000.0],
                        help="emulated link rates of the validation runs")
    parser.add_argument("--validate-methods", nargs="+", default=["ssgd"], help="methods validated (default ssgd)")
    parser.add_argument("--no-validate", action="store_true", help="skip the validation runs")
    parser.add_argument("--max-steps", type=int, default=30, help="steps per validation run (default 30)")
    parser.add_argument("--alpha-us", type=float, default=50.0,
                        help="per-message latency assumed on emulated links, microseconds (default 50)")
    parser.add_argument("--gpu-models", nargs="+", default=["cnn", "resnet20", "resnet50"],
                        help="models whose CUDA step time is measured when a GPU exists")
    add_training_arguments(parser)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.dataset = resolve_dataset(args)
    args.epochs = 1

    workdir = Workdir(keep=args.keep)
    try:
        path = Path(args.profiles)
        if path.exists():
            profiles, source = profiles_from_throughput(path, args.batch_size)
        else:
            profiles, source = {}, "loopback runs made by this benchmark (no throughput JSON)"
            for method in args.methods or ["ssgd", "ddp"]:
                s = measure_profile(args, method, 4, workdir)
                pattern, origin = _pattern(method)
                profiles[method] = cm.MethodProfile(method, s["compute_s"], s["bytes_per_step"],
                                                    s["collectives_per_step"], 4, pattern, origin, args.batch_size,
                                                    "loopback run")
        if "ssgd" not in profiles:
            raise SystemExit("the profiles need dense ssgd (the reference of every speed-up)")
        validation = {"skipped": "--no-validate"} if args.no_validate else validate(args, workdir)
    finally:
        workdir.close()

    links = [cm.LINKS[name] for name in args.links]
    laptop = predictions(profiles, args.workers_list, links)
    paper = [row for name in ("V100x16@10Gbit", "V100x16@100Gbit")
             for row in paper_scale(profiles, args.workers_list, cm.CLUSTERS[name])]
    dense = profiles["ssgd"]
    matching = [{"cluster": c.name, "ratio_comm_to_compute": c.ratio, "cluster_comm_s": c.comm_s,
                 "cluster_compute_s": c.compute_s, "note": c.note,
                 "matching_mbit": cm.matching_bandwidth_mbit(dense.payload_bytes, dense.compute_s, dense.workers, c)}
                for c in cm.CLUSTERS.values()]
    target = args.json_path or json_path
    out_dir = Path(target).parent if target else Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figure = plot(paper, "10Gbit", out_dir / "scaling_v100_10gbit.png") if paper else None
    payload = {"label": cm.MODEL_LABEL, "profiles_source": source,
               "profiles": {m: {**vars(p), "payload_bytes": p.payload_bytes} for m, p in profiles.items()},
               "links": {lk.name: {"bandwidth_gbit": lk.bandwidth_gbit, "alpha_s": lk.alpha_s} for lk in links},
               "predictions_laptop": laptop, "predictions_resnet50_v100": paper, "validation": validation,
               "ratio_matching": matching, "figure": figure, "gpu": gpu_model_step_times(args.gpu_models)}

    md = [f"**All predictions below are a {cm.MODEL_LABEL}.** Inputs measured: {source}.", "",
          "## Validation against emulated runs (measured)", ""]
    if "rows" in validation:
        md += [md_table(validation["rows"], [("method", "method"), ("workers", "P"), ("link_mbit", "link Mbit/s"),
                                             ("measured_step_s", "measured s/step"),
                                             ("predicted_step_s", "predicted s/step"), ("error_pct", "error %"),
                                             ("error_pct_own_compute", "error % (own compute)"),
                                             ("emulated_comm_s", "measured comm s/step"),
                                             ("emulated_comm_share", "comm share"),
                                             ("predicted_comm_s", "model comm s/step"),
                                             ("comm_error_pct", "comm error %")]),
               "", "Predicted = loopback compute at the same P + model communication on the measured link; "
               "'own compute' uses the emulated run's compute instead (validates the communication term only). "
               "Measured comm = the collectives' own time plus the waits on asynchronous ones, per step "
               "(comm_s); comm share = measured comm / measured step."]
    else:
        md.append(f"skipped: {validation['skipped']}")
    pick = [r for r in paper if r["workers"] in (16, 64, 256, 1024)]
    md += ["", "## ResNet-50 on V100 nodes (model: measured bytes scaled to ResNet-50, assumed compute)", "",
           md_table(pick, [("cluster", "cluster"), ("method", "method"), ("workers", "P"), ("step_s", "s/step"),
                           ("speedup_vs_dense", "speed-up vs ssgd")])]
    md += ["", "## Emulated bandwidth matching a cluster's communication/computation ratio", "",
           f"Local dense run: {dense.payload_bytes / 1e6:.3f} MB gradient, {dense.compute_s * 1e3:.1f} ms compute per "
           f"step at P = {dense.workers}. bandwidth = 2(P-1)/P x gradient / (ratio x compute).", "",
           md_table(matching, [("cluster", "cluster"), ("cluster_comm_s", "ring allreduce s"),
                               ("cluster_compute_s", "compute s"), ("ratio_comm_to_compute", "ratio"),
                               ("matching_mbit", "matching Mbit/s")])]
    gpu = payload["gpu"]
    md += ["", "## GPU step times", "", gpu.get("skipped") or md_table(
        [{"model": k, **v} for k, v in gpu["models"].items()], [("model", "model"), ("step_s", "s/step"),
                                                                  ("params", "parameters")])]
    write_report("scaling", payload, "\n".join(md), target, args.out_dir)
    return 0
