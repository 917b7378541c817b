"""Shared pieces of the benchmark suite (docs/network.md, section 4): output files, environment, training runs.

Every benchmark writes ``reports/bench/<name>.json`` (machine-readable, with an ``environment``
block naming the host, the device and the commit) and ``reports/bench/<name>.md`` (a short
summary). Training-based benchmarks run ``commlab train`` on their workers, on loopback or inside
an :class:`~commlab.launch.netem.EmulatedNetwork`, with a private MLflow store, and read the logged
cumulative counters back to get per-step time, compute, bytes and collectives. On emulated links
every run also keeps each rank's log-point totals beside its link's counters
(:mod:`commlab.launch.wire_logs`), from which :func:`wire_summary` takes the bytes on the wire of the
measured window.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from commlab.config import apply_override
from commlab.provenance import environment

OUT_DIR = "reports/bench"
SPEED_TEST_SUBSET = 500  # test images a speed run's final evaluation scores
POINT_KEYS = ("wall_seconds", "samples", "compute_seconds", "comm_seconds", "bytes_sent", "bytes_recv",
              "collectives_global", "collectives_local", "reductions_global", "blocked_seconds",
              "selection_seconds", "train_loss", "test_accuracy")


# ---------------------------------------------------------------------- arguments and sizes
def parse_size(text: str) -> int:
    """``"16M"`` -> 16777216, ``"1K"`` -> 1024, ``"1000"`` -> 1000."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper()
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 1024, 64K, 16M)") from None


def parse_network(text: str) -> float | str:
    """``loopback``, ``unshaped`` (namespaces without shaping) or a bandwidth in Mbit/s."""
    if text in ("loopback", "unshaped"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"network must be loopback, unshaped or Mbit/s, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth must be positive, got {text!r}")
    return value


def network_name(net: float | str) -> str:
    return net if isinstance(net, str) else f"{net:g}Mbit"


def bench_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of ``commlab bench NAME``: its module docstring's first paragraph as
    the description, the rest as the epilog."""
    return argparse.ArgumentParser(prog=f"commlab bench {name}", description=doc.split("\n\n")[0],
                                   epilog=doc.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default=OUT_DIR, help=f"folder for <name>.json and <name>.md (default {OUT_DIR})")
    parser.add_argument("--json", dest="json_path", metavar="FILE",
                        help="write the JSON here instead (the markdown goes beside it)")


def emulation_unavailable() -> str | None:
    """Why namespaces cannot be built here, or None when they can."""
    from commlab.launch.netem import NetemError, preflight

    try:
        preflight()
    except NetemError as err:
        return str(err)
    return None


# ---------------------------------------------------------------------- output
def md_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A markdown table of ``rows`` with ``(key, header)`` columns; floats get 4 significant digits."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report(name: str, payload: dict, markdown: str, json_path: str | None = None,
                 out_dir: str = OUT_DIR) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.json`` and ``.md`` (``json_path`` overrides the JSON file; the
    markdown then goes beside it). Returns both paths and prints the markdown."""
    payload = {"benchmark": name, "environment": environment(), **payload}
    jpath = Path(json_path) if json_path else Path(out_dir) / f"{name}.json"
    mpath = jpath.with_suffix(".md")
    jpath.parent.mkdir(parents=True, exist_ok=True)
    jpath.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    env = payload["environment"]
    header = (f"# Benchmark `{name}`\n\nMeasured on {env['device']}, {env['cpus']} CPUs (load average "
              f"{env['load_average'][0]} at the end), torch {env['torch']}, commit {env['git_commit'][:12]}, "
              f"{env['time']}.\n\n")
    mpath.write_text(header + markdown.rstrip() + "\n")
    print(header + markdown)
    print(f"[bench] wrote {jpath} and {mpath}")
    return jpath, mpath


# ---------------------------------------------------------------------- training runs
@contextmanager
def network_context(net: float | str, workers: int):
    """Yield None for loopback, else an up EmulatedNetwork (torn down on exit)."""
    if net == "loopback":
        yield None
        return
    from commlab.launch.netem import EmulatedNetwork, NetworkSpec

    spec = NetworkSpec(bandwidth_mbit=None if net == "unshaped" else float(net))
    with EmulatedNetwork(workers, spec) as emulated:
        yield emulated


