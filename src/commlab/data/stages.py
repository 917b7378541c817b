"""The files a dataset's DVC stage depends on, for the workflow's data rule.

Snakemake decides from file times whether a job runs, DVC from the hashes in dvc.lock. The data
rule (workflow/rules/data.smk) takes the stage's ``deps`` from dvc.yaml as its inputs, so that a
change DVC would see (code, raw files) also makes Snakemake schedule ``dvc repro``.
"""

from __future__ import annotations

import re
from pathlib import Path

from commlab.registry import DATASETS

TEMPLATE = re.compile(r"\$\{([^}]+)\}")  # DVC's `${dotted.name}`, filled from params.yaml


def param(params: dict, dotted: str):
    """A value of params.yaml by its dotted name (None when absent)."""
    node = params
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def stage_files(name: str, stage: dict, params: dict) -> list[str]:
    """Every file in stage ``name``'s deps: a file as it is, a folder as the files inside it."""
    files = []
    for dep in stage.get("deps", []):
        path = Path(TEMPLATE.sub(lambda m: str(param(params, m.group(1))), str(dep)))
        if not path.exists():
            raise FileNotFoundError(f"{path}, a dependency of the DVC stage {name!r} (dvc.yaml), does not "
                                    f"exist. {DATASETS.get(name).how_to_get}")
        files += sorted(str(p) for p in path.rglob("*") if p.is_file()) if path.is_dir() else [str(path)]
    return files
