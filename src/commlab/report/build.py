"""Build the reports (README, "Set-up"): a paper's notebook executed against MLflow -> HTML, and
the index.

    commlab report --paper baseline [--paper kstep]    reports/<paper>/report.html, report.ipynb, claims.json
    commlab report --index                             reports/index.html
    commlab report --paper baseline --index --out /tmp/reports --notebooks workflow/notebooks
    commlab report --paper kstep --scale smoke         only the runs tagged with that scale

A paper's report is ``workflow/notebooks/<paper>.py`` (jupytext percent format) executed by
papermill with the parameters ``paper``, ``out_dir``, ``tracking_uri`` and ``scale``, then
exported to HTML by nbconvert without the code (the executed ``report.ipynb`` beside it has it).
The notebook's prologue (:mod:`commlab.report.notebook`) writes ``<out>/<paper>/claims.json`` and
``runs.csv``; the index links every ``<out>/*/report.html``, gathers every claims table into one,
and draws every run of every paper on two cross-paper charts (:mod:`commlab.report.index`).

Whatever a notebook writes to stderr (a library's warning) goes to the build's log, not into the
HTML: the report shows results.

The kernel is this very interpreter: a kernelspec pointing at ``sys.executable`` is written to a
temporary folder on ``JUPYTER_PATH`` (which comes before user and system kernelspecs), so a fresh
machine or CI needs no ``ipykernel install`` and a user's own ``python3`` kernel is never used.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from commlab.report.index import build_index  # noqa: F401 - `commlab report --index`, and its old home

KERNEL_NAME = "commlab-python"


class ReportError(RuntimeError):
    """A report could not be built; the message says which paper and why."""


@contextlib.contextmanager
def this_interpreter_kernel():
    """Make the kernel ``KERNEL_NAME`` run ``sys.executable`` for the duration of the block."""
    with tempfile.TemporaryDirectory(prefix="commlab-kernel-") as tmp:
        spec_dir = Path(tmp) / "kernels" / KERNEL_NAME
        spec_dir.mkdir(parents=True)
        spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": f"Python ({sys.executable})", "language": "python"}
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        previous = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [tmp, previous]))
        try:
            yield KERNEL_NAME
        finally:
            if previous is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = previous


def sentinel_runs(results: Path, paper: str) -> dict[tuple[str, int], str | None]:
    """(name, seed) -> MLflow run id, from the sentinels the training jobs wrote."""
    runs = {}
    for path in sorted((results / paper).glob("*/seed*/sentinel.json")):
        record = json.loads(path.read_text())
        runs[(record.get("name"), int(record.get("seed", -1)))] = record.get("run_id")
    return runs


def check_sentinels(paper: str, results: Path, uri: str, scale: str | None = None) -> list[str]:
    """Warnings where the report's runs (newest finished per name and seed) are not the ones the
    training jobs recorded, e.g. after a manual rerun into the same store."""
    from commlab.report.collect import borrowed, load_report_runs

    recorded = sentinel_runs(results, paper)
    for (name, seed), lender in borrowed(paper, scale).items():
        run_id = sentinel_runs(results, lender).get((name, seed))
        if run_id is not None:
            recorded[(name, seed)] = run_id
    if not recorded:
        return []
    runs = load_report_runs(paper, uri=uri, scale=scale)
    newest = {(r.name, int(r.seed)): r.run_id for r in runs.itertuples()}
    warnings = []
    for key, run_id in sorted(recorded.items()):
        if key not in newest:
            warnings.append(f"{paper}: run {key[0]} seed {key[1]} ({run_id}) is not a FINISHED run in {uri}")
        elif run_id and newest[key] != run_id:
            warnings.append(f"{paper}: run {key[0]} seed {key[1]}: the report uses the newer run "
                            f"{newest[key]}, not {run_id} from {results}")
    return warnings


def move_stderr(notebook, log=sys.stderr) -> int:
    """Take the stderr streams out of the executed notebook's outputs and write them to ``log``;
    return how many there were."""
    moved = 0
    for index, cell in enumerate(notebook.cells):
        kept = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                print(f"[cell {index}] {output.get('text', '').rstrip()}", file=log)
                moved += 1
            else:
                kept.append(output)
        if "outputs" in cell:
            cell["outputs"] = kept
    return moved


def export_html(notebook, target: Path, title: str) -> None:
    """The executed notebook as HTML without code, prompts or stderr."""
    from nbconvert import HTMLExporter

    move_stderr(notebook)
    # Without their code, cells that print nothing would only leave blank space.
    notebook.cells = [c for c in notebook.cells if c.cell_type != "code" or c.get("outputs")]
    exporter = HTMLExporter(template_name="lab")
    exporter.exclude_input = True
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    body, _ = exporter.from_notebook_node(notebook, resources={"metadata": {"name": title}})
    target.write_text(body, encoding="utf-8")


def build_paper(paper: str, out: Path, notebooks: Path, uri: str, cwd: Path | None = None,
                scale: str | None = None) -> Path:
    """Execute ``notebooks/<paper>.py`` into ``out/<paper>/`` and export HTML; return the HTML path."""
    import jupytext
    import nbformat
    import papermill
    from papermill.exceptions import PapermillExecutionError

    source = notebooks / f"{paper}.py"
    if not source.exists():
        known = ", ".join(sorted(p.stem for p in notebooks.glob("*.py"))) or "none"
        raise ReportError(f"no report notebook {source} for paper {paper!r} (notebooks: {known})")
    folder = out / paper
    folder.mkdir(parents=True, exist_ok=True)
    claims = folder / "claims.json"
    claims.unlink(missing_ok=True)  # a stale table must never pass for this run's
    executed = folder / "report.ipynb"
    notebook = jupytext.read(source)
    params = {"paper": paper, "out_dir": str(out.resolve()), "tracking_uri": uri, "scale": scale}
    failure = None
    with this_interpreter_kernel() as kernel:
        try:
            papermill.execute_notebook(notebook, str(executed), parameters=params, kernel_name=kernel,
                                       language="python", cwd=str(cwd or Path.cwd()), progress_bar=False,
                                       request_save_on_cell_execute=False, start_timeout=300)
        except PapermillExecutionError as err:
            print(re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err.traceback)), file=sys.stderr)
            failure = f"{source} failed in cell {err.exec_count}: {err.ename}: {err.evalue}"
    html_path = folder / "report.html"
    export_html(nbformat.read(executed, as_version=4), html_path, f"commlab report: {paper}")
    if failure:
        raise ReportError(f"{failure} (executed notebook: {executed}, HTML: {html_path})")
    if not claims.exists():
        raise ReportError(f"{source} ran but wrote no {claims}: the notebook must call write_claims()")
    return html_path


def latest_snakemake_log(folder: str = ".snakemake/log") -> Path | None:
    """The newest Snakemake log here: the running workflow's, when the index is its job."""
    logs = sorted(Path(folder).glob("*.snakemake.log"))
    return logs[-1] if logs else None


def main(args) -> int:
    """Entry point of ``commlab report`` (args: paper list, index, out, notebooks, results)."""
    from commlab.tracking import tracking_uri

    if not args.paper and not args.index:
        print("commlab report: nothing to do; give --paper NAME (repeatable) and/or --index", file=sys.stderr)
        return 2
    out, notebooks, results = Path(args.out), Path(args.notebooks), Path(args.results)
    uri = tracking_uri()
    status = 0
    scale = getattr(args, "scale", None)
    for paper in args.paper:
        for warning in check_sentinels(paper, results, uri, scale):
            print(f"commlab report: warning: {warning}", file=sys.stderr)
        try:
            path = build_paper(paper, out, notebooks, uri, scale=scale)
            print(f"{paper}: {path}")
        except ReportError as err:
            print(f"commlab report: {err}", file=sys.stderr)
            status = 1
    if args.index:
        log = getattr(args, "snakemake_log", None)
        print(f"index: {build_index(out, results, latest_snakemake_log() if log == 'latest' else log and Path(log))}")
    return status