class Workdir:
    """A scratch folder with a private MLflow store for the runs of one benchmark invocation."""

    def __init__(self, keep: bool = False):
        self.path = Path(tempfile.mkdtemp(prefix="commlab-bench-"))
        self.keep = keep
        self.uri = f"sqlite:///{self.path / 'mlflow.db'}"
        self.count = 0
        try:
            # Once, before any worker touches the store (two workers creating it at once fail).
            from commlab.tracking import ensure_experiments

            ensure_experiments(["bench"], self.uri)
        except BaseException:  # an error or a signal before the caller holds the folder to close it
            self.close()
            raise

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


def run_training(config: dict, workdir: Workdir, net=None, timeout_note: str = "") -> dict:
    """Run one training config on its workers (in ``net`` if given) and return what it logged:
    ``{"rc", "seconds", "points": [{step, key: value}], "final", "log"}``. The workers are forked
    from this process's preloaded fork server (:mod:`commlab.launch.preloaded`): new processes for
    every run, without each paying the imports again."""
    from commlab.launch import run_in_network, run_on_loopback
    from commlab.launch.torchrun import network_override, train_argv

    workdir.count += 1
    folder = workdir.path / f"run{workdir.count:03d}"
    folder.mkdir()
    config = {**config, "output_dir": str(folder / "out"),
              "tracking": {"enabled": True, "uri": workdir.uri, "experiment": "bench"}}
    config["train"] = {**config.get("train", {}), "checkpoint_every_epochs": 0}
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    sentinel = folder / "sentinel.json"
    argv = train_argv(str(folder / "config.yaml"), str(sentinel), [network_override(net)] if net else [])
    env = {"MLFLOW_TRACKING_URI": workdir.uri, "OMP_NUM_THREADS": str(config.get("threads", 1))}
    log = str(folder / "train.log")
    t0 = time.perf_counter()
    if net is None:
        rc = run_on_loopback(argv, config["workers"], extra_env=env, log=log, preloaded=True)
    else:
        from commlab.core.stats import WIRE_LOG_ENV

        before = net.counters()
        rc = run_in_network(net, argv, extra_env={**env, WIRE_LOG_ENV: str(folder / "wire")}, log=log,
                            preloaded=True)
        wire_run = (before, net.counters())
    result = {"rc": rc, "seconds": time.perf_counter() - t0, "points": [], "final": {}, "log": log}
    if rc != 0 or not sentinel.exists():
        tail = Path(log).read_text(errors="replace")[-1500:] if Path(log).exists() else ""
        result["error"] = f"exit code {rc}: {tail.strip()}"
        return result
    record = json.loads(sentinel.read_text())
    result["final"] = record.get("final", {})
    result["points"] = metric_points(workdir.uri, record["run_id"])
    if net is not None:
        from commlab.launch.wire_logs import counters_delta, read_logs

        result["wire_logs"] = read_logs(folder / "wire", config["workers"])
        result["wire_run"] = counters_delta(*wire_run)
    return result


def metric_points(uri: str, run_id: str) -> list[dict]:
    """The run's logged metrics as one dict per logged step."""
    from commlab.tracking import client

    store = client(uri)
    by_step: dict[int, dict] = {}
    for key in POINT_KEYS:
        for point in store.get_metric_history(run_id, key):
            by_step.setdefault(point.step, {"step": point.step})[key] = point.value
    return [by_step[s] for s in sorted(by_step)]


#: What a step's timing fields mean, the same for every method (docs/network.md, section 7); every
#: ``*_s`` figure is seconds per step, rank 0's, between two log points.
TIMING_FIELDS = {
    "step_s": "wall-clock seconds per step (host clock)",
    "compute_s": "the steps' own time less the communication they waited for (collective_s + blocked_s); "
                 "communication hidden behind backward is inside it",
    "collective_s": "the collectives' own time: a synchronous collective whole, an asynchronous one its launch",
    "blocked_s": "the waits on asynchronous collectives (the part of their time nothing hid)",
    "comm_s": "collective_s + blocked_s: the time a step spent communicating, whatever the method",
    "selection_s": "the sparse methods' top-k and threshold selections (inside compute_s)",
}


def _per_step(first: dict, last: dict, key: str, steps: int) -> float | None:
    """The growth of a cumulative counter per step; None (not measured) where a point lacks it."""
    if key not in first or key not in last:
        return None
    return (last[key] - first[key]) / steps


def _total(*parts: float | None) -> float | None:
    """The sum of figures, None (not measured) when one of them is."""
    return None if any(p is None for p in parts) else sum(parts)


