"""Every registered method declares its traits on its own class, and they are valid
(src/commlab/algorithms/base.py): the cost model's pattern, the family, the host-sync budget, the
short run's options and what its checkpoint holds. A method added as one file is checked here
for all of them, by the same rules as the others; nothing else in the project names it.

* each trait is set in the registered class's own body (not None, not inherited from a parent,
  whose choice may not be the child's);
* the pattern is one of the cost model's, the family one of ``FAMILIES``, the budget's step kinds
  those ``commlab bench syncs`` tells apart;
* the quick options pass the method's own ``Options`` and ``validate()`` at 1, 2 and 4 workers;
* the module's file is named after the method (``commlab list`` shows it);
* a method that says it holds no state saves none, and one that names its state saves some.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

from commlab.algorithms.base import FAMILIES, Algorithm, QuickRun, ResumeState, SyncBudget, parse_options
from commlab.bench.costmodel import PATTERNS
from commlab.bench.syncs import STEP_KINDS
from commlab.registry import ALGORITHMS, MODELS
from commlab.testing import drive, run_distributed
from commlab.testing.quick import quick_model, quick_params

TRAITS = {"comm_pattern": str, "family": str, "host_sync_budget": SyncBudget, "quick_run": QuickRun,
          "resume": ResumeState}
METHODS = ALGORITHMS.package_names()


def trait_problems(name: str, cls: type) -> list[str]:
    """What is undeclared or invalid among ``cls``'s traits (empty: all declared and valid)."""
    problems = []
    for trait, kind in TRAITS.items():
        value = vars(cls).get(trait)
        if value is None:
            inherited = getattr(cls, trait, None)
            problems.append(f"{trait}: not declared on {cls.__name__}" +
                            (f" (inherited {inherited!r})" if inherited is not None else ""))
        elif not isinstance(value, kind):
            problems.append(f"{trait}: a {kind.__name__} is expected, got {value!r}")
    if problems:
        return problems
    if cls.comm_pattern not in PATTERNS:
        problems.append(f"comm_pattern: {cls.comm_pattern!r} is not one of {sorted(PATTERNS)}")
    if cls.family not in FAMILIES:
        problems.append(f"family: {cls.family!r} is not one of {FAMILIES}")
    unknown = sorted(set(cls.host_sync_budget.limits) - set(STEP_KINDS))
    if unknown:
        problems.append(f"host_sync_budget: step kinds {unknown} are not among {STEP_KINDS}")
    for workers in (1, 2, 4):
        try:
            parse_options(cls.Options, cls.quick_run.options(workers), f"{name}.quick_run")
        except (TypeError, ValueError) as err:
            problems.append(f"quick_run at {workers} workers: {err}")
    if cls.resume.inexact and not cls.resume.state:
        problems.append("resume: inexact without any state")
    return problems


def test_the_checker_names_what_is_missing_inherited_or_invalid():
    class Undeclared(Algorithm):
        pass

    assert [p.split(":")[0] for p in trait_problems("undeclared", Undeclared)] == list(TRAITS)

    class Child(ALGORITHMS.get("ssgd")):
        pass

    assert trait_problems("child", Child)[0] == ("comm_pattern: not declared on Child (inherited 'ring_allreduce')")

    class Wrong(Algorithm):
        comm_pattern = "butterfly"
        family = "telepathic"
        host_sync_budget = SyncBudget({"epoch": 0})
        quick_run = QuickRun({"period": 0})
        resume = ResumeState("", inexact="timing")

    assert [p.split(":")[0] for p in trait_problems("wrong", Wrong)] == [
        "comm_pattern", "family", "host_sync_budget", "quick_run at 1 workers", "quick_run at 2 workers",
        "quick_run at 4 workers", "resume"]
    assert "unknown option(s) ['period']" in trait_problems("wrong", Wrong)[3]


def test_the_shapes_refuse_what_would_hide_a_check():
    with pytest.raises(ValueError, match="limits per step kind, or"):
        SyncBudget()  # neither limits nor a reason
    with pytest.raises(ValueError, match="limits per step kind, or"):
        SyncBudget({"step": 0}, unbudgeted="both")
    with pytest.raises(ValueError, match="counts >= 0"):
        SyncBudget({"step": -1})
    with pytest.raises(ValueError, match="counts >= 0"):
        SyncBudget({"step": True})
    assert SyncBudget.none("no reads matter").limits == {}
    with pytest.raises(TypeError):
        SyncBudget({"step": 1}).limits["step"] = 2  # shared by every instance of the class: read-only
    quick = QuickRun({"period": 4}, by_workers=lambda workers: {"group_size": 2 if workers % 2 == 0 else 1})
    assert quick.options(4) == {"period": 4, "group_size": 2} and quick.options(1) == {"period": 4, "group_size": 1}
    quick.options(4)["period"] = 8
    assert quick.options(4)["period"] == 4  # a new dict each time
    with pytest.raises(ValueError, match="words"):
        ResumeState(None)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_declares_its_traits_and_they_are_valid(name):
    cls = ALGORITHMS.get(name)
    assert trait_problems(name, cls) == []
    assert quick_model(name) in MODELS
    assert quick_params(name, 4) == cls.quick_run.options(4)


@pytest.mark.parametrize("name", METHODS)
def test_every_method_lives_in_a_file_named_after_it(name):
    assert Path(inspect.getfile(ALGORITHMS.get(name))).name == f"{name}.py"


def test_commlab_list_names_each_methods_file(capsys):
    from commlab.cli import main

    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = dict(line.split() for line in lines[1:lines.index("models:")])
    assert sorted(listed) == ALGORITHMS.names()
    for name in METHODS:
        path = Path(listed[name])
        assert path.resolve() == Path(inspect.getfile(ALGORITHMS.get(name))).resolve() and path.is_file()


def _saved_state(rank: int, world: int, methods: list[str]) -> dict[str, bool]:
    """Whether each method's checkpoint holds anything on this rank after a short run."""
    gen = torch.Generator().manual_seed(rank)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)

    saved = {}
    for method in methods:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        driven = drive(method, quick_params(method, world), model=model, steps=6, train={"lr": 0.01}, batches=batch)
        driven.finish()
        saved[method] = bool(driven.algo.state_dict())
    return saved


def test_what_a_method_says_it_checkpoints_is_what_it_saves():
    per_rank = run_distributed(_saved_state, 2, args=(METHODS,), timeout_s=300)
    mismatched = {name: (ALGORITHMS.get(name).resume.state, [ranks[name] for ranks in per_rank]) for name in METHODS
                  if bool(ALGORITHMS.get(name).resume.state) != any(ranks[name] for ranks in per_rank)}
    assert mismatched == {}
