"""Data: Snakemake asks DVC for each prepared dataset the runs read (dvc.yaml, params.yaml).

The data rule's inputs are its DVC stage's dependencies from dvc.yaml (the preparation code and
the raw files, listed by commlab.data.stages), so Snakemake schedules it whenever `dvc status` may
report the stage changed. It runs `dvc repro <dataset>`: a no-op when dvc.lock matches (dvc.lock
is left as committed), a checkout from the cache when only the files are missing, the stage itself
when code, raw data or params changed (dvc.lock then records the new hashes, to be committed with
that change). It never pushes: pushing to the remote is a choice (`dvc push`), not a side effect of
a run. Two DVC processes fail on the repository lock, so every DVC job holds the `dvc` resource,
of which the default profile grants 1.
"""

from commlab.data.stages import stage_files


rule data:
    """Every dataset the configured grids read, prepared."""
    input:
        data_markers(),
    localrule: True


rule prepare_data:
    """One dataset through its DVC stage; runs again when the stage's code, raw data or params change."""
    input:
        lambda wildcards: stage_files(
            wildcards.dataset, DVC_STAGES[wildcards.dataset], DVC_PARAMS
        ),
    output:
        meta=f"{DATA_DIR}/{{dataset}}/meta.json",
    log:
        "logs/data/{dataset}.log",
    wildcard_constraints:
        dataset="|".join(DVC_STAGES),
    localrule: True
    conda:
        "../envs/commlab.yaml"
    resources:
        dvc=1,
    params:
        stage=dvc_stage,
    # The touch: when DVC finds nothing changed (an input's time changed, not its content, e.g.
    # after a checkout), it leaves meta.json as it was, older than the inputs; without the touch
    # every later run would schedule this job again.
    shell:
        "dvc repro {wildcards.dataset} > {log} 2>&1 && touch {output.meta}"
