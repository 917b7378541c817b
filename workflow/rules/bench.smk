# The performance benchmark suite (emulated networks, cost model): `snakemake --cores 2 bench`
# builds reports/bench/<name>.json and .md for every benchmark of the config's `bench: suite`, and
# the throughput benchmark once more per model of `bench: models`. Each job takes all cores so
# that timings are not disturbed by other jobs of the workflow. Arguments per benchmark come from
# the workflow config (`bench: {args: {NAME: "..."}}`): config/config.yaml sizes them for the
# default run, which measures the benchmarks that the papers' speed and volume claims read before
# building those papers' reports (`bench: {speed_claims: auto}`: where root and iproute2 allow
# emulated links; each claims module declares what it reads as `BENCH`).


rule bench:
    """Every benchmark of the suite, and throughput per model."""
    input:
        expand("reports/bench/{name}.json", name=BENCH_SUITE),
        expand("reports/bench/throughput_{model}.json", model=BENCH_MODELS),
    localrule: True


rule bench_measure:
    """One benchmark of the suite (`commlab bench NAME`), at the config's arguments."""
    input:
        # the prepared datasets first: a benchmark trains on Fashion-MNIST when it is there
        data=data_markers(),
    output:
        json="reports/bench/{name}.json",
        md="reports/bench/{name}.md",
    log:
        "logs/bench/{name}.log",
    wildcard_constraints:
        name="|".join(MEASURED_BENCH),
    priority: lambda wildcards: bench_priority(wildcards.name)
    conda:
        "../envs/commlab.yaml"
    threads: lambda wildcards: local_cores(default=1)
    params:
        extra=lambda wildcards: BENCH_ARGS.get(wildcards.name, ""),
    shell:
        "python -m commlab bench --json {output.json} {wildcards.name} {params.extra} > {log} 2>&1"


rule bench_scaling:
    """The cost model, fitted to the throughput benchmark's profiles and extrapolated."""
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
    """The throughput benchmark on one more model."""
    input:
        data=data_markers(),
    output:
        json="reports/bench/throughput_{model}.json",
        md="reports/bench/throughput_{model}.md",
    log:
        "logs/bench/throughput_{model}.log",
    wildcard_constraints:
        model="[a-z][a-z0-9_]*",
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


rule bench_wire:
    """Accounted bytes beside the bytes on the emulated links, for every method: the
    throughput benchmark's emulated runs, and a short run of each method they lack
    (docs/network.md, section 6)."""
    input:
        throughput="reports/bench/throughput.json",
        models=expand("reports/bench/throughput_{model}.json", model=BENCH_MODELS),
        data=data_markers(),
    output:
        json="reports/bench/wire.json",
        md="reports/bench/wire.md",
    log:
        "logs/bench/wire.log",
    priority: bench_priority("wire")
    conda:
        "../envs/commlab.yaml"
    threads: lambda wildcards: local_cores(default=1)
    params:
        extra=BENCH_ARGS.get("wire", "--max-steps 4 --log-every 2"),
    shell:
        "python -m commlab bench --json {output.json} wire --from {input.throughput} {input.models} "
        "--run-missing {params.extra} > {log} 2>&1"
