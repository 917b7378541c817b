"""Borrowed runs (commlab.grid): a grid reads another grid's run of the same name instead of
training it, only where the two configs agree; the report reads the lender's runs beside its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from commlab.config import ConfigError
from commlab.grid import borrowed_runs, resolve_grid

LENDER = {"title": "lender", "seeds": [0, 1], "base": {"workers": 2, "train": {"epochs": 2, "train_subset": 512}},
          "runs": {"ssgd": {"method": "ssgd"}, "ddp": {"method": "ddp"}}}


def grids(folder: Path, **papers) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, grid in papers.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(grid))
    return folder


def borrower(**base) -> dict:
    train = {"epochs": 2, "train_subset": 512, **base.pop("train", {})}
    return {"title": "borrower", "seeds": [0, 1], "base": {"workers": 2, "train": train, **base},
            "runs": {"ssgd": {"borrow": "lender"}, "topk": {"method": "topk_allgather"}}}


def test_a_borrowed_run_is_left_to_its_lender(tmp_path):
    papers = grids(tmp_path / "papers", lender=LENDER, borrower=borrower())
    trained = resolve_grid("borrower", papers_dir=papers)
    assert sorted(trained) == [("topk", 0), ("topk", 1)]
    assert borrowed_runs("borrower", papers_dir=papers) == {("ssgd", 0): "lender", ("ssgd", 1): "lender"}
    assert ("ssgd", 0) in resolve_grid("lender", papers_dir=papers)  # the lender trains it
    assert borrowed_runs("lender", papers_dir=papers) == {}


def test_a_borrowed_run_must_have_the_lenders_config(tmp_path):
    papers = grids(tmp_path / "papers", lender=LENDER, borrower=borrower(train={"epochs": 3}))
    with pytest.raises(ConfigError, match=r"run 'ssgd': borrows lender's run but the configs differ "
                                          r"\(train\.epochs: here 3, lender 2\)"):
        resolve_grid("borrower", papers_dir=papers)


def test_a_borrowed_run_must_exist_and_not_be_borrowed_itself(tmp_path):
    papers = grids(tmp_path / "papers", lender=LENDER,
                   missing={**borrower(), "runs": {"adam": {"borrow": "lender"}}},
                   own={**borrower(), "runs": {"ssgd": {"borrow": "own"}}},
                   chain={**borrower(), "runs": {"ssgd": {"borrow": "borrower"}}}, borrower=borrower())
    with pytest.raises(ConfigError, match="borrows lender's run 'adam' seed 0, which that grid does not have"):
        resolve_grid("missing", papers_dir=papers)
    with pytest.raises(ConfigError, match="borrows from its own grid"):
        resolve_grid("own", papers_dir=papers)
    with pytest.raises(ConfigError, match="itself borrowed"):
        resolve_grid("chain", papers_dir=papers)


def test_the_report_reads_the_lenders_runs_beside_its_own(tmp_path, monkeypatch):
    from commlab.report.collect import load_report_runs
    from commlab.tracking import RunTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    grids(tmp_path / "config" / "papers", lender=LENDER, borrower=borrower())
    monkeypatch.chdir(tmp_path)  # the report reads the grids from the project's config/papers
    ids = {}
    for paper, name, seed in (("lender", "ssgd", 0), ("lender", "ssgd", 1), ("lender", "ddp", 0),
                              ("borrower", "topk", 0), ("borrower", "topk", 1)):
        tags = {"paper": paper, "method": name, "name": name, "seed": str(seed), "workers": "2", "scale": "laptop"}
        tracker = RunTracker({"paper": paper, "name": name, "seed": seed, "tracking": {"uri": uri}}, tags)
        tracker.log_metrics({"test_accuracy": 80.0 + seed}, step=1)
        tracker.finish("FINISHED")
        ids[(paper, name, seed)] = tracker.run_id
    runs = load_report_runs("borrower", uri=uri, scale="laptop")
    got = sorted((r.name, r.seed, r.borrowed_from, r.run_id) for r in runs.itertuples())
    assert got == sorted([("topk", 0, "", ids[("borrower", "topk", 0)]), ("topk", 1, "", ids[("borrower", "topk", 1)]),
                          ("ssgd", 0, "lender", ids[("lender", "ssgd", 0)]),
                          ("ssgd", 1, "lender", ids[("lender", "ssgd", 1)])])  # not the lender's ddp
    lender = load_report_runs("lender", uri=uri, scale="laptop")
    assert set(lender.borrowed_from) == {""} and len(lender) == 3
