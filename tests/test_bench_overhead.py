"""commlab bench overhead's arithmetic on hand-made inputs: a Snakemake log split into its rules'
jobs and the time no job ran, job timelines summed and shared out, and the index's section on how
the run spent its time."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from commlab.bench.overhead import (
    busy_seconds,
    group_rows,
    parse_snakemake_log,
    split_rows,
    training_phases,
    workflow_split,
)
from commlab.timeline import PHASES

LOG = """Assuming unrestricted shared filesystem usage.
SNAKEMAKE
=========
  Date: 2026-12-02 02:07:01
  Snakemake version: 9.27.1

Building DAG of jobs...
Select jobs to execute...
[Wed Dec  2 02:07:03 2026]
localrule prepare_data:
    output: data/prepared/fashion_mnist/meta.json
    jobid: 2
    resources: tmpdir=/tmp, dvc=1
Shell command: dvc repro fashion_mnist
[Wed Dec  2 02:07:03 2026]
localrule mlflow_init:
    output: results/.mlflow_init
    jobid: 3
[Wed Dec  2 02:07:08 2026]
Finished jobid: 3 (Rule: mlflow_init)
[Wed Dec  2 02:07:09 2026]
Finished jobid: 2 (Rule: prepare_data)
[Wed Dec  2 02:07:10 2026]
rule train:
    output: results/laptop/baseline/ssgd/seed0/sentinel.json
    jobid: 1
    wildcards: paper=baseline, name=ssgd, seed=0
[Wed Dec  2 02:07:27 2026]
Finished jobid: 1 (Rule: train)
[Wed Dec  2 02:07:30 2026]
rule train:
    jobid: 5
[Wed Dec  2 02:07:40 2026]
Finished jobid: 5 (Rule: train)
[Wed Dec  2 02:07:41 2026]
rule train:
    jobid: 6
[Wed Dec  2 02:07:45 2026]
localrule all:
    jobid: 0
[Wed Dec  2 02:07:45 2026]
Finished jobid: 0 (Rule: all)
"""


def t(clock: str) -> float:
    return datetime.strptime(f"2026-12-02 {clock}", "%Y-%m-%d %H:%M:%S").timestamp()


def test_a_snakemake_log_gives_each_jobs_rule_start_and_end():
    log = parse_snakemake_log(LOG)
    assert log["start"] == t("02:07:01") and log["end"] == t("02:07:45")
    jobs = {j["jobid"]: j for j in log["jobs"]}
    assert jobs[2] == {"jobid": 2, "rule": "prepare_data", "start": t("02:07:03"), "end": t("02:07:09")}
    assert jobs[1]["rule"] == "train" and jobs[1]["end"] - jobs[1]["start"] == 17
    assert jobs[6]["end"] is None  # started, never finished in this log


def test_the_time_no_job_ran_is_the_elapsed_time_less_the_union_of_the_jobs():
    assert busy_seconds([(0, 5), (3, 8), (10, 12), (11, 11.5)]) == 10
    assert busy_seconds([]) == 0
    split = workflow_split(parse_snakemake_log(LOG))
    # jobs: 03-09 (two overlapping), 10-27, 30-40: 6 + 17 + 10 = 33 of 44 s
    assert split["elapsed"] == 44 and split["busy"] == 33 and split["idle"] == 11
    assert split["unfinished"] == 1
    rules = {r["rule"]: r for r in split["rules"]}
    assert rules["train"] == {"rule": "train", "jobs": 2, "seconds": 27.0}
    assert rules["mlflow_init"]["seconds"] == 5 and rules["prepare_data"]["seconds"] == 6
    assert "all" not in rules


def timeline(total: float, steps: float, evaluation: float, served: bool = True) -> dict:
    seconds = dict.fromkeys(PHASES, 0.0)
    seconds.update(steps=steps, evaluation=evaluation, interpreter=total - steps - evaluation)
    return {"total": total, "seconds": seconds, "counts": {}, "served": served}


def test_the_training_jobs_phases_add_up_over_their_timelines(tmp_path):
    for i, record in enumerate([timeline(10.0, 8.0, 1.0), timeline(20.0, 15.0, 2.0, served=False)]):
        folder = tmp_path / "paper" / f"run{i}" / "seed0"
        folder.mkdir(parents=True)
        (folder / "timeline.json").write_text(json.dumps(record))
    (tmp_path / "paper" / "broken.json").write_text("{")
    out = training_phases(tmp_path)
    assert out["jobs"] == 2 and out["served"] == 1 and out["total"] == 30.0
    assert out["seconds"]["steps"] == 23.0 and out["seconds"]["evaluation"] == 3.0
    assert out["seconds"]["interpreter"] == 4.0


def test_a_jobs_split_shares_each_phase_of_the_wall_time_seen_from_outside():
    cold = [{"wall": 20.0, "timeline": timeline(19.0, 10.0, 2.0)},
            {"wall": 22.0, "timeline": timeline(21.0, 11.0, 2.0)}]
    served = [{"wall": 14.0, "timeline": timeline(14.0, 10.5, 2.0)}]
    rows = {r["phase"]: r for r in split_rows({"cold": cold, "served": served})}
    assert rows["steps"]["cold_s"] == 10.5 and rows["steps"]["cold_share"] == pytest.approx((0.5 + 0.5) / 2)
    assert rows["steps"]["served_share"] == pytest.approx(0.75)
    assert rows["wall (seen from outside)"]["cold_s"] == 21.0
    assert rows["process exec and exit (outside the timeline)"]["cold_s"] == 1.0  # 20-19 and 22-21
    groups = {g["group"]: g for g in group_rows(list(rows.values()), ["cold", "served"])}
    assert groups["start-up"]["served_s"] == pytest.approx(1.5)  # the interpreter here
    assert groups["teardown"]["cold_s"] == pytest.approx(1.0)  # the process exec and exit
    assert set(groups) >= {"start-up", "steps", "evaluation", "MLflow", "teardown"}


def test_the_index_says_how_the_run_spent_its_time(tmp_path):
    from commlab.report.index import time_html

    log = tmp_path / "run.snakemake.log"
    log.write_text(LOG)
    folder = tmp_path / "results" / "p" / "r" / "seed0"
    folder.mkdir(parents=True)
    (folder / "timeline.json").write_text(json.dumps(timeline(10.0, 8.0, 1.0)))
    text = time_html(tmp_path / "results", log)
    assert "up to this page: 0.7 minutes" in text and "<td>train</td><td>2</td><td>0.5</td>" in text
    assert "1 training jobs (1 served by the warm launcher): 0.2 minutes, 80% of it in training steps" in text
    assert "interpreter 10.0%, evaluation 10.0%" in text
    bare = time_html(None, None)
    assert "not measured (no Snakemake log given)" in bare and "not measured (no <code>timeline.json</code>" in bare
