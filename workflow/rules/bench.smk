# The performance benchmark suite (emulated networks, cost model): `snakemake --cores 2 bench`
# builds reports/bench/<name>.json and .md for every benchmark. Each job takes all cores so that
# timings are not disturbed by other jobs of the workflow. Arguments per benchmark come from the
# workflow config (`bench: {args: {NAME: "..."}}`): config/config.yaml sizes them for the default
# run, which measures the benchmarks that the papers' speed claims read before building those
# papers' reports (`bench: {speed_claims: auto}`: where root and iproute2 allow emulated links).
from pathlib import Path

BENCH_NAMES = ["collectives", "throughput", "time_to_accuracy", "scaling"] + (
    ["selection"] if Path("src/commlab/bench/selection.py").exists() else []
) + (["syncs"] if Path("src/commlab/bench/syncs.py").exists() else [])


BENCH_ARGS = config.get("bench", {}).get("args", {})


rule bench:
    input:
        expand("reports/bench/{name}.json", name=BENCH_NAMES),
        expand("reports/bench/throughput_{model}.json", model=BENCH_MODELS),


rule bench_measure:
    input:
        # the prepared datasets first: a benchmark trains on Fashion-MNIST when it is there
        data=data_markers(),
    output:
        json="reports/bench/{name}.json",
        md="reports/bench/{name}.md",
    log:
        "logs/bench/{name}.log",
    wildcard_constraints:
        name="|".join(n for n in BENCH_NAMES if n != "scaling"),
    priority: lambda wildcards: bench_priority(wildcards.name)
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
        data=data_markers(),
    output:
        json="reports/bench/scaling.json",
        md="reports/bench/scaling.md",
    log:
        "logs/bench/scaling.log",
    priority: bench_priority("scaling")
    conda:
        "../envs/commlab.yaml"
    threads: lambda wildcards: local_cores(default=1)
    params:
        extra=BENCH_ARGS.get("scaling", ""),
    shell:
        "python -m commlab bench --json {output.json} scaling --profiles {input.profiles} {params.extra} > {log} 2>&1"


rule bench_throughput_model:
    input:
        data=data_markers(),
    output:
        json="reports/bench/throughput_{model}.json",
        md="reports/bench/throughput_{model}.md",
    log:
        "logs/bench/throughput_{model}.log",
    wildcard_constraints:
        model="|".join(BENCH_MODELS),
    priority: lambda wildcards: bench_priority(f"throughput_{wildcards.model}")
    conda:
        "../envs/commlab.yaml"
    threads: lambda wildcards: local_cores(default=1)
    params:
        extra=BENCH_ARGS.get(
            "throughput_models", "--methods ssgd redsync dgc --networks loopback 100"
        ),
    shell:
        "python -m commlab bench --json {output.json} throughput --model {wildcards.model} "
        "{params.extra} > {log} 2>&1"
