"""Run configs: defaults, YAML loading, ``key=value`` overrides, validation and the run folder.

A run config is one experiment (one method, one seed). One definition: the JSON schema
(``schemas/run.schema.yaml``) holds every key, its type and its default. Validation happens in
two layers, both before any worker starts: the schema catches unknown keys and wrong types, then
the registries catch unknown method/model/dataset names and the method's own Options check its
parameters (parsed once, :func:`load_run` returns them). Every message names the offending key.
``dotted.key=value`` overrides (:func:`apply_override`) and :func:`run_dir` serve every caller:
the CLI, grids, the launcher, benchmarks and the workflow.
"""

from __future__ import annotations

import copy
import functools
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from commlab.options import parse_options
from commlab.registry import ALGORITHMS, DATASETS, MODELS


class ConfigError(ValueError):
    """A config is invalid; the message names the key."""


@functools.cache
def _parsed_run_schema() -> dict:
    text = resources.files("commlab").joinpath("schemas/run.schema.yaml").read_text()
    return yaml.safe_load(text)


def run_schema() -> dict:
    """The run config's JSON schema (a copy: parsed once per process, as a grid validates every run)."""
    return copy.deepcopy(_parsed_run_schema())


@functools.cache
def _run_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(_parsed_run_schema())


def warm_up() -> None:
    """What validating a first config costs a process, paid now: the run schema's validator and
    every registered method, model and dataset imported. A fork server calls it once
    (:mod:`commlab.launch.warm`), so that the workers forked from it validate at once."""
    _run_validator()
    for registry in (ALGORITHMS, MODELS, DATASETS):
        registry.names()


def schema_defaults(schema: dict) -> dict[str, Any]:
    """The defaults a JSON schema declares: a property's ``default``, else its sub-properties'."""
    out = {}
    for key, prop in schema.get("properties", {}).items():
        if "default" in prop:
            out[key] = copy.deepcopy(prop["default"])
        elif prop.get("properties"):
            out[key] = schema_defaults(prop)
    return out


DEFAULTS: dict[str, Any] = schema_defaults(run_schema())  # one definition: the schema


def deep_merge(base: dict, override: dict) -> dict:
    """Return ``base`` updated recursively with ``override`` (neither is modified)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "method_params":
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_override(config: dict, assignment: str) -> None:
    """Apply one ``dotted.key=value`` override in place; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} is not of the form key=value")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = config
    for part in parts[:-1]:
        if node.get(part) is None:  # an optional section left out (e.g. network: null) starts empty
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> dict:
    """Defaults <- YAML file <- overrides, validated."""
    return load_run(path, overrides)[0]


def load_run(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> tuple[dict, Any]:
    """Defaults <- YAML file <- overrides, validated: the config and the method's parsed Options."""
    config = copy.deepcopy(DEFAULTS)
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(loaded).__name__}")
        config = deep_merge(config, loaded)
    for assignment in overrides:
        apply_override(config, assignment)
    return config, validate_config(config)




def validate_config(config: dict) -> Any:
    """Raise :class:`ConfigError` naming the first bad key or value; return the method's Options."""
    validator = _run_validator()
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        raise ConfigError(f"config key {where}: {err.message}")
    import_plugins(config.get("plugins") or [])
    for key, registry in (("method", ALGORITHMS), ("model", MODELS), ("dataset", DATASETS)):
        if config[key] not in registry:
            raise ConfigError(f"config key {key}: unknown {registry.kind} {config[key]!r}; "
                              f"known: {', '.join(registry.names())}")
    from commlab.models import model_task

    wanted, task = DATASETS.get(config["dataset"]).task, model_task(config["model"])
    if task != wanted:
        fits = [m for m in MODELS.names() if model_task(m) == wanted]
        raise ConfigError(f"config key model: {config['model']!r} is built for {task}, but dataset "
                          f"{config['dataset']!r} is for {wanted} ({', '.join(fits)})")
    try:
        options = parse_options(ALGORITHMS.get(config["method"]).Options, config.get("method_params"),
                                where="config key method_params")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    subset = config["train"].get("train_subset")
    global_batch = config["workers"] * config.get("nodes", 1) * config["train"]["batch_size"]
    if subset is not None and subset < global_batch:
        raise ConfigError(
            f"config key train.train_subset: {subset} samples cannot fill one step of "
            f"{config['workers']} workers x batch {config['train']['batch_size']}"
        )
    return options


def import_plugins(plugins: list[str]) -> None:
    """Import the config's ``plugins`` (each a module name, or a path to a ``.py`` file), so that
    the methods, models and datasets they register are known: a method outside the package is
    then one file and one ``plugins`` entry. Every process that loads the config imports them."""
    import importlib
    import importlib.util
    import sys

    for i, plugin in enumerate(plugins):
        where = f"config key plugins.{i}"
        if plugin.endswith(".py"):
            path = Path(plugin).resolve()
            name = f"commlab_plugin_{path.stem}"
            if name in sys.modules:
                continue
            if not path.is_file():
                raise ConfigError(f"{where}: no file {plugin!r}")
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as err:
                del sys.modules[name]
                raise ConfigError(f"{where}: importing {plugin!r} failed: {type(err).__name__}: {err}") from err
        else:
            try:
                importlib.import_module(plugin)
            except ImportError as err:
                raise ConfigError(f"{where}: cannot import {plugin!r} ({err})") from err


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 0.1}}`` -> ``{"train.lr": 0.1}`` (for MLflow params)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def run_dir(config: dict, root: str | Path = "results") -> Path:
    """The run's folder (checkpoints, outputs, sentinel): ``output_dir``, else
    ``<root>/<scale>/<paper>/<name>/seed<seed>`` (scale ``adhoc`` outside a grid). Each scale has
    its own folders: a checkpoint of one scale never resumes another."""
    if config.get("output_dir"):
        return Path(config["output_dir"])
    return (Path(root) / (config.get("scale") or "adhoc") / config.get("paper", "adhoc")
            / (config.get("name") or config["method"]) / f"seed{config['seed']}")


def dump_config(config: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config, sort_keys=False))
