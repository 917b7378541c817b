"""``commlab bench syncs``: host synchronisations per training step of every method, against a budget.

On a GPU a step is fast only if the host keeps queueing kernels; every call that makes it wait
for the device (reading a number, a data-dependent shape, a host copy) drains the queue. This
benchmark counts those calls in one training step of each method, as the loop takes it
(:func:`commlab.loop.method.take_step`: forward, backward, the method's hooks, clipping, the
optimizer, then the loop's loss accumulation), outside log points: on the CPU with
:class:`commlab.bench.opcount.HostSyncCounter` (what would wait on CUDA), and, where CUDA is
present, also what ``torch.cuda.set_sync_debug_mode`` reports. Counts are deterministic, so the
budget is a verdict, not a timing (docs/performance.md, "Host-sync budget").

Every method runs in one world of ``--workers`` gloo ranks on batches of the run's dataset
(Fashion-MNIST when prepared, else the synthetic one: ``--dataset``), each rank its own slice,
with the options the laptop-scale paper grids give it (``--options defaults``: its own) and its
dense warm-up cut to one step; then ``--steps`` measured steps. Steps are split by kind: ``step`` (every step of a
method that synchronises every step), ``local`` / ``reduction`` (the periodic family: steps
without and with a model average), ``recompute`` (Ok-Topk steps that recompute a threshold or
re-split the regions: on the rank that did, since a local threshold is a rank's own). A count
is the largest over ranks and over steps of that kind; ``rank-steps`` says how many there were.

Budget (outside log points): each method declares its own on its class
(``host_sync_budget``, a :class:`commlab.algorithms.base.SyncBudget`: the most syncs per step
kind, e.g. 0 on every step of ssgd, 0 on the local steps of kstep, at most 8 on a typical step of
a sparse method and 16 on Ok-Topk's recompute steps), or why it has none; its rows without a
budget are reported as measured.

    commlab bench syncs                                 # every method, 4 workers, the CNN
    commlab bench syncs --methods oktopk redsync --steps 40 --workers 2
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from commlab.bench.common import add_output_arguments, bench_parser, md_table, method_params, write_report
from commlab.registry import BENCHMARKS

#: The kinds of step a budget may name (the module docstring says which steps are which).
STEP_KINDS = ("step", "local", "reduction", "recompute")
WARMUP = 1  # dense warm-up steps kept (a method's own warm-up is cut to this)


def budget(method: str) -> dict[str, int] | None:
    """``method``'s declared budget, {step kind: most host syncs outside log points}; None when
    it declares none (a reason, or nothing: its rows are reported as measured)."""
    from commlab.registry import ALGORITHMS

    declared = ALGORITHMS.get(method).host_sync_budget
    return dict(declared.limits) if declared is not None and declared.limits else None


def unbudgeted_reason(method: str) -> str | None:
    """Why ``method`` has no budget (None: it has one); "not declared" when it says nothing."""
    from commlab.registry import ALGORITHMS

    declared = ALGORITHMS.get(method).host_sync_budget
    if declared is None:
        return "not declared"
    return declared.unbudgeted or None


def _step_kind(reductions: int, recomputes: float) -> str:
    if recomputes:
        return "recompute"
    return "reduction" if reductions else "local"


def batches(dataset: str, data_dir: str, rank: int, world: int, batch: int, steps: int) -> tuple[list, tuple]:
    """This rank's ``steps`` batches (inputs normalised, labels) of ``dataset``, consecutive
    slices of its training set, and the inputs' (channels, size, classes)."""
    from commlab.data import load_dataset
    from commlab.loop.batches import normaliser

    data = load_dataset(dataset, data_dir)
    spec, n = data.spec, len(data.train_y)
    normalise = normaliser(spec.mean, spec.std, torch.device("cpu"))
    out = []
    for step in range(steps):
        idx = (torch.arange(batch) + (step * world + rank) * batch) % n
        out.append((normalise(data.train_x[idx]), data.train_y[idx]))
    return out, (spec.channels, spec.image_size, spec.num_classes)


