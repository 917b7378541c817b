"""Claims tables: each paper's claims declared once as data, evaluated against the measured runs
(the format, and how to add a claim, a rule or a paper: docs/claims.md).

A paper's claims live in ``commlab.report.claims_<paper>`` as a list ``CLAIMS`` of
:class:`Declared`: the claim in a sentence, the paper's figure or section, and one or more
:class:`Source` (what is measured, from which runs or benchmark file, and the shared rule of
:mod:`commlab.report.rules` that judges it). :func:`evaluate` turns them into :class:`Claim` rows
(claim, paper, ours, verdict, note, seeds); :func:`write_claims` saves ``<out>/<paper>/claims.json``,
which the report shows first and the index gathers. The notebooks hold no verdict logic.

A source's ``measure(evidence)`` returns the measurement as a dict of named values (or a list of
dicts: one claim row each, e.g. per model), ``None`` when its runs or files are absent (the next
source is tried; with none left the claim is "not measured", saying ``missing`` and ``needs``),
or :class:`NotMeasured` for a row that says itself why it is not measured. The ``claim``,
``paper``, ``ours`` and ``note`` texts are :meth:`str.format` templates over those values, plus
``{why}`` (the rule's own words) and ``{verdict}``. Declared once, e.g.::

    Declared(
        claim="{name}: test accuracy within about a point of dense allreduce",
        paper="Fig. 10-12",
        sources=(Source(measure=accuracy_against_dense,            # values: name, acc, dense, trend, ...
                        rule=AccuracyMatch("acc", "dense", margin=1.0, trend="trend"),
                        ours="{acc_text} vs ssgd {dense_text}",
                        note="{why}; {workers} workers, density {density:g}"),),
        needs="needs finished runs and ssgd on as many workers")

Verdicts are one of ``VERDICTS`` (docs/claims.md gives each one's decision rule). What was
measured against the claim is reproduced, partly reproduced or contradicted (the claim's premise
holds here and the measurement goes against it beyond the noise); what this setting cannot decide
says why: inconclusive (within the noise; the note says how many seeds would decide it), not
testable at this scale (the premise is absent or the paper's regime out of reach; ``to_test``
says what would test it), not testable at this budget (the runs have not converged), not measured
(a run, a file or a metric is missing). A statement that holds by construction (a byte count given
by a formula, a density the method is set to) is no reproduction of a paper: it is a consistency
check of our own accounting (``check=True``, rule :class:`~commlab.report.rules.Consistency`), with
the verdict ``consistent`` or ``inconsistent`` (``CHECKS``), listed apart from the paper's claims.

Each claim says how many seeds stand behind its means (``seeds``, e.g. "n=3" or "n=1-3"): the
measurement's ``seeds`` value, or else read from the "(n=…)" that :func:`mean_sd` writes into ``ours``.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

REPRODUCED, PARTLY = "reproduced", "partly reproduced"
CONTRADICTED = "contradicted"  # the premise holds here and the measurement goes against the claim beyond the noise
INCONCLUSIVE = "inconclusive"  # within the noise: the note says how many seeds would decide it
UNTESTABLE = "not testable at this scale"  # the premise is absent or the regime out of reach here
UNCONVERGED = "not testable at this budget"  # the runs have not converged: the gap is still moving
NOT_MEASURED = "not measured"  # a run, a file or a metric is missing
CONSISTENT, INCONSISTENT = "consistent", "inconsistent"
REPRODUCTION = (REPRODUCED, PARTLY, CONTRADICTED, INCONCLUSIVE, UNTESTABLE, UNCONVERGED, NOT_MEASURED)
CHECKS = (CONSISTENT, INCONSISTENT)  # statements that hold by construction
VERDICTS = REPRODUCTION + CHECKS
#: What each verdict means, in a sentence (docs/claims.md gives each one's decision rule).
VERDICT_MEANINGS = {
    REPRODUCED: "measured here as the paper claims",
    PARTLY: "measured here, part of the claim holds",
    CONTRADICTED: "the premise holds here and the measurement goes against the claim beyond the noise",
    INCONCLUSIVE: "measured, but within the noise: the note says how many seeds would decide it",
    UNTESTABLE: "the premise is absent or the paper's regime out of reach here: the note says what would test it",
    UNCONVERGED: "the runs have not converged (the reference still improves or the gap still closes): the note "
                 "gives the trend and what would test it",
    NOT_MEASURED: "a run, a benchmark file or a metric is missing: the note says which",
    CONSISTENT: "a check of our own accounting that holds (not a reproduction)",
    INCONSISTENT: "a check of our own accounting that fails",
}
VERDICT_COLOURS = {REPRODUCED: "#d4edda", PARTLY: "#fff3cd", CONTRADICTED: "#f8d7da", INCONCLUSIVE: "#e6dcf2",
                   UNTESTABLE: "#dbe7f3", UNCONVERGED: "#dbe7f3", NOT_MEASURED: "#e2e3e5", CONSISTENT: "#d1ecf1",
                   INCONSISTENT: "#f5c6cb"}
#: Verdicts whose note gets the declaration's ``caveat``, and those that get its ``to_test``.
_CAVEATED = (PARTLY, CONTRADICTED, INCONCLUSIVE)
_NOT_TESTABLE = (UNTESTABLE, UNCONVERGED)
CHECK_PREFIX = "[consistency check] "
_N = re.compile(r"\(n=(\d+)\)")


@dataclass
class Claim:
    """One row of a claims table, as evaluated."""

    claim: str  # the paper's claim, in a sentence
    paper: str  # the paper's figure (number and setting)
    ours: str  # our measurement at our scale, with the spread over seeds
    verdict: str  # one of VERDICTS
    note: str = ""  # why, and where our setting differs
    seeds: str = ""  # seeds behind the means in ``ours``: "n=3", "n=1-3"; "" where none

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.verdict == NOT_MEASURED:
            self.seeds = ""  # no mean to stand behind
        elif not self.seeds:
            self.seeds = seeds_label(int(n) for n in _N.findall(self.ours))

    @property
    def is_check(self) -> bool:
        """Whether this is a consistency check (holds by construction), not a paper's claim."""
        return self.verdict in CHECKS


