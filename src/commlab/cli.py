"""The ``commlab`` command (also ``python -m commlab``).

    commlab list                                   registered methods (with their files), models, datasets, benchmarks
    commlab train --config run.yaml [key=value]    one experiment (under torchrun, or alone)
    commlab launch --config run.yaml               start its workers (torchrun / srun + torchrun)
    commlab serve --socket PATH                    the warm launcher that local jobs' launches are forked from
    commlab data prepare fashion_mnist             prepare a dataset into data/prepared/
    commlab bench collectives [--json FILE]        a benchmark (see `commlab list`)
    commlab report --paper baseline                build a paper's report from MLflow
    commlab grid kstep [--scale smoke] [--run]     list (or run) a paper's experiment grid
    commlab mlflow-init baseline kstep ...         create MLflow experiments before parallel jobs
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _method_file(cls: type) -> str:
    """The file a method's class is defined in: relative to this folder when it is below it (a
    checkout's src/commlab/algorithms/<name>.py), else its full path (an installed package, a plugin)."""
    import inspect

    path = Path(inspect.getfile(cls)).resolve()
    return str(path.relative_to(Path.cwd().resolve())) if path.is_relative_to(Path.cwd().resolve()) else str(path)


def _cmd_list(args) -> int:
    from commlab.registry import ALGORITHMS, BENCHMARKS, DATASETS, MODELS

    print("methods:")
    width = max(map(len, ALGORITHMS.names()), default=0)
    for name in ALGORITHMS.names():
        print(f"  {name:<{width}}  {_method_file(ALGORITHMS.get(name))}")
    for title, registry in (("models", MODELS), ("datasets", DATASETS), ("benchmarks", BENCHMARKS)):
        print(f"{title}:")
        for name in registry.names():
            print(f"  {name}")
    return 0


def _cmd_train(args) -> int:
    from commlab.loop.worker import run

    return run(args)


def _cmd_data(args) -> int:
    from commlab.registry import DATASETS

    try:
        spec = DATASETS.get(args.name)
    except ValueError as err:  # names the known datasets
        print(f"commlab data prepare: {err}", file=sys.stderr)
        return 2
    if spec.generated:
        print(f"{args.name} is generated on the fly; nothing to prepare")
        return 0
    out = Path(args.out) / args.name
    try:
        meta = spec.prepare(out, source=args.source)
    except (FileNotFoundError, ValueError) as err:  # a missing or malformed source: the message says which
        print(f"commlab data prepare: {err}", file=sys.stderr)
        return 2
    print(f"prepared {args.name} in {out}: train {meta['train_shape']}, test {meta['test_shape']}, "
          f"hash {meta['content_hash'][:12]} (from {meta['source']})")
    return 0


def _cmd_launch(args) -> int:
    from commlab.launch.command import run

    return run(args.launch_argv, args)


def _cmd_serve(args) -> int:
    from commlab.launch.server import serve

    return serve(args.socket, args.parent, args.idle_exit_s)


def _cmd_bench(args) -> int:
    import signal

    from commlab.launch.netem import Terminated
    from commlab.launch.supervise import sigterm_raises
    from commlab.registry import BENCHMARKS

    try:
        bench = BENCHMARKS.get(args.name)
    except ValueError as err:  # names the known benchmarks
        print(f"commlab bench: {err}", file=sys.stderr)
        return 2
    # A cancelled job (Snakemake, SLURM) gets SIGTERM: unwind as on Ctrl-C, so that the runs'
    # workers are stopped and the scratch folder with its MLflow store is removed.
    try:
        with sigterm_raises():
            return bench(args.rest, json_path=args.json) or 0
    except Terminated as err:
        print(f"[bench] {signal.Signals(err.signum).name}: stopped", file=sys.stderr, flush=True)
        return 128 + err.signum


def _cmd_report(args) -> int:
    from commlab.report.build import main as build_main

    return build_main(args)


def _cmd_mlflow_init(args) -> int:
    from commlab.tracking import ensure_experiments

    ids = ensure_experiments(args.experiments)
    for name, exp_id in ids.items():
        print(f"{name}: {exp_id}")
    if args.marker:
        Path(args.marker).parent.mkdir(parents=True, exist_ok=True)
        Path(args.marker).write_text("\n".join(f"{k}\t{v}" for k, v in ids.items()) + "\n")
    return 0