def measure_rank(rank: int, world: int, runs: list[dict], steps: int, model: str, batch: int, device: str,
                 dataset: str, data_dir: str) -> list:
    """On one rank: every run's per-step host syncs (list of dicts per run)."""
    import torch.distributed as dist

    from commlab.algorithms.base import StepInfo
    from commlab.bench.opcount import HostSyncCounter, cuda_sync_warnings
    from commlab.config import DEFAULTS
    from commlab.core import CommStats, Communicator
    from commlab.core.runtime import Runtime
    from commlab.loop.loop import add_loss
    from commlab.loop.method import backward, build_method, take_step
    from commlab.models import build_model

    dev = torch.device(device)
    total = WARMUP + steps
    inputs, (channels, size, classes) = batches(dataset, data_dir, rank, world, batch, total)
    out = []
    for run in runs:
        torch.manual_seed(0)
        net = build_model(model, channels, classes, size).to(dev)
        comm = Communicator(stats=CommStats())
        runtime = Runtime(rank, world, rank, dist.get_backend(), dev)
        train = {**DEFAULTS["train"], "batch_size": batch, "lr": 0.01}
        algo = build_method(run["method"], net, comm, run["params"], runtime=runtime, train=train, seed=0,
                            steps_per_epoch=total, total_steps=total, workers_per_node=world)
        window = torch.zeros((), dtype=torch.float64, device=dev)
        counter, records = HostSyncCounter(), []
        for step in range(total):
            x, y = (t.to(dev) for t in inputs[step])
            c = comm.stats.counters
            reductions0 = c["reductions_global"] + c["reductions_local"]
            recomputes0 = getattr(algo, "window", {}).get("recompute_steps", 0.0)
            counter.reset()
            with cuda_sync_warnings() as cuda, counter:
                loss = take_step(algo, StepInfo(step, 0, train["lr"]), lambda a=algo, x=x, y=y: backward(a, x, y))
                add_loss(window, loss)
            if step < WARMUP:
                continue
            records.append({
                "step": step, "syncs": counter.total, "by_kind": dict(counter.by_kind),
                "sites": dict(counter.sites), "cuda_syncs": len(cuda) if dev.type == "cuda" else None,
                "kind": _step_kind(c["reductions_global"] + c["reductions_local"] - reductions0,
                                   getattr(algo, "window", {}).get("recompute_steps", 0.0) - recomputes0)})
        algo.finish()
        out.append(records)
    return out


def summarise(runs: list[dict], per_rank: list[list[list[dict]]]) -> list[dict]:
    """One row per (run, step kind): steps, the largest and mean count over ranks and steps, the
    budget and the verdict, and where the worst step's syncs come from."""
    rows = []
    for i, run in enumerate(runs):
        # a rank's step is a recompute when that rank recomputed a threshold (some are rank-local)
        steps = [rec for rank in per_rank for rec in rank[i]]
        every = {rec["kind"] for rec in steps}
        if every <= {"reduction"}:  # synchronises every step: one kind
            for rec in steps:
                rec["kind"] = "step"
        elif every <= {"reduction", "recompute"}:
            for rec in steps:
                rec["kind"] = "step" if rec["kind"] == "reduction" else rec["kind"]
        limits = budget(run["method"]) or {}
        for kind in sorted({rec["kind"] for rec in steps}):
            mine = [rec for rec in steps if rec["kind"] == kind]
            worst = max(mine, key=lambda rec: rec["syncs"])
            most = limits.get(kind)
            row = {"method": run["name"], "kind": kind, "rank_steps": len(mine),
                   "max_syncs": worst["syncs"], "mean_syncs": statistics.fmean(r["syncs"] for r in mine),
                   "budget": most, "within_budget": None if most is None else worst["syncs"] <= most,
                   "worst_sites": dict(Counter(worst["sites"]).most_common(8))}
            cuda = [r["cuda_syncs"] for r in mine if r["cuda_syncs"] is not None]
            if cuda:
                row["cuda_max_syncs"] = max(cuda)
            rows.append(row)
    return rows


