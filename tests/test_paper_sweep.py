"""Two steps of every distinct (model, dataset kind, method family) of the paper scales, read from
the grids themselves, through the training loop on two gloo ranks and stand-ins of the data
(tests/standins.py): tiny configurations of the same model code (BERT with 2 layers, the ImageNet
networks at 32-64 pixels, classifiers 64 wide instead of 4096: VGG-16's full fc6 of 102.8M
elements takes its step alone in tests/test_paper_workloads.py), the grid's method options with
warm-ups and periods shortened so that the second step takes the method's main path. Every run
ends with finite losses and test metrics and the replicas its method promises equal
(``replicated_tensors``)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import yaml

from commlab.grid import load_grid_file, resolve_grid
from commlab.registry import ALGORITHMS, DATASETS
from commlab.testing import run_distributed
from commlab.testing.quick import QUICK_PARAMS
from looprun import run, run_config

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {name: ALGORITHMS.get(name).family for name in ALGORITHMS.names()}  # each method's declared family
# The same model code, small: what each model runs with here (run-config overrides).
NARROW = "{fc_width: 64}"
TINY = {
    "resnet20": {}, "resnet44": {}, "vgg16": {}, "vgg16_fc": {"model_options": NARROW},
    "resnet50": {"task.image_size": 32}, "googlenet": {"task.image_size": 32},
    "alexnet": {"task.image_size": 64, "model_options": NARROW},
    "vgg16_imagenet": {"task.image_size": 32, "model_options": NARROW},
    "lstm_lm": {"model_options": "{embed: 16, hidden: 16, dropout: 0.0}", "task.bptt": 5},
    "bert": {"model_options": "{layers: 2, hidden: 32, heads: 2}", "task.seq_len": 16, "train.eval_batch_size": 8},
}
# Periods and warm-ups short enough for the second step to take the method's main path.
SHORT = {"warmup_steps": 1, "k": 2, "period": 2, "k_local": 1, "k_global": 2, "initial_period": 1,
         "calibration_syncs": 1, "calibration_warmup": 1}


def paper_cells() -> dict[tuple[str, str, str], dict]:
    """(model, dataset kind, method family) -> one run config of the paper scales that has it,
    choosing a method not yet chosen where the family offers one (so that more methods run)."""
    candidates: dict[tuple[str, str, str], list[dict]] = {}
    for grid in sorted(p.stem for p in (ROOT / "config" / "papers").glob("*.yaml")):
        for scale in load_grid_file(grid, ROOT / "config" / "papers").get("scales") or {}:
            if scale.startswith("paper"):
                for config in resolve_grid(grid, scale=scale, papers_dir=ROOT / "config" / "papers").values():
                    key = (config["model"], DATASETS.get(config["dataset"]).kind, FAMILIES[config["method"]])
                    candidates.setdefault(key, []).append(config)
    cells, chosen = {}, set()
    for key in sorted(candidates):
        by_method = {c["method"]: c for c in sorted(candidates[key], key=lambda c: (c["method"], c["dataset"]))}
        method = next((m for m in by_method if m not in chosen), next(iter(by_method)))
        chosen.add(method)
        cells[key] = by_method[method]
    return cells


def _short_params(config: dict) -> str:
    """The grid's method options with QUICK_PARAMS and SHORT applied where the method has them."""
    cls = ALGORITHMS.get(config["method"])
    known = {f.name for f in dataclasses.fields(cls.Options)} | set(getattr(cls.Options, "ALIASES", {}))
    params = {**config["method_params"], **QUICK_PARAMS.get(config["method"], {})}
    params.update({k: v for k, v in SHORT.items() if k in known and (k in params or k in ("warmup_steps",))})
    if "group_size" in params:
        params["group_size"] = 0  # one group per node: both ranks
    return yaml.safe_dump(params, default_flow_style=True, width=1_000).strip()


def _replicas(loop) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in loop.algo.replicated_tensors()])


def _sweep(rank: int, world: int, configs: list[dict]) -> list:
    results = []
    for config in configs:
        results.append(run(config, keep=_replicas))
        # The run's final checkpoint is not what this test reads, and the paper models' are large
        # (ResNet-50's with a delayed method's state: 450 MB a rank): each rank drops its own once
        # the run has ended, so the sweep needs one run's disk, not thirty runs'.
        for saved in (Path(config["output_dir"]) / "checkpoints").glob(f"step_*/rank{rank}.pt"):
            saved.unlink()
    return results


CELLS = paper_cells()
SWEPT = list(CELLS)


@pytest.fixture(scope="module")
def sweep(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    configs = []
    for model, kind, family in SWEPT:
        cell = CELLS[(model, kind, family)]
        configs.append(run_config(prepared, out, f"{model}_{kind}_{family}", cell["dataset"], model, 2, **{
            "method": cell["method"], "method_params": _short_params(cell), "train.max_steps": 2,
            "train.test_subset": 400 if kind == "text" else 16,  # tokens for text: 10 columns of 40
            "train.eval_batch_size": 4, "train.lr": 0.01, "loader.workers": 0, **TINY[model]}))
    results = run_distributed(_sweep, 2, args=(configs,), timeout_s=600)
    return {key: (results[0][i], results[1][i]) for i, key in enumerate(SWEPT)}


def test_the_sweep_covers_every_cell_of_the_paper_scales():
    assert {k[0] for k in SWEPT} == set(TINY)  # every model of the paper scales
    assert {k[2] for k in SWEPT} == set(FAMILIES.values())
    assert {k[1] for k in SWEPT} == {"tensors", "image_folder", "text", "tokens"}


@pytest.mark.parametrize("cell", SWEPT, ids=["-".join(k) + f"-{CELLS[k]['method']}" for k in SWEPT])
def test_two_steps_of_every_paper_cell(sweep, cell):
    (final, _, curve, replicas), (final1, _, _, replicas1) = sweep[cell]
    assert final["step"] == 2 and [p["step"] for p in curve] == [1, 2]
    assert all(math.isfinite(p["train_loss"]) for p in curve)
    metric = {"text": "test_perplexity", "tokens": "test_mlm_accuracy"}.get(cell[1], "test_accuracy")
    assert math.isfinite(final[metric]) and final[metric] == final1[metric]
    assert torch.equal(replicas, replicas1)