def step_summary(points: list[dict], workers: int, batch: int, from_step: int = 0) -> dict:
    """Per-step rates between the first logged point at or after ``from_step`` (the end of the
    method's dense warm-up; start-up excluded) and the last one. The timing fields mean the same
    for every method (:data:`TIMING_FIELDS`); a counter the run did not log is None (not
    measured), never 0."""
    pts = [p for p in points if "wall_seconds" in p and p["step"] >= from_step]
    if len(pts) < 2:
        raise ValueError(f"need two logged points with wall_seconds from step {from_step}, got {len(pts)}; "
                         f"raise max_steps or lower log_every")
    first, last = pts[0], pts[-1]
    steps = last["step"] - first["step"]
    wall = last["wall_seconds"] - first["wall_seconds"]

    def per_step(key: str) -> float | None:
        return _per_step(first, last, key, steps)

    collective, blocked = per_step("comm_seconds"), per_step("blocked_seconds")
    return {"steps_measured": steps, "from_step": first["step"], "step_s": wall / steps,
            "samples_per_s": steps * workers * batch / wall if wall > 0 else None,
            "compute_s": per_step("compute_seconds"), "collective_s": collective, "blocked_s": blocked,
            "comm_s": _total(collective, blocked), "selection_s": per_step("selection_seconds"),
            "bytes_per_step": per_step("bytes_sent"),
            "collectives_per_step": _total(per_step("collectives_global"), per_step("collectives_local")),
            "reductions_per_step": per_step("reductions_global")}


def wire_summary(result: dict, from_step: int = 0) -> dict:
    """Bytes on the wire of an emulated run's measured window (the same log points as
    :func:`step_summary`), per step: ``per_rank`` and ``sum`` of the accounted bytes and the link's
    counters, and the whole run's counters (``run``: rendezvous, warm-up and evaluation included).

    Every rank's log has one line per log point, in order; rank 0's accounted bytes at each line
    must equal its logged ``bytes_sent``, which checks that line and step agree."""
    from commlab.launch.wire_logs import window

    logged = [p for p in result["points"] if "wall_seconds" in p]
    logs = result["wire_logs"]
    if len(logs[0]) != len(logged) or any(line["bytes_sent"] != p.get("bytes_sent", line["bytes_sent"])
                                          for line, p in zip(logs[0], logged, strict=False)):
        raise ValueError(f"rank 0's wire log ({len(logs[0])} points) does not match its logged points "
                         f"({len(logged)}): cannot place the window")
    first = next(i for i, p in enumerate(logged) if p["step"] >= from_step)
    last = len(logged) - 1
    out = window(logs, first, last, logged[last]["step"] - logged[first]["step"])
    out["from_step"], out["to_step"] = logged[first]["step"], logged[last]["step"]
    out["run"] = result["wire_run"]
    return out


@functools.cache
def grid_method_params(method: str, papers_dir: str = "config/papers", config_file: str = "config/config.yaml") -> dict:
    """``method``'s options as the laptop-scale paper grids run it: those of its first run in the
    first grid (in the default config's paper order) that has one; {} when no grid runs it."""
    from commlab.grid import resolve_grid

    try:
        order = yaml.safe_load(Path(config_file).read_text()).get("papers", [])
    except OSError:
        order = []
    papers = list(dict.fromkeys([*order, *sorted(p.stem for p in Path(papers_dir).glob("*.yaml"))]))
    for paper in papers:
        for run in resolve_grid(paper, scale="laptop", papers_dir=papers_dir).values():  # the grid's order
            if run["method"] == method:
                return dict(run.get("method_params") or {})
    return {}


def warmup_steps(config: dict) -> int:
    """Dense warm-up steps of a run config's method (its ``warmup_steps`` option, 0 if it has none)."""
    from dataclasses import fields

    from commlab.registry import ALGORITHMS

    defaults = {f.name: f.default for f in fields(ALGORITHMS.get(config["method"]).Options)}
    return int((config.get("method_params") or {}).get("warmup_steps", defaults.get("warmup_steps", 0)) or 0)


def method_params(args, method: str) -> dict:
    """``method``'s options for a benchmark: the paper grids' (``--options grid``) or none (its
    defaults), then ``--param METHOD.key=value``."""
    params = dict(grid_method_params(method)) if getattr(args, "options", "defaults") == "grid" else {}
    chosen: dict = {}
    for assignment in args.param or []:  # METHOD.KEY=VALUE, parsed as run-config overrides are
        apply_override(chosen, assignment)
    params.update(chosen.get(method) or {})
    return params


