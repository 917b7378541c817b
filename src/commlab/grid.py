"""Experiment grids: ``config/papers/<paper>.yaml`` -> one run config per (paper, run name, seed).

A grid file looks like::

    title: "K-step averaging (Cong et al., ICPP'19)"
    seeds: [0, 1, 2]
    base:                       # merged over config.yaml's `defaults` for every run of the paper
      workers: 6
    runs:                       # run name -> fragment merged over base
      ssgd: {method: ssgd}
      kstep_k16: {method: kstep, method_params: {k: 16}}
      probe: {method: kstep, seeds: [0]}   # a run's own seeds replace the grid's
    scales:                     # optional, per scale (laptop is the file itself)
      smoke: {seeds: [0], base: {train: {train_subset: 2000}}, runs: [ssgd, kstep_k16]}
      paper: {base: {dataset: cifar10, model: resnet20}, runs: {...}}

The grid file is checked against ``schemas/grid.schema.yaml``. In a scale, ``base`` is merged over
the paper's base, ``seeds`` replaces the seeds, and ``runs`` is either a list of names to keep or a
mapping that replaces the runs. A run's own ``seeds`` replace the grid's for that run (e.g. one
seed for a volume measurement that does not depend on it, beside three for accuracy). Every
resolved config carries its ``scale`` and is validated here, so a bad key stops the whole
workflow before any job starts.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path

import jsonschema
import yaml

from commlab.config import DEFAULTS, ConfigError, deep_merge, validate_config

PAPERS_DIR = "config/papers"  # the paper grids, relative to the project's root


def grid_schema() -> dict:
    return yaml.safe_load(resources.files("commlab").joinpath("schemas/grid.schema.yaml").read_text())


def check_grid(grid: object, where: str) -> None:
    """Raise :class:`ConfigError` naming the first bad key of a grid (``schemas/grid.schema.yaml``)."""
    validator = jsonschema.Draft202012Validator(grid_schema())
    errors = sorted(validator.iter_errors(grid), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        err = errors[0]
        key = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        if err.validator == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            unknown = sorted(set(err.instance) - set(allowed))
            raise ConfigError(f"{where}: unknown key(s) {unknown} at {key}; allowed: {allowed}")
        raise ConfigError(f"{where}: key {key}: {err.message}")


def load_grid_file(paper: str, papers_dir: str | Path = PAPERS_DIR) -> dict:
    path = Path(papers_dir) / f"{paper}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in Path(papers_dir).glob("*.yaml"))
        raise ConfigError(f"no grid for paper {paper!r}: {path} does not exist; known: {', '.join(known)}")
    grid = yaml.safe_load(path.read_text()) or {}
    check_grid(grid, str(path))
    return grid


def resolve_grid(paper: str, defaults: dict | None = None, scale: str = "laptop",
                 papers_dir: str | Path = PAPERS_DIR) -> dict[tuple[str, int], dict]:
    """All run configs of a paper at a scale: ``{(name, seed): config}``, validated."""
    grid = load_grid_file(paper, papers_dir)
    base = deep_merge(DEFAULTS, defaults or {})
    base = deep_merge(base, grid.get("base") or {})
    runs, seeds = dict(grid["runs"]), list(grid.get("seeds") or [0])
    if scale != "laptop":
        override = (grid.get("scales") or {}).get(scale)
        if override is None:
            raise ConfigError(f"config/papers/{paper}.yaml has no scale {scale!r}; "
                              f"known: laptop, {', '.join(grid.get('scales') or {}) or '(none)'}")
        base = deep_merge(base, override.get("base") or {})
        seeds = list(override.get("seeds", seeds))
        chosen = override.get("runs")
        if isinstance(chosen, list):
            missing = sorted(set(chosen) - set(runs))
            if missing:
                raise ConfigError(f"config/papers/{paper}.yaml scales.{scale}.runs: unknown run(s) {missing}")
            runs = {name: runs[name] for name in chosen}
        elif isinstance(chosen, dict):
            runs = chosen
    configs = {}
    for name, fragment in runs.items():
        fragment = dict(fragment or {})
        run_seeds = list(fragment.pop("seeds", seeds))
        for seed in run_seeds:
            config = deep_merge(base, fragment)
            config.update(paper=paper, name=name, seed=seed, scale=scale)
            config["tracking"] = {**config.get("tracking", {}), "experiment": paper}
            try:
                validate_config(config)
            except ConfigError as err:
                raise ConfigError(f"config/papers/{paper}.yaml run {name!r}: {err}") from None
            configs[(name, seed)] = copy.deepcopy(config)
    return configs


def grid_title(paper: str, papers_dir: str | Path = PAPERS_DIR) -> str | None:
    """The title of the paper ``paper`` (``title:`` of its grid file), or None when there is no
    such title: no grid of that name in ``papers_dir`` (an ad-hoc experiment, or a working
    directory away from the project's root), or a grid without one. Callers that must show
    something show the paper's name instead."""
    if not (Path(papers_dir) / f"{paper}.yaml").exists():
        return None
    return load_grid_file(paper, papers_dir).get("title")
