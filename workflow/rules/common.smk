"""Helpers for the rules in workflow/rules/*.smk: config validation, the experiment grid, input functions.

Only functions and settings live here. Everything is decided at parse time, before any job. The
workflow config is checked against workflow/schemas/config.schema.yaml, its `defaults` against the run
schema, and every paper's grid is resolved with commlab.grid.resolve_grid (which validates each
run config). A bad key or value stops Snakemake here with a message naming it.

Adding a paper means: config/papers/<paper>.yaml, its claims declared in
src/commlab/report/claims_<paper>.py, its figures in workflow/notebooks/<paper>.py, and its name in
config.yaml's `papers`. Nothing in the rules names a paper: the benchmark results a report reads
are the `BENCH` its claims module declares (SPEED_BENCH below).
"""

import json
import os
import shutil
import sys
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

ROOT = Path(workflow.basedir)
# The workflow and its jobs run the commlab of the environment Snakemake runs in: installed
# (editable) in .venv by `make`, or the checkout's src/ on PYTHONPATH (the Makefile exports both
# .venv/bin on PATH and src/ on PYTHONPATH; under --use-conda the rules' environment holds only
# the third-party packages, and PYTHONPATH brings commlab). Nothing here edits the environment.
try:
    from commlab.config import (
        DEFAULTS,
        ConfigError,
        deep_merge,
        run_dir as config_run_dir,
        validate_config,
    )
    from commlab.grid import borrowed_runs, resolve_grid
    from commlab.registry import DATASETS
    from commlab.report.claims import declarations
except ModuleNotFoundError as err:
    raise WorkflowError(
        f"{err}: run Snakemake in the project's environment "
        "(`make`, or `source .venv/bin/activate` first; README, Set-up)"
    ) from None

# The jobs' shell commands call `python`, `dvc`: those on PATH.
if shutil.which("python") is None:
    raise WorkflowError(
        "no `python` on PATH for the jobs' commands: `source .venv/bin/activate` (or run `make`)"
    )
if (
    Path(shutil.which("python")).parent.resolve()
    != Path(sys.executable).parent.resolve()
):
    print(
        f"note: jobs run {shutil.which('python')}, not Snakemake's {sys.executable}; "
        "activate the project's environment if that is not meant",
        file=sys.stderr,
    )

DATA_DIR = "data/prepared"  # DVC stage outputs: data/prepared/<dataset> (dvc.yaml)
MLFLOW_MARKER = "results/.mlflow_init"  # experiments exist; mlflow.db itself is never a file of the DAG
CONFIG_SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"


def _explain(err) -> str:
    """One line naming the offending key for a jsonschema error."""
    path = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = list(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(allowed))
        keys = ", ".join(f"{path}.{k}" if path else str(k) for k in extra)
        return f"unknown config key {keys} (allowed keys at {path or 'the top level'}: {', '.join(allowed)})"
    return f"config key {path or '(top level)'}: {err.message}"


def check_workflow_config(cfg: dict) -> None:
    """Validate the merged workflow config (schema, then the run-config `defaults`); fill defaults."""
    schema = yaml.safe_load(CONFIG_SCHEMA.read_text())
    errors = sorted(
        Draft202012Validator(schema).iter_errors(cfg),
        key=lambda e: [str(p) for p in e.absolute_path],
    )
    if errors:
        raise WorkflowError(_explain(errors[0]))
    validate(cfg, str(CONFIG_SCHEMA))  # fills in the schema's defaults (resources)
    try:
        validate_config(deep_merge(DEFAULTS, cfg["defaults"]))
    except ConfigError as err:
        raise WorkflowError(
            str(err).replace("config key ", "config key defaults.", 1)
        ) from None


def resolve_runs(cfg: dict) -> dict:
    """{(paper, name, seed): run config with output_dir results/<scale>/<paper>/<name>/seed<seed>}."""
    runs = {}
    for paper in cfg["papers"]:
        try:
            grid = resolve_grid(paper, cfg["defaults"], scale=cfg["scale"])
        except ConfigError as err:
            raise WorkflowError(f"config key papers: {err}") from None
        notebook = Path("workflow/notebooks") / f"{paper}.py"
        if not notebook.exists():
            raise WorkflowError(
                f"config key papers: {paper!r} has no report notebook {notebook}"
            )
        for (name, seed), run in grid.items():
            runs[(paper, name, seed)] = {**run, "output_dir": str(config_run_dir(run))}
    return runs


def resolve_borrowed(cfg: dict) -> dict:
    """{(paper, name, seed): lender} of the runs a paper reads from another paper's grid (checked
    against the lender's by resolve_runs); a lender must be among the configured papers.
    """
    borrowed = {}
    for paper in cfg["papers"]:
        for (name, seed), lender in borrowed_runs(paper, scale=cfg["scale"]).items():
            if lender not in cfg["papers"]:
                raise WorkflowError(
                    f"config key papers: {paper!r} borrows run {name!r} from {lender!r}, "
                    "which is not among the papers: add it"
                )
            borrowed[(paper, name, seed)] = lender
    return borrowed