def base_config(args, method: str, workers: int, steady: bool = True) -> dict:
    """A short training run of ``method`` from the benchmark's common options. Method options come
    from the paper grids (``--options grid``, the default) or the method's defaults, then
    ``--param``; ``steady`` with ``--no-warmup`` sets a method's ``warmup_steps`` to 0."""
    config = {"paper": "bench", "name": method, "method": method, "seed": args.seed, "workers": workers,
              "model": args.model, "dataset": args.dataset, "data_dir": args.data_dir, "threads": 1,
              "timeout_s": 300.0,
              "train": {"epochs": getattr(args, "epochs", 1), "batch_size": args.batch_size, "lr": args.lr,
                        "log_every": args.log_every, "max_steps": getattr(args, "max_steps", None)}}
    params = method_params(args, method)
    if steady and getattr(args, "no_warmup", False):
        from dataclasses import fields

        from commlab.registry import ALGORITHMS

        if "warmup_steps" in {f.name for f in fields(ALGORITHMS.get(method).Options)}:
            params["warmup_steps"] = 0
    if params:
        config["method_params"] = params
    return config


def steady_config(args, method: str, workers: int) -> tuple[dict, int]:
    """A speed run of ``method``: its dense warm-up (if any) and then ``--max-steps`` measured steps;
    returns the config and the step from which to measure."""
    config = base_config(args, method, workers)
    warm = warmup_steps(config)
    if config["train"].get("max_steps") is not None:
        config["train"]["max_steps"] += warm
    # A speed run's accuracy is not what it measures: its final evaluation scores a few batches.
    config["train"]["test_subset"] = SPEED_TEST_SUBSET
    return config, warm


def add_training_arguments(parser: argparse.ArgumentParser, model: str = "cnn") -> None:
    parser.add_argument("--model", default=model, help=f"registered model (default {model})")
    parser.add_argument("--dataset", default="auto",
                        help="registered dataset; auto = fashion_mnist when prepared, else synthetic")
    parser.add_argument("--data-dir", default="data/prepared", help="prepared-data folder")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5, help="steps between logged points (default 5)")
    parser.add_argument("--methods", nargs="*", help="methods to run (default: every registered method)")
    parser.add_argument("--param", action="append", metavar="METHOD.key=value",
                        help="a method option, e.g. --param kstep.period=8 (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder of the runs (logs, MLflow)")
    parser.add_argument("--options", choices=["grid", "defaults"], default="grid",
                        help="method options: as the laptop-scale paper grids run each method (default), "
                             "or each method's defaults")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip each method's dense warm-up (warmup_steps=0); by default it runs and "
                             "speed is measured after it (steady state)")


def resolve_dataset(args) -> str:
    if args.dataset != "auto":
        return args.dataset
    return "fashion_mnist" if (Path(args.data_dir) / "fashion_mnist").exists() else "synthetic"


def resolve_methods(requested: list[str] | None) -> list[str]:
    """``requested`` or every method of the package, dense ``ssgd`` first (the reference). The
    default leaves out methods registered at run time by a plugin in this process: the
    benchmarks' ranks start as new processes, which know the package's methods only."""
    from commlab.registry import ALGORITHMS

    names = requested or ALGORITHMS.package_names()
    unknown = [m for m in names if m not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; registered: {ALGORITHMS.names()}")
    return ["ssgd", *[m for m in names if m != "ssgd"]]


# ---------------------------------------------------------------------- GPU figures
def model_input(name: str) -> tuple[int, int, int]:
    """(channels, image size, classes) of the inputs a registered model is benchmarked on: the
    Fashion-MNIST shape for the small models, CIFAR-10's for the others, ImageNet's for ResNet-50."""
    if name in ("cnn", "mlp", "wide_mlp"):
        return 1, 28, 10
    return (3, 224, 1000) if name == "resnet50" else (3, 32, 10)


def gpu_model_step_times(models: list[str], batch: int = 32, steps: int = 20) -> dict:
    """Forward+backward+SGD step time of each model on CUDA, or a skip note without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine: GPU step times not measured"}
    from commlab.models import build_model

    device = torch.device("cuda", 0)
    out = {"device": torch.cuda.get_device_name(0), "batch": batch, "models": {}}
    for name in models:
        channels, size, classes = model_input(name)
        model = build_model(name, channels, classes, size).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(batch, channels, size, size, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        times = []
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        times.sort()
        out["models"][name] = {"step_s": times[len(times) // 2],
                               "params": sum(p.numel() for p in model.parameters()),
                               "input": [channels, size, size]}
    return out
