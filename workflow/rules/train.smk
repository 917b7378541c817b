"""Training: one job per (paper, run name, seed) of the resolved grids (workflow/rules/common.smk).

Each job writes its run config (workflow/scripts/run_config.py), then `commlab launch` validates
it and starts torchrun with the run's workers; rank 0 logs to MLflow and writes the sentinel (run
id, git commit, data hash).
A job killed mid-run resumes from its checkpoints when rerun (--rerun-incomplete); a job that
had finished and runs again (changed config or data, --forcerun) starts from scratch.
"""


# A local run forks every job's launcher from one warm process (common.smk: LaunchServer).
onstart:
    LAUNCH_SERVER.start()


onsuccess:
    LAUNCH_SERVER.stop()


onerror:
    LAUNCH_SERVER.stop()


rule mlflow_init:
    """Create every paper's MLflow experiment once: parallel jobs creating the store race."""
    output:
        MLFLOW_MARKER,
    log:
        "logs/mlflow_init.log",
    localrule: True
    conda:
        "../envs/commlab.yaml"
    params:
        papers=config["papers"],
    shell:
        "python -m commlab mlflow-init {params.papers} --marker {output} > {log} 2>&1"


rule run_config:
    """One run's resolved config; rewritten (and the run retrained from scratch, its old
    checkpoints removed) when the grid changes it."""
    output:
        config=f"{RUN_DIR}/config.yaml",
    log:
        f"logs/config/{SCALE}/{{paper}}/{{name}}/seed{{seed}}.log",
    wildcard_constraints:
        paper="|".join(config["papers"]),
        name=r"[^/]+",
        seed=r"\d+",
    localrule: True
    conda:
        "../envs/commlab.yaml"
    params:
        run=run_config_json,
        checkpoints=checkpoints_dir,
        complete=complete_marker,
    script:
        "../scripts/run_config.py"


rule train:
    """One run under torchrun (several nodes through srun inside a SLURM allocation)."""
    input:
        config=f"{RUN_DIR}/config.yaml",
        data=train_data,
        # Adding a paper re-creates the marker; that must not retrain the other papers' runs.
        mlflow=ancient(MLFLOW_MARKER),
    output:
        sentinel=f"{RUN_DIR}/sentinel.json",
    log:
        f"logs/train/{SCALE}/{{paper}}/{{name}}/seed{{seed}}.log",
    benchmark:
        f"logs/benchmarks/train/{SCALE}/{{paper}}/{{name}}/seed{{seed}}.tsv"
    wildcard_constraints:
        paper="|".join(config["papers"]),
        name=r"[^/]+",
        seed=r"\d+",
    priority: paper_priority
    conda:
        "../envs/commlab.yaml"
    threads: train_threads
    resources:
        nodes=lambda wildcards: run_config(wildcards)["nodes"],
        gres=train_gres,
        tasks=train_tasks,
        cpus_per_task=train_cpus,
        mem_mb=train_mem_mb,
        runtime=config["resources"]["runtime"],
    params:
        checkpoints=checkpoints_dir,
        complete=complete_marker,
        launch_server=LAUNCH_SOCKET,  # common.smk: LaunchServer
    shell:
        "if [ -e {params.complete} ]; then rm -rf {params.checkpoints} {params.complete}; fi; "
        "COMMLAB_LAUNCH_SERVER={params.launch_server} "
        "python -m commlab launch --config {input.config} --sentinel {output.sentinel} > {log} 2>&1 "
        "&& touch {params.complete}"
