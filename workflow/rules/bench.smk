# The performance benchmark suite (emulated networks, cost model): `snakemake --cores 2 bench`
# builds reports/bench/<name>.json and .md for every benchmark. Each job takes all cores so that
# timings are not disturbed by other jobs of the workflow. Extra arguments per benchmark come
# from the workflow config, e.g. `bench: {args: {throughput: "--repeats 3"}}`.
from pathlib import Path

BENCH_NAMES = ["collectives", "throughput", "time_to_accuracy", "scaling"] + (
    ["selection"] if Path("src/commlab/bench/selection.py").exists() else []
)


BENCH_ARGS = config.get("bench", {}).get("args", {})


rule bench:
    input:
        expand("reports/bench/{name}.json", name=BENCH_NAMES),


rule bench_measure:
    output:
        json="reports/bench/{name}.json",
        md="reports/bench/{name}.md",
    log:
        "logs/bench/{name}.log",
    wildcard_constraints:
        name="|".join(n for n in BENCH_NAMES if n != "scaling"),
    conda:
        "../envs/commlab.yaml"
    threads: lambda wildcards: local_cores(default=1)
    params:
        extra=lambda wildcards: BENCH_ARGS.get(wildcards.name, ""),
    shell:
        "python -m commlab bench --json {output.json} {wildcards.name} {params.extra} > {log} 2>&1"


rule bench_scaling:
    input:
        profiles="reports/bench/throughput.json",
    output:
        json="reports/bench/scaling.json",
        md="reports/bench/scaling.md",
    log:
        "logs/bench/scaling.log",
    conda:
        "../envs/commlab.yaml"
    threads: lambda wildcards: local_cores(default=1)
    params:
        extra=BENCH_ARGS.get("scaling", ""),
    shell:
        "python -m commlab bench --json {output.json} scaling --profiles {input.profiles} {params.extra} > {log} 2>&1"