check_workflow_config(config)
RUNS = resolve_runs(config)
BORROWED = resolve_borrowed(config)
DVC_STAGES = yaml.safe_load(Path("dvc.yaml").read_text())["stages"]
DVC_PARAMS = yaml.safe_load(Path("params.yaml").read_text()) or {}


def run_dir(paper: str, name: str, seed) -> str:
    """A run's folder at this scale (commlab.config.run_dir); with "{paper}", "{name}", "{seed}"
    it is the rules' path pattern (RUN_DIR)."""
    return str(
        config_run_dir(
            {"scale": config["scale"], "paper": paper, "name": name, "seed": seed}
        )
    )


# results/<scale>/{paper}/{name}/seed{seed}
RUN_DIR = run_dir("{paper}", "{name}", "{seed}")
# in the runs' and their logs' paths: scales never overwrite each other
SCALE = config["scale"]
RESULTS = str(Path(RUN_DIR).parents[2])  # results/<scale>: the report's sentinels


def priority_of(paper: str) -> int:
    """Papers train in the order the config lists them (the baseline first) and each report is
    built as soon as its paper's runs are done (priority above any training job), so reports
    appear one by one during a long run instead of all at its end."""
    papers = list(config["papers"])
    return len(papers) - papers.index(paper) if paper in papers else 0


def paper_priority(wildcards) -> int:
    return priority_of(wildcards.paper)


def paper_sentinels(paper: str) -> list:
    """The sentinels of the runs a paper's report reads: its own, and those it borrows."""
    own = [f"{run_dir(p, n, s)}/sentinel.json" for (p, n, s) in RUNS if p == paper]
    return own + [
        f"{run_dir(lender, n, s)}/sentinel.json"
        for (p, n, s), lender in BORROWED.items()
        if p == paper
    ]


def dvc_managed(run: dict) -> bool:
    """Whether a run reads a dataset that DVC prepares (not generated, default data_dir)."""
    return not DATASETS.get(run["dataset"]).generated and Path(run["data_dir"]) == Path(
        DATA_DIR
    )


def needed_datasets() -> list:
    names = sorted({run["dataset"] for run in RUNS.values() if dvc_managed(run)})
    missing = [n for n in names if n not in DVC_STAGES]
    if missing:
        raise WorkflowError(
            f"dataset(s) {missing} have no stage in dvc.yaml (stages: {', '.join(DVC_STAGES)})"
        )
    return names


def data_markers() -> list:
    return [f"{DATA_DIR}/{name}/meta.json" for name in needed_datasets()]


def dvc_stage(wildcards) -> dict:
    """A dataset's DVC stage and the params it reads: when these change, the data rule runs again."""
    stage = DVC_STAGES[wildcards.dataset]
    params = {}
    for dotted in stage.get("params", []):
        node = DVC_PARAMS
        for part in str(dotted).split("."):
            node = node.get(part) if isinstance(node, dict) else None
        params[dotted] = node
    return {"stage": stage, "params": params}


def run_config(wildcards) -> dict:
    key = (wildcards.paper, wildcards.name, int(wildcards.seed))
    if key not in RUNS:
        raise WorkflowError(
            f"no run {wildcards.name!r} seed {wildcards.seed} in the {wildcards.paper!r} grid "
            f"at scale {config['scale']!r}"
        )
    return RUNS[key]


def run_config_json(wildcards) -> str:
    """The run config as one JSON string: a rule parameter, so a changed config reruns the run."""
    return json.dumps(run_config(wildcards))


def train_data(wildcards) -> list:
    run = run_config(wildcards)
    return [f"{DATA_DIR}/{run['dataset']}/meta.json"] if dvc_managed(run) else []


def checkpoints_dir(wildcards) -> str:
    return f"{run_dir(wildcards.paper, wildcards.name, wildcards.seed)}/checkpoints"


def complete_marker(wildcards) -> str:
    """Written when a run finishes: if its job runs again the run starts afresh (stale
    checkpoints go), while a run killed before the end resumes from its checkpoints."""
    return f"{run_dir(wildcards.paper, wildcards.name, wildcards.seed)}/.complete"


def local_cores(default: int) -> int:
    """--cores of a local run; `default` where there is none (dry-run, cluster executors), whose
    jobs get their cores from their resources instead."""
    try:
        return int(workflow.cores)
    except (WorkflowError, TypeError, ValueError):
        return default


def train_threads(wildcards) -> int:
    """Local cores of one run: its workers x threads, capped at --cores so jobs never oversubscribe."""
    run = run_config(wildcards)
    want = run["workers"] * run.get("threads", 1)
    return min(want, local_cores(default=want))


def train_gres(wildcards) -> str:
    """GPUs of one run on each node (one per worker) when it runs on NCCL, else none: per-node
    `--gres=gpu:<workers>`, as a job-wide `--gpus` may be split unevenly across nodes.
    """
    run = run_config(wildcards)
    return f"gpu:{run['workers']}" if run["backend"] == "nccl" else ""


