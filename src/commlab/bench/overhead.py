"""``commlab bench overhead``: where a training job's wall time goes, and a whole workflow run's.

docs/performance.md, "Around the steps". Two measurements, each printed as a table:

* **One job** (the default): a run of the default workflow's grid (``--paper``, ``--run``,
  ``--seed``; the default config's scale), launched as the workflow launches it (``python -m
  commlab launch --config ... --sentinel ...``) in a scratch folder with its own MLflow store,
  ``--repeats`` times in each of two ways, alternately: cold (its own interpreter and imports, as
  without a warm launcher) and served by a warm launcher (``commlab serve``, as the workflow runs
  its jobs). Each phase of the job's timeline (:mod:`commlab.timeline`: start-up, data, build,
  MLflow, steps, log points, evaluation, checkpoints, outputs, teardown) is shown in seconds and
  as a share of the job's wall time (medians over the repeats), side by side, with the ratio of
  served to cold wall time.
* **A workflow run** (``--workflow LOG``, or ``--workflow latest`` for the newest log in
  ``.snakemake/log``): the run's elapsed time split into each rule's jobs (count and summed
  seconds) and the time no job ran (Snakemake's own: parsing, the DAG, scheduling, its hooks),
  and the training jobs' phases summed over the ``timeline.json`` files under ``--results``.

    commlab bench overhead                                   # baseline ssgd seed 0, cold and served, 3 repeats
    commlab bench overhead --paper oktopk --run oktopk --repeats 1
    commlab bench overhead --workflow latest --results results/laptop
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

from commlab.bench.common import Workdir, add_output_arguments, bench_parser, md_table, write_report
from commlab.registry import BENCHMARKS
from commlab.timeline import FILE as TIMELINE_FILE
from commlab.timeline import PHASES

#: How the table groups the timeline's phases.
GROUPS = {"interpreter": "start-up", "launcher": "start-up", "workers_start": "start-up",
          "worker_setup": "start-up", "process_group": "start-up", "data": "data", "build": "build",
          "mlflow": "MLflow", "steps": "steps", "log_points": "log points", "evaluation": "evaluation",
          "checkpoints": "checkpoints", "outputs": "outputs", "other": "other", "worker_exit": "teardown",
          "teardown": "teardown"}
MODES = ("cold", "served")


# ---------------------------------------------------------------------- one job
def job_config(paper: str, run: str, seed: int, config_file: str = "config/config.yaml") -> dict:
    """The run config the workflow would write for (paper, run, seed) at the config's scale."""
    from commlab.config import ConfigError
    from commlab.grid import resolve_grid

    workflow = yaml.safe_load(Path(config_file).read_text()) if Path(config_file).exists() else {}
    scale = workflow.get("scale", "laptop")
    try:
        grid = resolve_grid(paper, workflow.get("defaults", {}), scale=scale)
    except ConfigError as err:
        raise SystemExit(f"commlab bench overhead: {err}") from None
    if (run, seed) not in grid:
        names = sorted({n for n, _ in grid})
        raise SystemExit(f"commlab bench overhead: no run {run!r} seed {seed} in the {paper!r} grid at scale "
                         f"{scale!r} (runs: {', '.join(names)})")
    return grid[(run, seed)]


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    """A warm launcher for the served launches, once it says it is ready."""
    sockets = Path(tempfile.mkdtemp(prefix="commlab-launch-"))
    path = str(sockets / "socket")
    log = folder / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "commlab", "serve", "--socket", path,
                                    "--parent", str(os.getpid())], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + 300
    while "ready at" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the warm launcher did not start: {log.read_text()[-800:]}")
        time.sleep(0.1)
    return process, path


