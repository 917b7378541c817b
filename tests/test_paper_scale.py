"""Paper scale (docs/paper-scale.md): every grid resolves at every scale it defines and
`commlab grid` lists its variants; the page's table maps all 18 experiments of the papers to
variants that exist; the configured values equal the released scripts' (tests/release_settings.yaml,
each with the file it was read from); the schedules the rows need follow the releases' formulas."""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import pytest
import yaml

from commlab.cli import main
from commlab.config import DEFAULTS, ConfigError
from commlab.grid import borrowed_runs, load_grid_file, resolve_grid
from commlab.loop.optim import lr_at
from commlab.options import parse_options
from commlab.registry import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ROOT / "config" / "papers"
GRIDS = sorted(p.stem for p in PAPERS.glob("*.yaml"))
SCALES = [(g, s) for g in GRIDS for s in ["laptop", *(load_grid_file(g, PAPERS).get("scales") or {})]]
RELEASES = yaml.safe_load((ROOT / "tests" / "release_settings.yaml").read_text())
ROWS = ["K1", "K2", "K3", "K4", "O1", "O2", "O3", "A1", "R1", "R2", "R3", "R4", "S1", "S2", "S3", "S4", "S5", "S6",
        "B"]


DEFAULTS_OF_RUNS = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["defaults"]  # as `commlab grid`


@functools.cache
def _resolved(grid: str, scale: str) -> dict:
    return resolve_grid(grid, DEFAULTS_OF_RUNS, scale=scale, papers_dir=PAPERS)


@pytest.mark.parametrize("grid,scale", SCALES, ids=[f"{g}-{s}" for g, s in SCALES])
def test_every_grid_resolves_and_lists_at_every_scale(grid, scale, capsys, monkeypatch):
    configs = _resolved(grid, scale)  # every method, model and dataset name registered, every value valid
    assert configs and all(c["scale"] == scale for c in configs.values())
    monkeypatch.chdir(ROOT)
    assert main(["grid", grid, "--scale", scale]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    listed = [row for row in rows if not row[2].startswith("borrowed from ")]
    lent = {(row[0], int(row[1].removeprefix("seed="))): row[2] for row in rows if row not in listed}
    assert lent == {key: f"borrowed from {lender} (`commlab grid {lender}` trains it)"
                    for key, lender in borrowed_runs(grid, scale=scale, papers_dir=PAPERS).items()}
    assert [(row[0], int(row[1].removeprefix("seed="))) for row in listed] == list(configs)
    for row, config in zip(listed, configs.values(), strict=True):
        assert row[2:] == [f"method={config['method']}", f"workers={config['workers']}", f"nodes={config['nodes']}",
                           f"model={config['model']}", f"dataset={config['dataset']}"]


def test_an_unknown_scale_is_named():
    with pytest.raises(ConfigError, match="no scale 'paper_huge'.*paper_imagenet"):
        _resolved("kstep", "paper_huge")


# ---- docs/paper-scale.md's table of the papers' experiments -----------------------------------
PAGE = ROOT / "docs" / "paper-scale.md"
SECTION = "## The papers' experiments"


def _expand(pattern: str) -> list[str]:
    """``a_{x,y}_b{1,2}`` -> a_x_b1, a_x_b2, a_y_b1, a_y_b2 (the table's shorthand)."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the page's table of experiments, by row name (K1, ..., B)."""
    section = text[text.index(SECTION) + len(SECTION):]
    section = section.split("\n## ", 1)[0]  # up to the next section, or the end of the page
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"[A-Z]\d?", cells[0]):
            rows[cells[0]] = cells
    return rows


def test_the_page_maps_every_experiment_to_variants_that_exist():
    rows = table_rows(PAGE.read_text())
    assert list(rows) == ROWS
    for row, (_, _, grid, scales, variants) in rows.items():
        if row == "O2":
            assert grid == "—" and scales == "not built" and "docs/tasks.md" in variants
            continue
        names = [n for pattern in re.findall(r"`([^`]+)`", variants) for n in _expand(pattern)]
        assert names, row
        runs = {name for scale in scales.split(", ") for name, _ in _resolved(grid, scale)}
        assert set(names) <= runs, (row, sorted(set(names) - runs))


