"""Reports: each paper's notebook executed against MLflow, exported to HTML, then the index.

`commlab report` (src/commlab/report/build.py) turns workflow/notebooks/<paper>.py into
reports/<paper>/report.html and claims.json; the index gathers every claims table. The rules
depend on the runs' sentinels (never on mlflow.db, which every job changes) and on the benchmark
results present in reports/bench/ (the speed claims on emulated links).
"""


rule paper_report:
    """A paper's report from its finished runs."""
    input:
        sentinels=lambda wildcards: paper_sentinels(wildcards.paper),
        notebook="workflow/notebooks/{paper}.py",
        # Speed claims read the benchmarks' results when `snakemake bench` has made them: a new
        # benchmark result rebuilds the reports, but the reports never wait for one.
        bench=lambda wildcards: sorted(
            str(p) for p in Path("reports/bench").glob("*.json")
        ),
    output:
        html=report(
            "reports/{paper}/report.html",
            caption="../report/paper.rst",
            category="Paper reports",
            labels={"paper": "{paper}"},
        ),
        notebook="reports/{paper}/report.ipynb",
        claims="reports/{paper}/claims.json",
    log:
        "logs/report/{paper}.log",
    priority: 1000  # before any training job (common.smk: paper_priority)
    localrule: True
    conda:
        "../envs/commlab.yaml"
    params:
        out=lambda wildcards, output: Path(output.html).parent.parent,
        notebooks=lambda wildcards, input: Path(input.notebook).parent,
        results=RESULTS,
    shell:
        "python -m commlab report --paper {wildcards.paper} --out {params.out} "
        "--notebooks {params.notebooks} --results {params.results} > {log} 2>&1"


rule report_index:
    """reports/index.html: a link to every paper's report and all claims tables in one."""
    input:
        claims=expand("reports/{paper}/claims.json", paper=config["papers"]),
        html=expand("reports/{paper}/report.html", paper=config["papers"]),
    output:
        report("reports/index.html", caption="../report/index.rst", category="Index"),
    log:
        "logs/report/index.log",
    localrule: True
    conda:
        "../envs/commlab.yaml"
    params:
        out=lambda wildcards, output: Path(output[0]).parent,
    shell:
        "python -m commlab report --index --out {params.out} > {log} 2>&1"


# Named targets per paper: `snakemake train_<paper>` (its runs), `snakemake report_<paper>`.
for _paper in config["papers"]:

    rule:
        name:
            f"train_{_paper}"
        input:
            paper_sentinels(_paper),
        localrule: True

    rule:
        name:
            f"report_{_paper}"
        input:
            f"reports/{_paper}/report.html",
        localrule: True
