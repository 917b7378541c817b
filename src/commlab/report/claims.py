"""Claims tables: each paper's claim beside our measurement and a verdict.

A notebook builds a list of :class:`Claim` from measured runs and calls :func:`write_claims`,
which saves ``<out>/<paper>/claims.json``; the report index gathers every paper's file into one
summary. Verdicts are one of ``VERDICTS``; "not measured" is honest when a run is missing.

A statement that holds by construction (a byte count given by a formula, a density the method is
set to) is no reproduction of a paper: it is a consistency check of our own accounting, with the
verdict ``consistent`` or ``inconsistent`` (``CHECKS``), listed apart from the paper's claims.

Each claim says how many seeds stand behind its means (``seeds``, e.g. "n=3" or "n=1-3"): given
by the notebook, or else read from the "(n=…)" that :func:`mean_sd` writes into ``ours``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

REPRODUCTION = ("reproduced", "partly reproduced", "not reproduced", "not measured")
CHECKS = ("consistent", "inconsistent")  # statements that hold by construction
VERDICTS = REPRODUCTION + CHECKS
VERDICT_COLOURS = {"reproduced": "#d4edda", "partly reproduced": "#fff3cd", "not reproduced": "#f8d7da",
                   "not measured": "#e2e3e5", "consistent": "#d1ecf1", "inconsistent": "#f5c6cb"}
_N = re.compile(r"\(n=(\d+)\)")


@dataclass
class Claim:
    claim: str  # the paper's claim, in a sentence
    paper: str  # the paper's figure (number and setting)
    ours: str  # our measurement at our scale, with the spread over seeds
    verdict: str  # one of VERDICTS
    note: str = ""  # why, and where our setting differs
    seeds: str = ""  # seeds behind the means in ``ours``: "n=3", "n=1-3"; "" where none

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")
        if self.verdict == "not measured":
            self.seeds = ""  # no mean to stand behind
        elif not self.seeds:
            self.seeds = seeds_label(int(n) for n in _N.findall(self.ours))

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


def accuracy_match(ours, reference, margin: float = 1.0, at_least: bool = False) -> tuple[str, str]:
    """(text, verdict) for "our accuracy is within ``margin`` points of the reference's", or with
    ``at_least`` for "no more than ``margin`` points below it" (a claim of similar or better accuracy).

    The gap of the means is judged together with its standard error over seeds,
    se = sqrt(sd_ours^2 / n_ours + sd_ref^2 / n_ref), so that neither a noisy comparison nor a gap
    at the edge passes for a match: reproduced when the shortfall (|gap|, or -gap with ``at_least``)
    stays within the margin by one standard error, shortfall + se <= margin; not reproduced when
    even shortfall - 2 se > margin (outside the margin beyond the noise); partly reproduced
    otherwise (the gap is near the margin, or the seeds are too noisy to tell: the text says which)."""
    a, b = pd.Series(ours, dtype=float).dropna(), pd.Series(reference, dtype=float).dropna()
    if a.empty or b.empty:
        return "no runs", "not measured"
    gap = a.mean() - b.mean()
    var = (a.var(ddof=1) / len(a) if len(a) > 1 else 0.0) + (b.var(ddof=1) / len(b) if len(b) > 1 else 0.0)
    se = float(var) ** 0.5
    shortfall = -gap if at_least else abs(gap)
    bound = f"at most {margin:g} below" if at_least else f"margin {margin:g}"
    text = f"gap {gap:+.2f} points, standard error {se:.2f} ({bound})"
    if shortfall + se <= margin:
        return text, "reproduced"
    if shortfall - 2 * se > margin:
        return text, "not reproduced"
    why = "too noisy over these seeds to tell" if se > margin else "the gap is within a standard error of the margin"
    return f"{text}; {why}", "partly reproduced"


def seeds_label(counts) -> str:
    """'n=3' when every mean has as many seeds, 'n=1-3' otherwise, '' without any."""
    counts = sorted(set(counts))
    if not counts:
        return ""
    return f"n={counts[0]}" if len(counts) == 1 else f"n={counts[0]}-{counts[-1]}"


def claims_frame(claims: list[Claim]) -> pd.DataFrame:
    return pd.DataFrame([asdict(c) for c in claims])


def write_claims(paper: str, title: str, claims: list[Claim], out_dir: str | Path = "reports") -> Path:
    path = Path(out_dir) / paper / "claims.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"paper": paper, "title": title, "claims": [asdict(c) for c in claims]},
                               indent=2) + "\n")
    return path
