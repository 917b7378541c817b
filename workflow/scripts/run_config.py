"""One run's config file: its resolved grid entry as YAML (workflow/rules/train.smk, rule run_config).

A config written anew means the run trains again from scratch: its old checkpoints and its
completion marker go first. Run by Snakemake's ``script:`` directive, which provides ``snakemake``
(input, output, params, log) to this file.
"""

import json
import shutil
import sys
from pathlib import Path

import yaml

sys.stderr = open(snakemake.log[0], "w")  # noqa: F821 - provided by Snakemake

shutil.rmtree(snakemake.params.checkpoints, ignore_errors=True)  # noqa: F821
Path(snakemake.params.complete).unlink(missing_ok=True)  # noqa: F821
run = json.loads(snakemake.params.run)  # noqa: F821 - a JSON string: a changed config reruns the rule
Path(snakemake.output.config).write_text(yaml.safe_dump(run, sort_keys=False))  # noqa: F821