def train_tasks(wildcards) -> int:
    """SLURM tasks of a CPU run: one per node (`--ntasks=1` would shrink the allocation to one
    node). GPU jobs get one task per node from sbatch itself (the plugin reads `tasks` as
    `--ntasks-per-gpu` there), hence 0."""
    run = run_config(wildcards)
    return 0 if run["backend"] == "nccl" else run.get("nodes", 1)


def train_cpus(wildcards) -> int:
    run = run_config(wildcards)
    return run["workers"] * max(
        run.get("threads", 1), config["resources"]["cpus_per_worker"]
    )


def train_mem_mb(wildcards) -> int:
    return run_config(wildcards)["workers"] * config["resources"]["mem_mb_per_worker"]


# ---- the benchmarks behind the papers' speed claims (workflow/rules/bench.smk) ----
BENCH_SUITE = config["bench"]["suite"]  # `snakemake bench`: reports/bench/<name>.json
# RedSync's claim that the gain grows with the communication-to-computation ratio: the throughput
# benchmark once more per model, a compute-heavy and a communication-heavy one.
BENCH_MODELS = config["bench"]["models"]
BENCH_ARGS = config["bench"].get("args", {})


def declared_bench(paper: str) -> list:
    """The benchmark results a paper's claims read: the `BENCH` of commlab.report.claims_<paper>
    (its ev.bench() calls), none when it declares none. A grid with no claims module trains (its
    report rule says what is missing), so a new grid can run before its claims are written.
    """
    try:
        return list(getattr(declarations(paper), "BENCH", []))
    except ValueError:
        return []


# The benchmarks each paper's report reads for its speed and volume claims.
SPEED_BENCH = {paper: declared_bench(paper) for paper in config["papers"]}
# Benchmarks built from others' results, each by its own job in bench.smk: the cost model from
# the throughput benchmark's profiles (bench_scaling) and the wire table from its emulated runs
# (bench_wire); and the throughput per model (bench_throughput_model).
DERIVED_BENCH = {"scaling", "wire"}
# What bench_measure builds: the suite's benchmarks and those the claims read, but the derived ones.
MEASURED_BENCH = sorted(
    n
    for n in {*BENCH_SUITE, *sum(SPEED_BENCH.values(), [])}
    if n not in DERIVED_BENCH and not n.startswith("throughput_")
)


def _measure_speed() -> bool:
    """Whether this run measures the speed claims' benchmarks (config bench.speed_claims)."""
    setting = config["bench"]["speed_claims"]
    if setting is False or not any(SPEED_BENCH.get(p) for p in config["papers"]):
        return False
    from commlab.bench.common import emulation_unavailable

    reason = emulation_unavailable()
    if reason and setting is True:
        raise WorkflowError(
            f"bench.speed_claims is true but emulated links are unavailable: {reason}"
        )
    if reason:
        print(
            f"note: speed claims not measured in this run ({reason})", file=sys.stderr
        )
    return reason is None


MEASURE_SPEED = _measure_speed()


def speed_bench(paper: str) -> list:
    """The benchmark results a paper's report waits for in this run (none when speed is not measured)."""
    if not MEASURE_SPEED:
        return []
    return [f"reports/bench/{name}.json" for name in SPEED_BENCH.get(paper, [])]


def bench_priority(name: str) -> int:
    """A speed benchmark runs just before the training of the first paper whose report reads it,
    so that report is not held back until the end of the run."""
    papers = [p for p in config["papers"] if name in SPEED_BENCH.get(p, [])]
    return priority_of(papers[0]) if papers else 0


#: The warm launcher's socket, relative to the working directory the jobs run in (a Unix socket's
#: path is short); the train rule's command names it for `commlab launch`.
LAUNCH_SOCKET = ".snakemake/commlab-launch/socket"


class LaunchServer:
    """The warm launcher of a local run (`commlab serve`, src/commlab/launch/server.py): started
    before the first job, stopped after the last. The train rule's command points its
    `commlab launch` at LAUNCH_SOCKET; where no server listens there (launch_server: false, a
    cluster executor), the launch runs in the job itself."""

    def __init__(self):
        self.process = None

    def wanted(self) -> bool:
        return (
            config.get("launch_server", True)
            and workflow.local_exec
            and os.name == "posix"
            and shutil.which("python") is not None
        )

    def start(self) -> None:
        if self.process is not None:
            return
        # A server killed with its workflow leaves its socket: gone, whether one starts or not.
        Path(LAUNCH_SOCKET).unlink(missing_ok=True)
        if not self.wanted():
            return
        import subprocess

        folder = Path(LAUNCH_SOCKET).parent
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)  # only this user's processes may hand it jobs
        Path("logs").mkdir(exist_ok=True)
        with open("logs/launch_server.log", "w") as log:
            # Its own session: a Ctrl-C in the terminal reaches the jobs' clients, which forward it.
            self.process = subprocess.Popen(
                [
                    shutil.which("python"),
                    "-m",
                    "commlab",
                    "serve",
                    "--socket",
                    LAUNCH_SOCKET,
                    "--parent",
                    str(os.getpid()),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.process is None:
            return
        import signal
        import subprocess

        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.process = None


LAUNCH_SERVER = LaunchServer()