# ---- declarations --------------------------------------------------------------------------------

@dataclass(frozen=True)
class NotMeasured:
    """A measurement that says why its row is not measured; ``values`` fill the claim's templates
    (e.g. the model of a per-model claim)."""

    ours: str = "no runs"
    note: str = ""
    values: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Source:
    """One way to measure a claim: ``measure(evidence)`` -> values (see the module docstring),
    judged by ``rule`` (:mod:`commlab.report.rules`), shown through the ``ours`` and ``note`` templates."""

    measure: Callable[[Any], Any]
    rule: Any
    ours: str
    note: str = ""


@dataclass(frozen=True)
class Declared:
    """A paper's claim: its text and figure, the sources that can measure it (the first that finds
    its runs or files decides), what the row says when none does, and whether it is a consistency
    check. ``caveat`` is added to the note of a verdict that is partly reproduced, contradicted or
    inconclusive; ``to_test`` (what would test the claim: a longer run, a paper-scale grid, a
    cluster) to the note of a verdict "not testable", both templates over the measurement."""

    claim: str
    paper: str
    sources: tuple[Source, ...]
    missing: str = "no runs"
    needs: str = ""
    check: bool = False
    caveat: str = ""
    to_test: str = ""


@dataclass
class Evidence:
    """What claims are measured from: the paper's runs (one row per name and seed, final metrics and
    ``param.*`` columns), their metric history (long form) and the benchmark results under
    ``<out_dir>/bench`` (the report's own folder; without ``out_dir`` there are none). Tables derived
    once and shared by several claims (and the figures) are cached: ``evidence.table(describe)``."""

    runs: pd.DataFrame
    history: pd.DataFrame
    out_dir: Path | None = None
    tables: dict = field(default_factory=dict, repr=False)

    def table(self, build: Callable[[Evidence], Any]) -> Any:
        if build not in self.tables:
            self.tables[build] = build(self)
        return self.tables[build]

    def bench(self, name: str) -> dict | None:
        """``<out_dir>/bench/<name>.json`` with the path it was read from as ``file``, or None."""
        from commlab.report.bench import load_bench

        return load_bench(name, self.out_dir) if self.out_dir is not None else None


