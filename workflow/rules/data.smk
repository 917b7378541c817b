"""Data: Snakemake asks DVC for each prepared dataset the runs read (dvc.yaml, params.yaml).

The data rule runs `dvc repro <dataset>` (a no-op when dvc.lock matches, a checkout from the
cache when only the files are missing) and `dvc push` to the default remote. Two DVC processes
fail on the repository lock, so every DVC job holds the `dvc` resource, of which the default
profile grants 1.
"""


rule data:
    """Every dataset the configured grids read, prepared and pushed."""
    input:
        data_markers(),
    localrule: True


rule prepare_data:
    """One dataset through its DVC stage; runs again when the stage or its params change."""
    output:
        meta=f"{DATA_DIR}/{{dataset}}/meta.json",
    log:
        "logs/data/{dataset}.log",
    localrule: True
    conda:
        "../envs/commlab.yaml"
    resources:
        dvc=1,
    params:
        stage=dvc_stage,
    shell:
        "(dvc repro {wildcards.dataset} && dvc push {wildcards.dataset}) > {log} 2>&1"
