"""The SLURM profile, exercised without SLURM (docs/cluster.md, sections 1-2): fake `sbatch`, `srun`, `sacct`,
`squeue`, `scontrol`, `sinfo`, `sacctmgr`, `sshare` and `scancel` on PATH record every call.

One training run of a 2-node NCCL grid goes through the whole chain: Snakemake with
workflow/profiles/slurm submits it with `sbatch` (resources and site settings from the
profile asserted), the fake `sbatch` runs the submitted job script as SLURM would (the
jobstep executor's `srun` and the rule's shell inside), and `commlab launch` starts one
torchrun per node with `srun` and c10d rendezvous at the allocation's first node. The fake
`srun` records that last command and writes the sentinel instead of training (no GPUs here).
Not exercised: a real scheduler (queueing, the allocation itself, signals from slurmctld) and
NCCL training.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "workflow" / "profiles" / "slurm"

FAKE = r'''#!{python}
"""Fake SLURM command (test_slurm_profile.py): records the call in $FAKE_SLURM_DIR/calls.jsonl."""
import json, os, subprocess, sys
from pathlib import Path

tool, argv = Path(sys.argv[0]).name, sys.argv[1:]
rec = Path(os.environ["FAKE_SLURM_DIR"])
with open(rec / "calls.jsonl", "a") as f:
    f.write(json.dumps({{"tool": tool, "argv": argv}}) + "\n")
jobs = sorted(rec.glob("job*.json"))


def command(args):
    """The command after srun's options."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 1
    return args[i:]


if tool == "sbatch":
    job_id = str(1001 + len(jobs))
    wrap = next(a.split("=", 1)[1] for a in argv if a.startswith("--wrap="))
    env = {{**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "node[001-002]"}}
    rc = subprocess.call(["sh", "-c", wrap], env=env, stdout=sys.stderr)  # run the job script, as SLURM would
    (rec / f"job{{job_id}}.json").write_text(json.dumps({{"argv": argv, "rc": rc}}))
    print(job_id)
elif tool in ("sacct", "squeue"):
    if "--format=Reason" not in argv:
        for j in jobs:
            print(f"{{j.stem[3:]}}|{{'COMPLETED' if json.loads(j.read_text())['rc'] == 0 else 'FAILED'}}")
elif tool == "srun":
    cmd = command(argv)
    if "torch.distributed.run" in cmd:  # the workers: record, write the sentinel instead of training
        assert "SLURM_NNODES" not in os.environ, "the step's variables reached srun"
        sentinel = cmd[cmd.index("--sentinel") + 1]
        Path(sentinel).write_text(json.dumps({{"run_id": None, "fake": True}}))
        sys.exit(0)
    # slurmstepd gives the task the variables of its step (one node)
    env = {{**os.environ, "SLURM_JOB_NODELIST": "node001", "SLURM_NNODES": "1", "SLURM_NTASKS": "1"}}
    sys.exit(subprocess.call(cmd, env=env))
elif tool == "scontrol" and argv[:2] == ["show", "job"]:
    print(f"JobId={{argv[-1]}} JobName=x NodeList=node[001-002] NumNodes=2")
elif tool == "scontrol" and argv[:2] == ["show", "hostnames"]:
    print("\n".join(["node001", "node002"] if argv[2] == "node[001-002]" else [argv[2]]))
elif tool == "scontrol" and argv[:2] == ["show", "config"]:
    print("MinJobAge               = 300 sec")
elif tool == "sinfo":
    print("PARTITION\ngpu*")
