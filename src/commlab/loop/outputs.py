"""What a finished run leaves behind (rank 0): the resolved config, the golden loss curve, the
MLflow artifacts and the sentinel, the run record Snakemake waits for.

The resolved config goes to ``resolved_config.yaml``: the run directory's ``config.yaml`` is the
workflow's input of this very run and is never rewritten by it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from commlab.config import dump_config

RESOLVED_CONFIG = "resolved_config.yaml"
SENTINEL_FINAL_KEYS = ("train_loss", "test_loss", "test_accuracy", "test_perplexity", "test_mlm_accuracy",
                       "bytes_sent", "reductions_global", "wall_seconds")


def write_outputs(config: dict, out: Path, sentinel, logger, final: dict, golden: list, data_meta: dict,
                  ckpt_dir: Path, world_size: int) -> None:
    from commlab.provenance import git_commit

    out.mkdir(parents=True, exist_ok=True)
    dump_config(config, out / RESOLVED_CONFIG)
    if config.get("golden"):
        Path(config["golden"]).parent.mkdir(parents=True, exist_ok=True)
        Path(config["golden"]).write_text(json.dumps(golden, indent=1) + "\n")
    logger.log_artifact(out / RESOLVED_CONFIG)
    if config["tracking"].get("log_checkpoints"):
        logger.log_artifact(ckpt_dir / "latest.json", "checkpoint")
        for f in sorted(ckpt_dir.glob("step_*/rank0.pt")):
            logger.log_artifact(f, "checkpoint")
    logger.log_artifact(out / "train.log")
    record = {
        "run_id": logger.run_id,
        "experiment": config["tracking"].get("experiment") or config["paper"],
        "paper": config["paper"], "name": config.get("name") or config["method"],
        "method": config["method"], "seed": config["seed"], "workers": world_size,
        "git_commit": git_commit(), "data_hash": data_meta.get("content_hash"),
        "final": {k: final[k] for k in SENTINEL_FINAL_KEYS if k in final},
    }
    target = Path(sentinel) if sentinel else out / "sentinel.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, target)
