"""Claims as data (commlab.report.claims): how a declared claim becomes rows of the claims table,
that every paper declares its claims in commlab.report.claims_<paper>, and that neither the
notebooks nor the report package reach below MLflow and the benchmark files.

The rules themselves are tested in tests/test_report_rules.py.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pandas as pd
import pytest

from commlab.report.claims import (
    CHECK_PREFIX,
    Claim,
    Declared,
    Evidence,
    NotMeasured,
    Source,
    declarations,
    evaluate,
    seeds_label,
)
from commlab.report.rules import AccuracyMatch, Consistency, Gain, NotTestable, Share, Within

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "workflow" / "notebooks").glob("*.py"))
EMPTY = Evidence(pd.DataFrame(), pd.DataFrame())


def _none(ev):
    return None


def test_the_first_source_that_measures_decides_and_fills_the_templates():
    calls = []

    def runs(ev):
        calls.append("runs")
        return None

    def bench(ev):
        calls.append("bench")
        return {"gap": 0.01, "allowed": 0.02, "method": "ssgd"}

    def never(ev):
        raise AssertionError("a later source is not measured once one has decided")

    declared = Declared(claim="{method} matches", paper="Fig. 1",
                        sources=(Source(runs, Within("gap", "allowed"), ours="runs"),
                                 Source(bench, Within("gap", "allowed"), ours="gap {gap:.3f} ({why})",
                                        note="{verdict} within {allowed}"),
                                 Source(never, Within("gap", "allowed"), ours="")))
    [row] = evaluate([declared], EMPTY)
    assert calls == ["runs", "bench"]
    assert row == Claim("ssgd matches", "Fig. 1", "gap 0.010 (0.01 <= 0.02)", "reproduced", "reproduced within 0.02")


def test_no_source_measures_the_claim_says_what_it_needs():
    declared = Declared(claim="c", paper="p", sources=(Source(_none, Within("a", 1.0), ours="{a}"),),
                        missing="no ADPSGD/CPSGD pair", needs="needs cpsgd and adpsgd runs")
    assert evaluate([declared], EMPTY) == [Claim("c", "p", "no ADPSGD/CPSGD pair", "not measured",
                                                 "needs cpsgd and adpsgd runs")]


def test_one_row_per_case_some_of_them_not_measured():
    def per_model(ev):
        return [{"model": "wide_mlp", "acc": [84.0, 84.2], "dense": [84.1, 84.3]},
                NotMeasured(note="needs redsync runs of this model", values={"model": "resnet20"})]

    declared = Declared(claim="near dense ({model})", paper="abstract",
                        sources=(Source(per_model, AccuracyMatch("acc", "dense"), ours="({why})"),),
                        caveat="; after a short run")
    measured, missing = evaluate([declared], EMPTY)
    assert (measured.claim, measured.verdict, measured.note) == ("near dense (wide_mlp)", "reproduced", "")
    assert (missing.claim, missing.ours, missing.verdict, missing.note) == \
        ("near dense (resnet20)", "no runs", "not measured", "needs redsync runs of this model")


def test_a_caveat_follows_any_verdict_short_of_reproduced():
    declared = Declared(claim="c", paper="p", caveat="; after a short run",
                        sources=(Source(lambda ev: {"f": [True, False]}, Share("f"), ours="x", note="n"),))
    assert evaluate([declared], EMPTY)[0].note == "n; after a short run"


def test_a_consistency_check_is_marked_and_judged_apart():
    declared = Declared(claim="bytes as the formula", paper="cost model", check=True,
                        sources=(Source(lambda ev: {"holds": False}, Consistency("holds"), ours="1 vs 2"),))
    [row] = evaluate([declared], EMPTY)
    assert row.claim == CHECK_PREFIX + "bytes as the formula" and row.verdict == "inconsistent" and row.is_check


def test_seeds_come_from_the_measurement_or_from_the_means_in_ours():
    given = Declared(claim="c", paper="p", sources=(Source(lambda ev: {"a": 0.0, "seeds": "n=2-3"}, Within("a", 1.0),
                                                           ours="{a}"),))
    read = Declared(claim="c", paper="p", sources=(Source(lambda ev: {"a": 0.0}, Within("a", 1.0),
                                                          ours="1.0 ± 0.1 (n=3) vs 2 ± 0 (n=2)"),))
    assert [c.seeds for c in evaluate([given, read], EMPTY)] == ["n=2-3", "n=2-3"]
    assert seeds_label([3, 3]) == "n=3" and seeds_label([1, 3, 2]) == "n=1-3" and seeds_label([]) == ""
    assert Claim("c", "p", "no runs", "not measured", seeds="n=3").seeds == ""


def test_evidence_builds_a_shared_table_once(tmp_path):
    built = []

    def table(ev):
        built.append(1)
        return len(ev.runs)

    ev = Evidence(pd.DataFrame({"a": [1, 2]}), pd.DataFrame(), tmp_path)
    assert ev.table(table) == ev.table(table) == 2 and built == [1]


def test_evidence_reads_benchmarks_from_its_own_folder_only(tmp_path, monkeypatch):
    """The working directory's reports/bench is never read: a report sees its own out dir's files,
    and evidence without an out dir sees none (a test's hand-made tables stay hermetic)."""
    (tmp_path / "reports/bench").mkdir(parents=True)
    (tmp_path / "reports/bench/wire.json").write_text('{"rows": []}')
    monkeypatch.chdir(tmp_path)
    assert Evidence(pd.DataFrame(), pd.DataFrame()).bench("wire") is None
    assert Evidence(pd.DataFrame(), pd.DataFrame(), tmp_path / "elsewhere").bench("wire") is None
    found = Evidence(pd.DataFrame(), pd.DataFrame(), tmp_path / "reports").bench("wire")
    assert found == {"rows": [], "file": str(tmp_path / "reports/bench/wire.json")}


def test_not_testable_rows_say_what_would_test_them_and_caveats_follow_undecided_verdicts():
    declared = Declared(claim="c", paper="p", to_test="the {scale} scale", caveat="; short runs",
                        sources=(Source(lambda ev: {"scale": "paper"}, NotTestable("needs a cluster"), ours="x",
                                        note="{why}"),))
    [row] = evaluate([declared], EMPTY)
    assert (row.verdict, row.note) == ("not testable at this scale", "needs a cluster; to test it: the paper scale")
    gains = Declared(claim="c", paper="p", caveat="; short runs", to_test="longer runs",
                     sources=(Source(lambda ev: {"g": [1.0, -0.2, 0.8]}, Gain("g"), ours="x", note="n"),))
    assert evaluate([gains], EMPTY)[0].note == "n; short runs"  # inconclusive: the caveat, not to_test


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_paper_declares_its_claims_and_they_evaluate_without_runs(notebook, tmp_path):
    """With no run and no benchmark every claim is 'not measured', and says so row by row; only a
    claim no run at this scale can test (a 32-GPU cluster's) says that instead, and what would."""
    module = declarations(notebook.stem)
    assert module.CLAIMS and module.METRICS
    empty = Evidence(pd.DataFrame(columns=["run_id", "name", "method", "seed", "workers", "network"]),
                     pd.DataFrame(columns=["run_id", "name", "method", "seed", "metric", "step", "value"]),
                     tmp_path)
    rows = evaluate(module.CLAIMS, empty)
    assert rows and {r.verdict for r in rows} <= {"not measured", "not testable at this scale"}, rows
    assert all(r.claim and r.paper and r.ours for r in rows)
    assert all("to test it: " in r.note for r in rows if r.verdict == "not testable at this scale")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_benchmark_a_paper_reads_is_declared(notebook):
    """The workflow builds a report after the benchmark results its claims module declares
    (``BENCH``): every ``ev.bench("name")`` of the module, and of the modules its claims' measures
    come from (the K-step report's descendants), is among them (an f-string's fixed prefix among
    their beginnings), and every declared one is read."""
    module = declarations(notebook.stem)
    declared = list(getattr(module, "BENCH", []))
    files = {module.__file__} | {inspect.getsourcefile(source.measure) for claim in module.CLAIMS
                                 for source in claim.sources}
    read = re.findall(r'\.bench\((f?)"([^"{]+)', "\n".join(Path(f).read_text() for f in sorted(files)))
    for fstring, name in read:
        assert any(d == name or (fstring and d.startswith(name)) for d in declared), (name, declared)
    for d in declared:
        assert any(d == name or (fstring and d.startswith(name)) for fstring, name in read), (d, read)


def test_an_unknown_paper_is_named():
    with pytest.raises(ValueError, match="paper 'nosuch' declares no claims"):
        declarations("nosuch")


# ---- the notebooks draw figures; the verdicts are declared ----------------------------------------
RULE_NAMES = {"Within", "Reaches", "Below", "AccuracyMatch", "SpeedTrend", "AllOf", "Share", "Conditions",
              "ClosesGap", "Largest", "Gain", "Better", "Consistency", "Unmeasurable", "NotTestable",
              "accuracy_match", "faster_on_slow_links", "difference", "seeds_to_decide", "Claim", "Declared",
              "Source", "NotMeasured", "check", "evaluate", "write_claims"}
VERDICT_WORDS = re.compile(r"verdict\w*\s*[:+]?=|[\"']verdict[\"']\s*:|[\"'](reproduced|partly reproduced|"
                           r"contradicted|inconclusive|not testable at this (scale|budget)|not measured|consistent|"
                           r"inconsistent)[\"']")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_hold_no_verdict_logic(notebook):
    text = notebook.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))  # markdown cells out
    found = [m.group(0) for m in VERDICT_WORDS.finditer(code)]
    assert not found, f"{notebook.name} decides verdicts itself: {found}"
    called = {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
              for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Call)
              and isinstance(node.func, (ast.Name, ast.Attribute))}
    assert not called & RULE_NAMES, f"{notebook.name} calls {sorted(called & RULE_NAMES)}"
    assert "show_claims(rep)" in text  # the declared claims, evaluated by the prologue


def test_the_grep_finds_a_verdict_ladder():
    ladder = 'if gap < 1:\n    verdict = "reproduced"\nclaims.append({"verdict": v})\nv = accuracy_match(a, b)\n'
    assert len(VERDICT_WORDS.findall(ladder)) == 3
    assert VERDICT_WORDS.search('label = "not testable at this budget"')
    assert "accuracy_match" in RULE_NAMES


# ---- reports read MLflow and the benchmark files only ---------------------------------------------
BELOW_MLFLOW = ("commlab.core", "commlab.models", "commlab.data", "commlab.registry", "commlab.loop",
                "commlab.algorithms", "commlab.compress", "torch")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", NOTEBOOKS + sorted((ROOT / "src/commlab/report").glob("*.py")),
                         ids=lambda p: p.name)
def test_reports_import_nothing_below_mlflow(path):
    below = sorted(n for n in _imports(path) if n.startswith(BELOW_MLFLOW))
    assert not below, f"{path.name} imports {below}"
    text = path.read_text()
    assert "meta.json" not in text and "build_model" not in text and "data_dir" not in text, path.name
