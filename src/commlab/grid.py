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

A run may be **borrowed** from another paper's grid: ``ssgd: {borrow: baseline}`` reads the baseline
grid's run of the same name (every seed) instead of training a second one. It is resolved here as
this grid would train it and must agree with the lender's run key for key (the paper, the run's
output folder and its MLflow experiment aside): two reports then judge their claims against one
set of runs, and a grid that drifts from its lender stops the workflow with the keys that differ.
:func:`resolve_grid` leaves borrowed runs out (the lender trains them); :func:`borrowed_runs` names
them and their lenders.

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
    """The run configs a paper trains at a scale: ``{(name, seed): config}``, validated; its
    borrowed runs (trained by their lenders) are checked against the lenders' and left out."""
    configs, borrowed = _resolve(paper, defaults, scale, papers_dir)
    for (name, seed), (lender, config) in borrowed.items():
        _check_borrowed(paper, name, seed, lender, config, defaults, scale, papers_dir)
    return configs


def borrowed_runs(paper: str, scale: str = "laptop", papers_dir: str | Path = PAPERS_DIR) -> dict[tuple[str, int], str]:
    """``{(name, seed): lender paper}`` of the runs the paper borrows at ``scale`` (unchecked: the
    workflow checks them through :func:`resolve_grid` before any job)."""
    return {key: lender for key, (lender, _) in _resolve(paper, None, scale, papers_dir)[1].items()}


#: What a borrowed run may differ in from its lender's: whose grid and folder it is.
BORROW_IGNORES = ("paper", "output_dir", "tracking.experiment")


def _check_borrowed(paper: str, name: str, seed: int, lender: str, config: dict, defaults: dict | None, scale: str,
                    papers_dir: str | Path) -> None:
    where = f"config/papers/{paper}.yaml run {name!r}"
    if lender == paper:
        raise ConfigError(f"{where}: borrows from its own grid")
    lent, lent_borrowed = _resolve(lender, defaults, scale, papers_dir)
    if (name, seed) in lent_borrowed:
        raise ConfigError(f"{where}: {lender}'s run {name!r} is itself borrowed; borrow from the grid that trains it")
    if (name, seed) not in lent:
        raise ConfigError(f"{where}: borrows {lender}'s run {name!r} seed {seed}, which that grid does not have at "
                          f"scale {scale!r}")
    ours, theirs = _flat(config), _flat(lent[(name, seed)])
    ignored = [k for k in set(ours) | set(theirs) if any(k == i or k.startswith(i + ".") for i in BORROW_IGNORES)]
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k) and k not in ignored)
    if differ:
        shown = "; ".join(f"{k}: here {ours.get(k)!r}, {lender} {theirs.get(k)!r}" for k in differ[:6])
        raise ConfigError(f"{where}: borrows {lender}'s run but the configs differ ({shown}); make the grids agree or "
                          f"train the run here")


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _resolve(paper: str, defaults: dict | None, scale: str, papers_dir: str | Path) -> tuple[dict, dict]:
    """(trained runs, borrowed runs: ``{(name, seed): (lender, config as this grid would train it)}``)."""
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
    configs, borrowed = {}, {}
    for name, fragment in runs.items():
        fragment = dict(fragment or {})
        run_seeds = list(fragment.pop("seeds", seeds))
        lender = fragment.pop("borrow", None)
        for seed in run_seeds:
            config = deep_merge(base, fragment)
            config.update(paper=paper, name=name, seed=seed, scale=scale)
            config["tracking"] = {**config.get("tracking", {}), "experiment": paper}
            try:
                validate_config(config)
            except ConfigError as err:
                raise ConfigError(f"config/papers/{paper}.yaml run {name!r}: {err}") from None
            if lender is None:
                configs[(name, seed)] = copy.deepcopy(config)
            else:
                borrowed[(name, seed)] = (lender, copy.deepcopy(config))
    return configs, borrowed


def grid_title(paper: str, papers_dir: str | Path = PAPERS_DIR) -> str | None:
    """The title of the paper ``paper`` (``title:`` of its grid file), or None when there is no
    such title: no grid of that name in ``papers_dir`` (an ad-hoc experiment, or a working
    directory away from the project's root), or a grid without one. Callers that must show
    something show the paper's name instead."""
    if not (Path(papers_dir) / f"{paper}.yaml").exists():
        return None
    return load_grid_file(paper, papers_dir).get("title")