def launch_once(config: dict, workdir: Workdir, server: str | None) -> dict:
    """One launch of ``config`` in a new folder; its timeline, the wall time seen from outside and
    its final metrics."""
    workdir.count += 1
    folder = workdir.path / f"run{workdir.count:03d}"
    folder.mkdir()
    config = {**config, "output_dir": str(folder / "out"),
              "tracking": {"enabled": True, "uri": workdir.uri, "experiment": "bench"}}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "COMMLAB_LAUNCH_SERVER"}
    if server:
        env["COMMLAB_LAUNCH_SERVER"] = server
    cmd = [sys.executable, "-m", "commlab", "launch", "--config", str(path),
           "--sentinel", str(folder / "sentinel.json")]
    log = folder / "launch.log"
    t0 = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.call(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    record = folder / "out" / TIMELINE_FILE
    if rc != 0 or not record.exists():
        raise RuntimeError(f"the job failed (exit {rc}): {log.read_text()[-1500:]}")
    timeline = json.loads(record.read_text())
    final = json.loads((folder / "sentinel.json").read_text())["final"]
    return {"wall": wall, "timeline": timeline, "served": timeline.get("served", False), "final": final}


def split_rows(timelines: dict[str, list[dict]]) -> list[dict]:
    """Per phase: the median seconds and share of the wall time of each mode's launches
    (``timelines``: mode -> launch results), and the groups' and the wall time's own rows."""
    rows = []
    for phase in PHASES:
        row = {"phase": phase, "group": GROUPS[phase]}
        for mode, results in timelines.items():
            row[f"{mode}_s"] = statistics.median(r["timeline"]["seconds"].get(phase, 0.0) for r in results)
            row[f"{mode}_share"] = statistics.median(r["timeline"]["seconds"].get(phase, 0.0) / r["wall"]
                                                     for r in results)
        rows.append(row)
    wall = {"phase": "wall (seen from outside)", "group": ""}
    unseen = {"phase": "process exec and exit (outside the timeline)", "group": "teardown"}
    for mode, results in timelines.items():
        wall[f"{mode}_s"] = statistics.median(r["wall"] for r in results)
        wall[f"{mode}_share"] = 1.0
        gaps = [max(0.0, r["wall"] - r["timeline"]["total"]) for r in results]
        unseen[f"{mode}_s"] = statistics.median(gaps)
        unseen[f"{mode}_share"] = statistics.median(g / r["wall"] for g, r in zip(gaps, results, strict=True))
    return [*rows, unseen, wall]


def group_rows(rows: list[dict], modes: list[str]) -> list[dict]:
    """The phase rows added up by group, in the order the groups first appear."""
    groups: dict[str, dict] = {}
    for row in rows:
        if not row["group"]:
            continue
        out = groups.setdefault(row["group"], {"group": row["group"]})
        for mode in modes:
            for key in (f"{mode}_s", f"{mode}_share"):
                out[key] = out.get(key, 0.0) + row[key]
    return list(groups.values())


def measure_job(args) -> dict:
    config = job_config(args.paper, args.run, args.seed)
    modes = [m for m in MODES if m in args.modes]
    workdir = Workdir(keep=args.keep)
    server, path = None, None
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        if "served" in modes:
            server, path = start_server(workdir.path)
        for repeat in range(args.repeats):
            order = modes if repeat % 2 == 0 else modes[::-1]  # neither mode always runs first
            for mode in order:
                result = launch_once(config, workdir, path if mode == "served" else None)
                if result["served"] != (mode == "served"):
                    raise RuntimeError(f"a {mode} launch ran {'served' if result['served'] else 'cold'}")
                results[mode].append(result)
                print(f"[overhead] {mode} {repeat + 1}/{args.repeats}: {result['wall']:.2f} s, steps "
                      f"{result['timeline']['seconds']['steps'] / result['wall']:.1%}", flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=90)
        workdir.close()
    rows = split_rows(results)
    same = all(r["final"].get("train_loss") == results[modes[0]][0]["final"].get("train_loss")
               for rs in results.values() for r in rs)
    out = {"job": {"paper": args.paper, "run": args.run, "seed": args.seed, "method": config["method"],
                   "workers": config["workers"], "repeats": args.repeats}, "modes": modes, "phases": rows,
           "groups": group_rows(rows, modes), "same_final_loss": same,
           "launches": {m: [{"wall": r["wall"], **r["timeline"]} for r in rs] for m, rs in results.items()}}
    if len(modes) == 2:
        cold, served = (statistics.median(r["wall"] for r in results[m]) for m in modes)
        out["served_over_cold"] = served / cold
    return out


def _percent(rows: list[dict]) -> list[dict]:
    """The rows with every share written as a percentage."""
    return [{k: f"{v:.1%}" if k.endswith("share") and isinstance(v, float) else v for k, v in r.items()}
            for r in rows]


def job_markdown(out: dict) -> str:
    job, modes = out["job"], out["modes"]
    cols = [("phase", "phase"), ("group", "group")]
    gcols = [("group", "group")]
    for mode in modes:
        cols += [(f"{mode}_s", f"{mode} s"), (f"{mode}_share", f"{mode} share")]
        gcols += [(f"{mode}_s", f"{mode} s"), (f"{mode}_share", f"{mode} share")]
    text = (f"One job: {job['paper']}/{job['run']} seed {job['seed']} ({job['method']}, {job['workers']} workers), "
            f"median of {job['repeats']} launches per mode, alternating.\n\n" + md_table(_percent(out["groups"]), gcols)
            + "\n\nBy phase:\n\n" + md_table(_percent(out["phases"]), cols) + "\n")
    if "served_over_cold" in out:
        text += f"\nWall time served / cold, measured side by side: {out['served_over_cold']:.3f}.\n"
    text += ("\nEvery launch ended with the same training loss.\n" if out["same_final_loss"] else
             "\nThe launches' final training losses differ: see the JSON.\n")
    return text


# ---------------------------------------------------------------------- a workflow run
_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_RULE = re.compile(r"^(?:local)?(?:rule|checkpoint) (\S+):$")
_JOBID = re.compile(r"^\s+jobid: (\d+)$")
_FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\S+)\)$")
_DATE = re.compile(r"^\s+Date: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)$")