def test_asgd_runs_beside_ssd_and_od_sgd_at_every_scale_that_compares_with_ssgd():
    compared = 0
    for scale in ["laptop", *load_grid_file("ssdsgd", PAPERS)["scales"]]:
        methods = {c["method"] for c in _resolved("ssdsgd", scale).values()}
        if "ssgd" not in methods:  # an ablation of the local rules alone (laptop_glu)
            continue
        compared += 1
        assert "asgd" in methods and methods & {"ssdsgd", "odsgd"}, scale
    assert compared >= 3


# ---- the released scripts' values ------------------------------------------------------------
def _value(config: dict, dotted: str):
    if dotted == "world":
        return config["nodes"] * config["workers"]
    node = config
    for part in dotted.split("."):
        node = node[part]
    return list(node) if isinstance(node, tuple) else node


@pytest.mark.parametrize("row", list(RELEASES))
def test_configured_values_are_the_released_scripts(row):
    release = RELEASES[row]
    assert release["sources"] and release["runs"]
    configs = {name: c for (name, seed), c in _resolved(release["grid"], release["scale"]).items()}
    for name in release["runs"]:
        config = configs[name]
        for key, value in release["values"].items():
            assert _value(config, key) == value, (row, name, key)
        options = release.get("options", {}).get(config["method"])
        if options:
            parsed = parse_options(ALGORITHMS.get(config["method"]).Options, config["method_params"])
            assert {k: getattr(parsed, k) for k in options} == options, (row, name)
    covered = {config["method"] for name, config in configs.items() if name in release["runs"]}
    assert set(release.get("options", {})) <= covered, row  # every method's options were compared


# ---- the schedules the rows need --------------------------------------------------------------
def test_warmup_from_a_fraction_is_the_ok_topk_release_ramp():
    """VGG/dl_trainer.py: lr = lr/P + (lr - lr/P) * iter / (10 epochs), then the milestones."""
    per_epoch, workers, base = 13, 16, 0.1
    train = {**DEFAULTS["train"], "lr": base, "warmup_epochs": 10, "warmup_start": 1 / workers,
             "lr_schedule": {"kind": "step", "milestones": [81, 122, 155], "gamma": 0.1}}
    for step in range(0, 161 * per_epoch, 7):
        epoch = step // per_epoch
        if epoch < 10:
            release = base / workers + (base - base / workers) * step / (10 * per_epoch)
        else:
            release = base * 0.1 ** sum(epoch >= m for m in (81, 122, 155))
        assert lr_at(step, per_epoch, 161 * per_epoch, train) == pytest.approx(release, rel=1e-12), step


def test_poly_is_mxnets_polyscheduler():
    """SSD-SGD's pow-2: MXNet's PolyScheduler(max_update, base_lr, pwr=2, warmup_steps) after the warm-up."""
    per_epoch, total, base = 10, 900, 0.8
    warmup = 5 * per_epoch
    train = {**DEFAULTS["train"], "lr": base, "warmup_epochs": 5, "lr_schedule": {"kind": "poly", "power": 2}}
    for step in range(warmup, total):
        release = base * (1 - (step - warmup) / (total - warmup)) ** 2
        assert lr_at(step, per_epoch, total, train) == pytest.approx(release, rel=1e-12)
    assert lr_at(0, per_epoch, total, train) == base / warmup  # the warm-up as before: lr x (step + 1) / steps


def test_od_sgd_schedule_meets_the_release_at_every_epoch():
    """CynthiaProtector/OD-SGD's modified MultiFactorScheduler with steps at epochs 1-7: +0.14 at
    epochs 1-5 from 0.1, then x0.1 at 6 and 7 (the release steps once per epoch; ours ramps
    linearly between the same values)."""
    configs = _resolved("ssdsgd", "paper")
    train, per_epoch = configs[("odsgd_glu", 0)]["train"], 195
    release = [0.1 + 0.14 * e for e in range(6)] + [0.08, 0.008, 0.008]
    for epoch, lr in enumerate(release):
        assert lr_at(epoch * per_epoch, per_epoch, 200 * per_epoch, train) == pytest.approx(lr, rel=1e-12)
