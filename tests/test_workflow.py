"""The workflow layer: config validation, the benchmark list, the run-config script, lint, the
report index, and one smoke run from data to report.

Every test works in a copy of the project's files (tracked and not ignored) with its own git
repository, so the checkout's results, MLflow store and DVC cache are never touched. The end-to-end
test runs `snakemake --cores 2 --configfile config/smoke.yaml` there: DVC prepares Fashion-MNIST,
torchrun trains ssgd and ddp (one seed, a 2,048-sample subset), the notebook builds the report
and the index; then it checks the MLflow runs and that a second run has nothing to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def copy_project(dest: Path) -> Path:
    """Copy the files git would see (tracked or not ignored) into ``dest`` and ``git init`` it."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a tracked file may be deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    return dest


def project_env(project: Path) -> dict:
    """The copy's own code and its own MLflow store, this interpreter's environment first on PATH
    (as `make` or an activated .venv have it: the jobs call `python` and `dvc`); no telemetry."""
    env = dict(os.environ)
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{project}/mlflow.db", PYTHONPATH=str(project / "src"),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true", DVC_NO_ANALYTICS="true")
    return env


def snakemake(project: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *args], cwd=project, env=project_env(project), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return copy_project(tmp_path_factory.mktemp("workflow") / "project")


def _set(config: dict, dotted: str, value) -> dict:
    node = config
    for part in dotted.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[dotted.split(".")[-1]] = value
    return config


@pytest.mark.parametrize("key, value, named", [
    ("scael", "smoke", "scael"),  # unknown top-level key
    ("scale", "huge", "config key scale"),  # bad value
    ("defaults.train.lrr", 0.1, "lrr"),  # unknown run-config key under defaults
    ("defaults.method", "nosuch", "config key defaults.method"),  # unknown method name
    ("papers", ["nosuch"], "nosuch"),  # a paper without a grid
    ("bench.suite", ["collectives", "nosuch"], "config key bench.suite.1"),  # not a benchmark
])
def test_bad_config_stops_before_any_job(project, tmp_path, key, value, named):
    config = _set(yaml.safe_load((project / "config/config.yaml").read_text()), key, value)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    result = snakemake(project, "-n", "--configfile", str(bad))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert named in output, output
    assert "Job stats" not in output and not (project / "results").exists()


def test_default_config_plans_every_grid_run_and_report(project):
    from commlab.grid import resolve_grid

    config = yaml.safe_load((project / "config/config.yaml").read_text())
    runs = sum(len(resolve_grid(p, config["defaults"], papers_dir=project / "config/papers")) for p in config["papers"])
    result = snakemake(project, "-n", "--cores", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    counts = {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)$", result.stdout, flags=re.M)}
    assert counts["train"] == counts["run_config"] == runs >= 4  # baseline alone: ssgd, ddp x 2 seeds
    assert counts["paper_report"] == len(config["papers"]) and counts["report_index"] == counts["mlflow_init"] == 1
    assert "threads: 2" in result.stdout and "threads: 4" not in result.stdout  # 4 workers capped at --cores 2


def test_benchmarks_come_from_the_config(project, tmp_path):
    """`snakemake bench` plans the config's suite and the throughput per model of `bench: models`, and
    the schema's benchmark names are the registered ones."""
    from commlab.registry import BENCHMARKS

    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    assert sorted(schema["properties"]["bench"]["properties"]["suite"]["items"]["enum"]) == sorted(BENCHMARKS.names())
    config = yaml.safe_load((project / "config/config.yaml").read_text())
    config["bench"].update(suite=["collectives", "selection"], models=["wide_mlp"])
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(config))
    planned = _planned(project, "bench", "--configfile", str(tmp_path / "bench.yaml"))
    outputs = set(re.findall(r"output: (reports/bench/\S+)\.json", planned))
    assert outputs == {"reports/bench/collectives", "reports/bench/selection", "reports/bench/throughput_wide_mlp"}
    # the wire table reads the throughput benchmark's files and runs the methods they lack
    config["bench"].update(suite=["wire"], args={"wire": "--max-steps 3"})
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(config))
    planned = _planned(project, "-p", "bench", "--configfile", str(tmp_path / "bench.yaml"))
    outputs = set(re.findall(r"output: (reports/bench/\S+)\.json", planned))
    assert outputs == {"reports/bench/wire", "reports/bench/throughput", "reports/bench/throughput_wide_mlp"}
    assert ("wire --from reports/bench/throughput.json reports/bench/throughput_wide_mlp.json --run-missing "
            "--max-steps 3") in planned