def plan_runs(args, methods: list[str]) -> list[dict]:
    """Each method's options (the grids' or its defaults, ``--param``), its warm-up cut to WARMUP."""
    from dataclasses import fields

    from commlab.registry import ALGORITHMS

    runs = []
    for method in methods:
        params = method_params(args, method)
        if "warmup_steps" in {f.name for f in fields(ALGORITHMS.get(method).Options)}:
            params["warmup_steps"] = min(WARMUP, params.get("warmup_steps", WARMUP))
        runs.append({"name": method, "method": method, "params": params})
    return runs


@BENCHMARKS.register("syncs")
def syncs(argv: list[str], json_path: str | None = None) -> int:
    """Host syncs per training step of every method, against the budget."""
    from commlab.bench.common import resolve_dataset, resolve_methods

    parser = bench_parser("syncs", __doc__)
    parser.add_argument("--methods", nargs="*", help="methods (default: every registered method)")
    parser.add_argument("--workers", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--steps", type=int, default=34,
                        help="measured steps after the warm-up (default 34: Ok-Topk's first recomputes)")
    parser.add_argument("--model", default="cnn", help="registered model (default cnn)")
    parser.add_argument("--dataset", default="auto",
                        help="registered dataset; auto = fashion_mnist when prepared, else synthetic")
    parser.add_argument("--data-dir", default="data/prepared", help="prepared-data folder")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker and step (default 32)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the ranks compute (cuda: gloo ranks sharing the GPU, also counted by "
                             "torch.cuda.set_sync_debug_mode)")
    parser.add_argument("--options", choices=["grid", "defaults"], default="grid",
                        help="method options: as the laptop-scale paper grids run each method (default), or defaults")
    parser.add_argument("--param", action="append", metavar="METHOD.key=value",
                        help="a method option, e.g. --param oktopk.global_recompute_every=4 (repeatable)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.workers < 1:
        parser.error("need --steps >= 1 and --workers >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    methods = resolve_methods(args.methods)
    runs = plan_runs(args, methods)
    args.dataset = resolve_dataset(args)

    from commlab.launch.ranks import run_ranks

    per_rank = run_ranks(measure_rank, args.workers, args=(runs, args.steps, args.model, args.batch_size,
                                                           args.device, args.dataset, args.data_dir),
                         timeout_s=1800, device=args.device)
    rows = summarise(runs, per_rank)
    failed = [r for r in rows if r["within_budget"] is False]
    payload = {"workers": args.workers, "steps": args.steps, "model": args.model, "dataset": args.dataset,
               "batch_per_worker": args.batch_size,
               "device": args.device, "options": args.options, "runs": runs,
               "budget": {run["name"]: budget(run["method"]) for run in runs}, "rows": rows,
               "all_within_budget": not failed}
    columns = [("method", "method"), ("kind", "step kind"), ("rank_steps", "rank-steps"), ("max_syncs", "max syncs"),
               ("mean_syncs", "mean"), *([("cuda_max_syncs", "CUDA max")] if args.device == "cuda" else []),
               ("budget", "budget"), ("verdict", "verdict")]
    md = [f"Host syncs per training step outside log points ({args.model}, {args.dataset}, {args.workers} gloo "
          f"ranks on {args.device}, {args.steps} steps after a {WARMUP}-step warm-up, "
          + ("the paper grids' method options" if args.options == "grid" else "default method options")
          + "): the largest count over ranks and steps of each kind, counted by intercepting torch calls "
          "that wait for a CUDA device" + (", and by torch.cuda.set_sync_debug_mode" if args.device == "cuda" else "")
          + ".", "",
          md_table([{**r, "verdict": "" if r["within_budget"] is None else ("ok" if r["within_budget"] else "OVER")}
                    for r in rows], columns), "",
          "All within budget." if not failed else
          "Over budget: " + "; ".join(f"{r['method']} ({r['kind']}): {r['max_syncs']} > {r['budget']} "
                                      f"({', '.join(r['worst_sites'])})" for r in failed)]
    unbudgeted = {run["name"]: why for run in runs if (why := unbudgeted_reason(run["method"]))}
    if unbudgeted:
        md += ["", "Without a budget: " + "; ".join(f"{name} ({why})" for name, why in unbudgeted.items()) + "."]
    write_report("syncs", payload, "\n".join(md), args.json_path or json_path, args.out_dir)
    return 0