def parse_snakemake_log(text: str) -> dict:
    """A Snakemake log's start, end and jobs: ``{"start", "end", "jobs": [{jobid, rule, start, end}]}``
    (Unix times, to the second: Snakemake stamps its lines so). A job that never finished has no end."""
    start = end = None
    stamp = None
    pending_rule = None
    jobs: dict[int, dict] = {}
    for line in text.splitlines():
        if m := _DATE.match(line):
            start = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        elif m := _STAMP.match(line):
            stamp = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y").timestamp()
            end = stamp
            start = stamp if start is None else start
        elif m := _RULE.match(line):
            pending_rule = m.group(1)
        elif (m := _JOBID.match(line)) and pending_rule is not None:
            jobs[int(m.group(1))] = {"jobid": int(m.group(1)), "rule": pending_rule, "start": stamp, "end": None}
            pending_rule = None
        elif m := _FINISHED.match(line):
            job = jobs.setdefault(int(m.group(1)), {"jobid": int(m.group(1)), "rule": m.group(2), "start": stamp})
            job["end"] = stamp
    return {"start": start, "end": end, "jobs": list(jobs.values())}


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``: the time at least one of them covers."""
    total, reach = 0.0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


def workflow_split(log: dict) -> dict:
    """The run's elapsed time, each rule's jobs (count, summed seconds) and the time no job ran."""
    finished = [j for j in log["jobs"] if j.get("start") is not None and j.get("end") is not None
                and j["rule"] != "all"]
    rules: dict[str, dict] = {}
    for job in finished:
        row = rules.setdefault(job["rule"], {"rule": job["rule"], "jobs": 0, "seconds": 0.0})
        row["jobs"] += 1
        row["seconds"] += job["end"] - job["start"]
    elapsed = (log["end"] - log["start"]) if log["start"] is not None and log["end"] is not None else None
    busy = busy_seconds([(j["start"], j["end"]) for j in finished])
    return {"elapsed": elapsed, "busy": busy, "idle": None if elapsed is None else max(0.0, elapsed - busy),
            "unfinished": len(log["jobs"]) - len(finished) - sum(j["rule"] == "all" for j in log["jobs"]),
            "rules": sorted(rules.values(), key=lambda r: -r["seconds"])}


def training_phases(results: Path) -> dict:
    """The phases of every ``timeline.json`` under ``results`` added up, and how many there were."""
    totals = dict.fromkeys(PHASES, 0.0)
    total, count, served = 0.0, 0, 0
    for path in sorted(results.rglob(TIMELINE_FILE)):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        count += 1
        served += bool(record.get("served"))
        total += record["total"]
        for phase, seconds in record["seconds"].items():
            totals[phase] = totals.get(phase, 0.0) + seconds
    return {"jobs": count, "served": served, "total": total, "seconds": totals}


def latest_log(folder: str = ".snakemake/log") -> Path:
    logs = sorted(Path(folder).glob("*.snakemake.log"))
    if not logs:
        raise SystemExit(f"commlab bench overhead: no Snakemake log in {folder}/ (run the workflow first, or give "
                         "--workflow LOG)")
    return logs[-1]


def measure_workflow(args) -> dict:
    path = latest_log() if args.workflow == "latest" else Path(args.workflow)
    if not path.exists():
        raise SystemExit(f"commlab bench overhead: no Snakemake log at {path}")
    split = workflow_split(parse_snakemake_log(path.read_text()))
    return {"log": str(path), **split, "training": training_phases(Path(args.results)), "results": args.results}


def workflow_markdown(out: dict) -> str:
    elapsed = out["elapsed"] or 0.0
    rows = [{**r, "share": r["seconds"] / elapsed if elapsed else None} for r in out["rules"]]
    rows.append({"rule": "no job running (Snakemake's own)", "jobs": None, "seconds": out["idle"],
                 "share": out["idle"] / elapsed if elapsed and out["idle"] is not None else None})
    text = (f"Workflow run {out['log']}: {elapsed:,.0f} s elapsed, jobs running {out['busy']:,.0f} s "
            f"(jobs may overlap, so the rules' sums can exceed it).\n\n"
            + md_table(_percent(rows), [("rule", "rule"), ("jobs", "jobs"), ("seconds", "seconds"),
                                        ("share", "share of elapsed")]))
    if out["unfinished"]:
        text += f"\n\n{out['unfinished']} job(s) started but did not finish in this log."
    training = out["training"]
    if training["jobs"]:
        phases = [{"phase": p, "group": GROUPS[p], "seconds": s, "share": s / training["total"]}
                  for p, s in training["seconds"].items()]
        text += (f"\n\nTraining jobs' phases, summed over the {training['jobs']} timeline.json files under "
                 f"{out['results']} ({training['served']} served by the warm launcher; {training['total']:,.0f} s "
                 "in all):\n\n" + md_table(_percent(phases), [("phase", "phase"), ("group", "group"),
                                                              ("seconds", "seconds"), ("share", "share")]))
    else:
        text += f"\n\nNo timeline.json under {out['results']}: the training jobs' phases are not measured."
    return text + "\n"


@BENCHMARKS.register("overhead")
def overhead(argv: list[str], json_path: str | None = None) -> int:
    """Where a training job's wall time goes (cold and served), or a whole workflow run's."""
    parser = bench_parser("overhead", __doc__)
    parser.add_argument("--paper", default="baseline", help="the grid of the job (default baseline)")
    parser.add_argument("--run", default="ssgd", help="the run name in that grid (default ssgd)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    parser.add_argument("--repeats", type=int, default=3, help="launches per mode (default 3)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="cold (own interpreter), served (warm launcher), or both (default)")
    parser.add_argument("--workflow", metavar="LOG",
                        help="split a finished Snakemake run instead (its log, or `latest`)")
    parser.add_argument("--results", default="results/laptop",
                        help="with --workflow: the runs' folder, for their timeline.json (default results/laptop)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder of the launches")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.workflow:
        out = measure_workflow(args)
        write_report("overhead_workflow", out, workflow_markdown(out), json_path, args.out_dir)
    else:
        out = measure_job(args)
        write_report("overhead", out, job_markdown(out), json_path, args.out_dir)
    return 0