def _cmd_grid(args) -> int:
    """List a paper's grid, or run it cell by cell (sequentially, each through ``commlab launch``)."""
    import subprocess
    import time

    import yaml

    from commlab.config import ConfigError, run_dir
    from commlab.grid import borrowed_runs, resolve_grid

    defaults = {}
    if args.workflow_config and Path(args.workflow_config).exists():
        defaults = (yaml.safe_load(Path(args.workflow_config).read_text()) or {}).get("defaults", {})
    try:
        configs = resolve_grid(args.paper, defaults, scale=args.scale)
    except ConfigError as err:
        print(f"commlab grid: {err}", file=sys.stderr)
        return 2
    selected = {k: v for k, v in configs.items() if not args.only or k[0] in args.only}
    lent = {k: v for k, v in borrowed_runs(args.paper, scale=args.scale).items() if not args.only or k[0] in args.only}
    if not args.run:
        for (name, seed), config in selected.items():
            print(f"{name}\tseed={seed}\tmethod={config['method']}\tworkers={config['workers']}"
                  f"\tnodes={config['nodes']}\tmodel={config['model']}\tdataset={config['dataset']}")
        for (name, seed), lender in lent.items():
            print(f"{name}\tseed={seed}\tborrowed from {lender} (`commlab grid {lender}` trains it)")
        return 0
    for (name, seed), lender in lent.items():
        print(f"[grid] {args.paper}/{name}/seed{seed}: borrowed from {lender}'s grid, not trained here", flush=True)
    started = time.perf_counter()
    for (name, seed), config in selected.items():
        folder = run_dir(config, root=args.results)  # scales get their own folders
        folder.mkdir(parents=True, exist_ok=True)
        config = {**config, "output_dir": str(folder)}
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [sys.executable, "-m", "commlab", "launch", "--config", str(folder / "config.yaml"),
               "--sentinel", str(folder / "sentinel.json")]
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"[grid] {args.paper}/{name}/seed{seed}: exit {rc} in {time.perf_counter() - t0:.1f} s", flush=True)
        if rc:
            return rc
    print(f"[grid] {args.paper} ({args.scale}): {len(selected)} runs in {time.perf_counter() - started:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from commlab.launch import add_arguments as launch_arguments  # one definition of the launch options
    from commlab.loop.worker import add_arguments as train_arguments  # and of the train options

    parser = argparse.ArgumentParser(prog="commlab", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1] if "\n\n" in __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="print registered methods, models, datasets and benchmarks")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("train", help="run one experiment",
                       description="Run one experiment. Under torchrun every worker runs this; alone it is "
                                   "a world of one worker. Overrides are dotted keys: train.lr=0.1 seed=3.")
    train_arguments(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("launch", help="start one experiment's workers (torchrun; srun across nodes)",
                       description="Validate the run config, then start its workers: torchrun --standalone on "
                                   "one node, srun + torchrun with c10d rendezvous across SLURM nodes.")
    launch_arguments(p)
    p.set_defaults(func=_cmd_launch)

    p = sub.add_parser("serve", help="the warm launcher: fork every local job's launcher from one process",
                       description="Import torch, the training loop and MLflow once, then serve `commlab launch` "
                                   "at a Unix socket: each job's launcher is forked from this process "
                                   "(jobs find it through COMMLAB_LAUNCH_SERVER; docs/performance.md).")
    p.add_argument("--socket", required=True, help="the Unix socket to listen at, in a folder of mode 0700")
    p.add_argument("--parent", type=int, help="exit when this process (the workflow) is no longer the parent")
    p.add_argument("--idle-exit-s", type=float, help="exit after this many seconds without a job")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("data", help="prepare datasets", description="Prepare a dataset into <out>/<name>/.")
    dsub = p.add_subparsers(dest="data_command", required=True)
    q = dsub.add_parser("prepare", help="prepare one dataset")
    q.add_argument("name", help="dataset name (commlab list)")
    q.add_argument("--source", help="folder with the raw files (default: known locations, then download)")
    q.add_argument("--out", default="data/prepared", help="prepared-data folder (default: data/prepared)")
    q.set_defaults(func=_cmd_data)

    p = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark; see `commlab list`. "
                       "Arguments after the name go to the benchmark (try `commlab bench NAME --help`).")
    p.add_argument("name", help="benchmark name")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="benchmark arguments")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("report", help="build reports from MLflow",
                       description="Execute a paper's report notebook against MLflow and export HTML; "
                                   "with --index, rebuild reports/index.html.")
    p.add_argument("--paper", action="append", default=[], help="paper to report (repeatable)")
    p.add_argument("--index", action="store_true", help="rebuild reports/index.html from the claims tables")
    p.add_argument("--out", default="reports", help="output folder (default: reports)")
    p.add_argument("--notebooks", default="workflow/notebooks", help="notebook folder")
    p.add_argument("--results", default="results/laptop",
                   help="folder of one scale's run sentinels (default: results/laptop)")
    p.add_argument("--snakemake-log", metavar="LOG",
                   help="with --index: the workflow run's Snakemake log, for how it spent its time (`latest`: the "
                        "newest in .snakemake/log)")
    p.add_argument("--scale", help="report only the runs tagged with this scale (smoke, laptop, laptop_full, "
                                   "paper); untagged runs count when no run is tagged; default: every run")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("grid", help="list or run a paper's experiment grid without Snakemake",
                       description="List the runs of config/papers/PAPER.yaml at a scale; with --run, run "
                                   "them one after another through commlab launch (Snakemake does this in parallel).")
    p.add_argument("paper")
    p.add_argument("--scale", default="laptop", help="laptop (default), smoke, laptop_full, or a paper scale: "
                                                      "paper, paper_32gpu, paper_imagenet, paper_imagenet_400, "
                                                      "paper_text (docs/paper-scale.md; the grid's file lists its own)")
    p.add_argument("--run", action="store_true", help="run the cells (default: only list them)")
    p.add_argument("--only", nargs="*", help="run names to keep")
    p.add_argument("--results", default="results", help="output root: runs go to RESULTS/SCALE/PAPER/...")
    p.add_argument("--workflow-config", default="config/config.yaml", help="source of the defaults")
    p.set_defaults(func=_cmd_grid)

    p = sub.add_parser("mlflow-init", help="create MLflow experiments (once, before parallel jobs)")
    p.add_argument("experiments", nargs="+", help="experiment names (one per paper)")
    p.add_argument("--marker", help="write a marker file listing the experiments")
    p.set_defaults(func=_cmd_mlflow_init)
    return parser