def test_reports_wait_for_the_benchmarks_their_claims_declare(project):
    """A report depends on the benchmark results its claims module declares (``BENCH``), where this
    machine can measure them (emulated links), and on none where it cannot."""
    from commlab.bench.common import emulation_unavailable
    from commlab.report.claims import declarations

    planned = _planned(project, "report_oktopk", "report_redsync")
    for paper in ("oktopk", "redsync"):
        declared = declarations(paper).BENCH
        assert "wire" in declared
        block = re.search(rf"input: ([^\n]*workflow/notebooks/{paper}\.py[^\n]*)", planned)[1]
        waits = set(re.findall(r"reports/bench/(\w+)\.json", block))
        assert waits == (set() if emulation_unavailable() else set(declared)), (paper, waits)


def test_run_config_script_writes_the_grid_entry(project):
    """The run_config rule (workflow/scripts/run_config.py) writes the resolved grid entry as YAML and
    removes a previous run's checkpoints and completion marker, so that the run starts afresh."""
    from commlab.grid import resolve_grid

    config = yaml.safe_load((project / "config/config.yaml").read_text())
    grid = resolve_grid("baseline", config["defaults"], papers_dir=project / "config/papers")
    folder = project / "results/laptop/baseline/ssgd/seed1"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / ".complete").touch()
    result = snakemake(project, "--cores", "1", f"{folder.relative_to(project)}/config.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    written = yaml.safe_load((folder / "config.yaml").read_text())
    assert written == {**grid[("ssgd", 1)], "output_dir": "results/laptop/baseline/ssgd/seed1"}
    assert not (folder / "checkpoints").exists() and not (folder / ".complete").exists()


def test_the_workflow_edits_no_environment_at_parse_time():
    """How Snakemake and its jobs find commlab is the environment's business (the Makefile, an
    activated .venv), not the workflow's."""
    for path in [ROOT / "Snakefile", *sorted((ROOT / "workflow/rules").glob("*.smk"))]:
        text = path.read_text()
        for edit in ("sys.path", "os.environ", "os.putenv"):
            assert edit not in text, f"{path.name} touches {edit}"


def test_lint_is_clean(project):
    result = snakemake(project, "--lint")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Lints for" not in result.stdout + result.stderr


def _pins(requirements) -> set[str]:
    return {r.strip() for r in requirements if isinstance(r, str) and "==" in r}


def test_conda_files_mirror_pyproject_pins():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins(project["dependencies"]) | _pins(project["optional-dependencies"]["dev"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert _pins(pip) == pins
    rule_env = yaml.safe_load((ROOT / "workflow/envs/commlab.yaml").read_text())
    rule_pip = next(d["pip"] for d in rule_env["dependencies"] if isinstance(d, dict))
    assert _pins(rule_pip) <= pins and {"torch==2.14.1", "snakemake==9.27.1"} <= _pins(rule_pip)


def test_index_links_reports_and_gathers_claims(tmp_path):
    from commlab.report.build import build_index
    from commlab.report.claims import Claim, write_claims

    write_claims("alpha", "Alpha <paper>", [Claim("a beats b", "Fig. 1", "1.0 ± 0", "reproduced"),
                                            Claim("c", "Tab. 2", "no runs", "not measured")], tmp_path)
    (tmp_path / "alpha" / "report.html").write_text("<html></html>")
    write_claims("beta", "Beta", [Claim("x < y", "Fig. 3", "2", "contradicted", note="smaller model")], tmp_path)
    page = build_index(tmp_path).read_text()
    assert page.count('href="alpha/report.html"') == 3  # papers table + two claims rows
    assert "beta/report.html" not in page  # no report to link, its claims are still gathered
    assert "Alpha &lt;paper&gt;" in page and "x &lt; y" in page and "smaller model" in page
    assert page.count("<tr>") == 1 + 2 + 1 + 3  # header + 2 papers, header + 3 claims


@pytest.mark.slow
def test_smoke_run_goes_from_data_to_report(tmp_path):
    project = copy_project(tmp_path / "project")
    result = snakemake(project, "--cores", "2", "--configfile", "config/smoke.yaml", timeout=900)
    logs = "".join(f"\n--- {p}\n{p.read_text()[-3000:]}" for p in sorted((project / "logs").rglob("*.log")))
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:] + logs

    # Data: DVC prepared it as dvc.lock records it (the committed file is unchanged), and pushed
    # nothing: pushing to the remote is the user's `dvc push`.
    meta = json.loads((project / "data/prepared/fashion_mnist/meta.json").read_text())
    assert meta["train_shape"] == [60000, 1, 28, 28] and meta["test_shape"] == [10000, 1, 28, 28]
    assert (project / "dvc.lock").read_bytes() == (ROOT / "dvc.lock").read_bytes()
    assert not (project / "dvc-storage").exists()
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "fashion_mnist"], cwd=project,
                            env=project_env(project), capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout + status.stderr

    # Training: one FINISHED MLflow run per (name, seed) with per-step and per-epoch metrics.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{project}/mlflow.db")
    experiment = client.get_experiment_by_name("baseline")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted((r.data.tags["name"], r.data.tags["seed"], r.info.status) for r in runs) == [
        ("ddp", "0", "FINISHED"), ("ddp_bf16", "0", "FINISHED"), ("ssgd", "0", "FINISHED")]
    for run in runs:
        folder = project / "results" / "smoke" / "baseline" / run.data.tags["name"] / "seed0"
        sentinel = json.loads((folder / "sentinel.json").read_text())
        assert sentinel["run_id"] == run.info.run_id
        losses = client.get_metric_history(run.info.run_id, "train_loss")
        assert len(losses) >= 3 and losses[-1].value < losses[0].value
        assert 10.0 < run.data.metrics["test_accuracy"] <= 100.0 and run.data.metrics["bytes_sent"] > 0
        # The workflow's warm launcher served the job: its timeline says so, and how its time went.
        timeline = json.loads((folder / "timeline.json").read_text())
        assert timeline["served"] and timeline["seconds"]["steps"] > 0
        assert abs(sum(timeline["seconds"].values()) - timeline["total"]) < 0.05
    assert "ready at" in (project / "logs/launch_server.log").read_text()
    assert not (project / ".snakemake/commlab-launch/socket").exists()  # it ended with the workflow

    # Reports: the paper's HTML, its claims (ssgd and ddp agree), and the index linking it.
    html = (project / "reports/baseline/report.html").read_text()
    assert "ssgd" in html and "ddp" in html and "image/png" in html
    claims = json.loads((project / "reports/baseline/claims.json").read_text())["claims"]
    assert [c["verdict"] for c in claims] == ["reproduced", "reproduced", "consistent", "not testable at this budget",
                                              "consistent"], claims
    assert 'href="baseline/report.html"' in (project / "reports/index.html").read_text()

    # A second run has nothing to do, and `snakemake --report` bundles the results.
    again = snakemake(project, "-n", "--cores", "2", "--configfile", "config/smoke.yaml")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout
    bundle = snakemake(project, "--cores", "1", "--configfile", "config/smoke.yaml", "--report",
                       "reports/snakemake_report.html")
    assert bundle.returncode == 0, bundle.stdout + bundle.stderr
    assert (project / "reports/snakemake_report.html").stat().st_size > 10_000


# ---- the data rule follows its DVC stage's dependencies --------------------------------------
RAW = Path(yaml.safe_load((ROOT / "params.yaml").read_text())["data"]["fashion_mnist"]["source"])
needs_raw = pytest.mark.skipif(not RAW.is_dir(), reason=f"no Fashion-MNIST files in {RAW} (make system-packages)")


def _planned(project: Path, *args: str) -> str:
    result = snakemake(project, "-n", "--cores", "1", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def _edit(path: Path) -> None:
    """A change of content (Snakemake reruns for a changed time only if the content changed too)."""
    path.write_text(path.read_text() + "# changed\n")


@needs_raw
def test_touching_data_code_schedules_the_data_rule(tmp_path):
    """Snakemake reruns prepare_data when a file of the DVC stage's deps changes (as `dvc status`
    would report), not for other code; a dry run with a prepared dataset in place."""
    project = copy_project(tmp_path / "project")
    meta = project / "data/prepared/fashion_mnist/meta.json"
    meta.parent.mkdir(parents=True)
    meta.write_text("{}")  # newer than every copied file: the dataset counts as prepared
    assert "Nothing to be done" in _planned(project, "data")
    _edit(project / "src/commlab/data/checks.py")  # loading code: no DVC dependency
    assert "Nothing to be done" in _planned(project, "data")
    _edit(project / "src/commlab/data/fashion_mnist.py")
    planned = _planned(project, "data")
    assert "rule prepare_data:" in planned
    assert "reason: Updated input files: src/commlab/data/fashion_mnist.py" in planned, planned


@pytest.mark.slow
@needs_raw
def test_data_rule_leaves_dvc_lock_and_remote_alone(tmp_path):
    """The data rule runs `dvc repro` and nothing else: with the code as committed, dvc.lock stays
    byte for byte and nothing is pushed. Data that DVC made or fetched outside Snakemake (no
    Snakemake record, older than the code) is checked once by a no-op `dvc repro`, then settled."""
    project = copy_project(tmp_path / "project")
    lock = (project / "dvc.lock").read_bytes()
    result = snakemake(project, "--cores", "1", "data")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (project / "dvc.lock").read_bytes() == lock
    assert not (project / "dvc-storage").exists()
    assert "Nothing to be done" in _planned(project, "data")

    shutil.rmtree(project / ".snakemake" / "metadata")  # as after `dvc repro` or `dvc pull` by hand
    (project / "src/commlab/data/base.py").touch()
    assert "rule prepare_data:" in _planned(project, "data")
    result = snakemake(project, "--cores", "1", "data")
    assert result.returncode == 0, result.stdout + result.stderr
    log = (project / "logs/data/fashion_mnist.log").read_text()
    assert "skipping" in log and "Running stage" not in log, log  # unchanged, or restored from DVC's cache
    assert (project / "dvc.lock").read_bytes() == lock
    assert "Nothing to be done" in _planned(project, "data")