def _fill(template: str, values: dict) -> str:
    return template.format_map(values) if template else ""


def _row(declared: Declared, claim: str, paper: str, ours: str, verdict: str, note: str, seeds: str,
         values: dict) -> Claim:
    if verdict in _CAVEATED and declared.caveat:
        note += _fill(declared.caveat, values)
    if verdict in _NOT_TESTABLE and declared.to_test:
        note = "; ".join(filter(None, [note, "to test it: " + _fill(declared.to_test, values)]))
    return Claim(CHECK_PREFIX + claim if declared.check else claim, paper, ours, verdict, note, seeds)


def _judged(declared: Declared, source: Source, values: dict) -> Claim:
    outcome = source.rule.judge(values)
    filled = {**values, "why": outcome.why, "verdict": outcome.verdict}
    return _row(declared, _fill(declared.claim, filled), _fill(declared.paper, filled),
                _fill(source.ours, filled), outcome.verdict, _fill(source.note, filled), str(values.get("seeds", "")),
                filled)


def _unmeasured(declared: Declared, why: NotMeasured) -> Claim:
    return _row(declared, _fill(declared.claim, why.values), _fill(declared.paper, why.values), why.ours,
                NOT_MEASURED, why.note, "", why.values)


def evaluate_one(declared: Declared, evidence: Evidence) -> list[Claim]:
    """The rows of one declared claim: the first source that measures decides."""
    for source in declared.sources:
        found = source.measure(evidence)
        if found is None:
            continue
        rows = found if isinstance(found, list) else [found]
        return [_unmeasured(declared, r) if isinstance(r, NotMeasured) else _judged(declared, source, r)
                for r in rows]
    return [_unmeasured(declared, NotMeasured(declared.missing, declared.needs))]


def evaluate(declared: list[Declared], evidence: Evidence) -> list[Claim]:
    """Every declared claim's rows, in the declared order."""
    return [row for d in declared for row in evaluate_one(d, evidence)]


def declarations(paper: str):
    """The module ``commlab.report.claims_<paper>`` (its ``CLAIMS``, ``METRICS`` and the tables
    its figures share)."""
    try:
        return importlib.import_module(f"commlab.report.claims_{paper}")
    except ModuleNotFoundError as err:
        if err.name != f"commlab.report.claims_{paper}":
            raise
        raise ValueError(f"paper {paper!r} declares no claims: no module commlab.report.claims_{paper}") from None


# ---- texts and files -----------------------------------------------------------------------------

def mean_sd(values) -> str:
    """'m ± sd (n=…)' of a series, for the ``ours`` column."""
    s = pd.Series(values, dtype=float).dropna()
    if s.empty:
        return "no runs"
    sd = s.std(ddof=1) if len(s) > 1 else 0.0
    return f"{s.mean():.4g} ± {sd:.2g} (n={len(s)})"


def seeds_label(counts) -> str:
    """'n=3' when every mean has as many seeds, 'n=1-3' otherwise, '' without any."""
    counts = sorted(set(counts))
    if not counts:
        return ""
    return f"n={counts[0]}" if len(counts) == 1 else f"n={counts[0]}-{counts[-1]}"


def seeds_of(runs: pd.DataFrame) -> str:
    """'n=3' (or 'n=1-3'): the seeds per run name behind the means a claim compares."""
    return seeds_label(runs.groupby("name").seed.nunique()) if len(runs) else ""


def write_claims(paper: str, title: str, claims: list[Claim], out_dir: str | Path) -> Path:
    """``<out_dir>/<paper>/claims.json``: the title and every row, in order."""
    path = Path(out_dir) / paper / "claims.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"paper": paper, "title": title, "claims": [asdict(c) for c in claims]},
                               indent=2) + "\n")
    return path
