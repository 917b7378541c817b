"""Reports: each paper's notebook executed against MLflow, exported to HTML, then the index.

`commlab report` (src/commlab/report/build.py) turns workflow/notebooks/<paper>.py into
reports/<paper>/report.html, claims.json and runs.csv, from the runs of the configured scale
(`scale` in the config: runs carry a `scale` tag); the index gathers every claims table and draws
every paper's runs on the cross-paper charts. The rules depend on the runs' sentinels (never on
mlflow.db, which every job changes) and on the benchmark results of the paper's speed claims
(measured by the run where emulated links are available, or present in reports/bench/).
"""


rule paper_report:
    """A paper's report from its finished runs."""
    input:
        sentinels=lambda wildcards: paper_sentinels(wildcards.paper),
        notebook="workflow/notebooks/{paper}.py",
        # Speed claims read the benchmarks' results: the ones this run measures for the paper
        # (bench.smk: speed_bench), and any other already in reports/bench/ (a new result
        # rebuilds the reports).
        bench=lambda wildcards: sorted(
            set(speed_bench(wildcards.paper))
            | {str(p) for p in Path("reports/bench").glob("*.json")}
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
        runs="reports/{paper}/runs.csv",
    log:
        "logs/report/{paper}.log",
    benchmark:
        "logs/benchmarks/report/{paper}.tsv"
    wildcard_constraints:
        paper="|".join(config["papers"]),
    priority: 1000  # before any training job (common.smk: paper_priority)
    localrule: True
    conda:
        "../envs/commlab.yaml"
    params:
        out=lambda wildcards, output: Path(output.html).parent.parent,
        notebooks=lambda wildcards, input: Path(input.notebook).parent,
        results=RESULTS,
        scale=config["scale"],
    shell:
        "python -m commlab report --paper {wildcards.paper} --out {params.out} "
        "--notebooks {params.notebooks} --results {params.results} --scale {params.scale} > {log} 2>&1"


rule report_index:
    """reports/index.html: a link to every paper's report, all claims tables in one, and every
    method of every paper on charts of accuracy against bytes sent and against time."""
    input:
        claims=expand("reports/{paper}/claims.json", paper=config["papers"]),
        html=expand("reports/{paper}/report.html", paper=config["papers"]),
        runs=expand("reports/{paper}/runs.csv", paper=config["papers"]),
    output:
        report("reports/index.html", caption="../report/index.rst", category="Index"),
    log:
        "logs/report/index.log",
    benchmark:
        "logs/benchmarks/report/index.tsv"
    localrule: True
    conda:
        "../envs/commlab.yaml"
    params:
        out=lambda wildcards, output: Path(output[0]).parent,
        results=RESULTS,
    shell:
        "python -m commlab report --index --out {params.out} --results {params.results} "
        "--snakemake-log latest > {log} 2>&1"


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
