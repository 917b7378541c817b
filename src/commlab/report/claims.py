"""Claims tables: each paper's claim beside our measurement and a verdict.

A notebook builds a list of :class:`Claim` from measured runs and calls :func:`write_claims`,
which saves ``<out>/<paper>/claims.json``; the report index gathers every paper's file into one
summary. Verdicts are one of ``VERDICTS``; "not measured" is honest when a run is missing.

A statement that holds by construction (a byte count given by a formula, a density the method is
set to) is no reproduction of a paper: it is a consistency check of our own accounting, with the
verdict ``consistent`` or ``inconsistent`` (``CHECKS``), listed apart from the paper's claims.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

REPRODUCTION = ("reproduced", "partly reproduced", "not reproduced", "not measured")
CHECKS = ("consistent", "inconsistent")  # statements that hold by construction
VERDICTS = REPRODUCTION + CHECKS


@dataclass
class Claim:
    claim: str  # the paper's claim, in a sentence
    paper: str  # the paper's figure (number and setting)
    ours: str  # our measurement at our scale, with the spread over seeds
    verdict: str  # one of VERDICTS
    note: str = ""  # why, and where our setting differs

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    @property
    def is_check(self) -> bool:
        """Whether this is a consistency check (holds by construction), not a paper's claim."""
        return self.verdict in CHECKS


def check(claim: str, paper: str, ours: str, holds: bool | None, note: str = "") -> Claim:
    """A consistency check: ``holds`` None when nothing was measured."""
    verdict = "not measured" if holds is None else "consistent" if holds else "inconsistent"
    return Claim(claim=f"[consistency check] {claim}", paper=paper, ours=ours, verdict=verdict, note=note)


def mean_sd(values) -> str:
    """'m ± sd (n=…)' of a series, for the ``ours`` column."""
    s = pd.Series(values, dtype=float).dropna()
    if s.empty:
        return "no runs"
    sd = s.std(ddof=1) if len(s) > 1 else 0.0
    return f"{s.mean():.4g} ± {sd:.2g} (n={len(s)})"


def claims_frame(claims: list[Claim]) -> pd.DataFrame:
    return pd.DataFrame([asdict(c) for c in claims])


def write_claims(paper: str, title: str, claims: list[Claim], out_dir: str | Path = "reports") -> Path:
    path = Path(out_dir) / paper / "claims.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"paper": paper, "title": title, "claims": [asdict(c) for c in claims]},
                               indent=2) + "\n")
    return path