'''
TOOLS = ["sbatch", "srun", "sacct", "squeue", "scontrol", "sinfo", "sacctmgr", "sshare", "scancel"]


def _project_copy(tmp: Path) -> Path:
    """The workflow files in a scratch directory (results, logs and MLflow stay there)."""
    proj = tmp / "proj"
    proj.mkdir()
    for name in ("Snakefile", "workflow", "config", "dvc.yaml", "params.yaml"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, proj / name)
    # A 2-node NCCL grid on generated data (no DVC job): the resources a cluster run asks for.
    (proj / "cluster_test.yaml").write_text(yaml.safe_dump({
        "scale": "smoke", "papers": ["baseline"],
        "defaults": {"dataset": "synthetic", "model": "mlp", "backend": "nccl", "nodes": 2},
    }))
    return proj


def _fake_slurm(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    script = bin_dir / "fake_slurm"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(0o755)
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(script)
    return bin_dir


@pytest.mark.skipif(not (ROOT / "Snakefile").exists(), reason="no Snakefile")
def test_profile_submits_gpu_jobs_that_launch_one_torchrun_per_node(tmp_path):
    proj, bin_dir, rec = _project_copy(tmp_path), _fake_slurm(tmp_path), tmp_path / "rec"
    rec.mkdir()
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]),
           "FAKE_SLURM_DIR": str(rec), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    sentinel = "results/smoke/baseline/ssgd/seed0/sentinel.json"
    site = {"slurm_account": "abc123", "slurm_partition": "gpu"}
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--workflow-profile", str(PROFILE), "--configfile", "cluster_test.yaml",
         "--default-resources", *(f"{k}={v}" for k, v in site.items()),
         "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
         "--latency-wait", "1", "--retries", "0", sentinel],
        cwd=proj, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    calls = [json.loads(line) for line in (rec / "calls.jsonl").read_text().splitlines()]

    # One sbatch per training run, with the site settings and the run's resources: 2 nodes,
    # one GPU per worker on each node (smoke grid: 2 workers per node), cores, memory, time limit,
    # and SIGTERM before the limit so that the run checkpoints.
    sbatch = [c["argv"] for c in calls if c["tool"] == "sbatch"]
    assert len(sbatch) == 1
    args = sbatch[0]
    assert args[args.index("-A") + 1] == site["slurm_account"]
    assert args[args.index("-p") + 1] == site["slurm_partition"]
    assert "--nodes=2" in args and "--gres=gpu:2" in args and "--cpus-per-task=2" in args
    assert not any(a.startswith(("--gpus", "--ntasks")) for a in args)  # sbatch: one task per node
    assert args[args.index("--mem") + 1] == "4000" and args[args.index("-t") + 1] == "60"
    assert "--signal=TERM@300" in args
    wrap = next(a for a in args if a.startswith("--wrap="))
    assert "--executor slurm-jobstep" in wrap and "train:paper=baseline,name=ssgd,seed=0" in wrap

    # Inside the job: the jobstep's srun, then `commlab launch` starting one torchrun per node
    # (srun --ntasks-per-node=1) meeting through c10d at the allocation's first node.
    srun = [c["argv"] for c in calls if c["tool"] == "srun"]
    assert len(srun) == 2
    assert "--nodes=2" in srun[0] and not any(a.startswith("--gpus") for a in srun[0])
    workers = srun[1]
    assert workers[:5] == ["--overlap", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "torch.distributed.run" in workers and "--nnodes=2" in workers
    assert "--nproc-per-node=2" in workers and "--rdzv-backend=c10d" in workers
    assert "--rdzv-endpoint=node001:29501" in workers  # 29500 + job id 1001 % 1000
    assert " ".join(workers).endswith(f"-m commlab.loop --config results/smoke/baseline/ssgd/seed0/config.yaml "
                                      f"--sentinel {sentinel}")
    assert (proj / sentinel).exists() and (proj / "results/smoke/baseline/ssgd/seed0/.complete").exists()
    # The status of submitted jobs is polled with sacct (or squeue); nothing is cancelled.
    assert any(c["tool"] in ("sacct", "squeue") for c in calls)
    assert not any(c["tool"] == "scancel" for c in calls)


def test_profile_requires_a_tracking_server_and_keeps_site_settings(tmp_path):
    """Without MLFLOW_TRACKING_URI the profile stops before any job: jobs on other nodes must not
    fall back to a SQLite file in the working directory. Account and partition appear in no rule
    (site settings, per invocation or in the profile)."""
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())
    assert profile["executor"] == "slurm" and "MLFLOW_TRACKING_URI" in profile["envvars"]
    # no placeholder account: the plugin would reject it; unset, it takes the user's default
    assert not {"slurm_account", "slurm_partition"} & set(profile["default-resources"])
    for rule_file in (ROOT / "workflow" / "rules").glob("*.smk"):
        text = rule_file.read_text()
        assert "slurm_account" not in text and "slurm_partition" not in text, rule_file
    if not (ROOT / "Snakefile").exists():
        pytest.skip("no Snakefile")
    proj = _project_copy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run([sys.executable, "-m", "snakemake", "--workflow-profile", str(PROFILE), "-n",
                          "--configfile", "cluster_test.yaml"], cwd=proj, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0
    assert "MLFLOW_TRACKING_URI" in out.stdout + out.stderr
