"""commlab: DVC-versioned data -> one torchrun job per (paper, run, seed) -> MLflow -> reports.

    snakemake --cores 2                                   # laptop scale (config/config.yaml)
    snakemake --cores 2 --configfile config/smoke.yaml    # smoke scale: a few minutes
    snakemake data | train_<paper> | report_<paper>       # named targets
    snakemake --cores 2 bench                             # the benchmark suite (reports/bench/)
    snakemake --report reports/snakemake_report.html      # bundle the reports

The config is validated (workflow/schemas/config.schema.yaml) and every paper's grid resolved in
workflow/rules/common.smk before any job runs; the rules live in workflow/rules/.
"""

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


rule all:
    """Everything (the default target): data, every paper's runs and report, and the index."""
    input:
        "reports/index.html",
    localrule: True


include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"