def _hand_over_launch(launch_argv: list[str]) -> None:
    """``commlab launch`` as a thin client: when a warm launcher answers (commlab.launch.client),
    the process ends with the job's exit status, having imported nothing but the client."""
    import time

    from commlab.launch.client import SERVER_ENV, served_launch
    from commlab.timeline import process_start_time

    if not os.environ.get(SERVER_ENV):
        return
    rc = served_launch(launch_argv, {"start": process_start_time(), "main": time.time()})
    if rc is None:
        os.environ.pop(SERVER_ENV)  # it said why; the launch below runs here without asking again
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(argv: list[str] | None = None, as_program: bool = False) -> int:
    """The command line's exit status. ``as_program`` (``python -m commlab``): a launch then ends
    the process at once (:func:`commlab.launch.command.end_process`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if as_program and argv[:1] == ["launch"] and not {"-h", "--help"} & set(argv):
        _hand_over_launch(argv[1:])  # returns only when no warm launcher answers
    args = build_parser().parse_args(argv)
    if args.func is _cmd_launch:
        args.launch_argv = argv[argv.index("launch") + 1:]  # as given, for the warm launcher to parse again
    try:
        rc = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader closed the pipe (``commlab grid ... | head``): what it read is all it wanted.
        # Point stdout at /dev/null so that the interpreter's own flush at exit raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    if as_program and args.func is _cmd_launch:
        from commlab.launch.command import end_process

        end_process(rc)
    return rc
