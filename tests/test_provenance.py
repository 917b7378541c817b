"""Where a result comes from (commlab.provenance): the commit, ``-dirty`` for changed tracked files
only, MLflow's source tags with and without a branch or a remote, nothing but the program without
git, a bounded git, and a benchmark's environment record. Each against git's own answer, asked here
in a scratch repository or in this checkout."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from commlab import provenance

ROOT = Path(__file__).resolve().parents[1]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A scratch repository with one commit on branch ``trunk``, standing in for the checkout."""
    _git(tmp_path, "init", "-q", "-b", "trunk")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.setattr(provenance, "CHECKOUT", tmp_path)
    return tmp_path


def test_the_commit_is_dirty_for_changed_tracked_files_only(repo):
    head = _git(repo, "rev-parse", "HEAD")
    assert provenance.git_commit() == head
    (repo / "notes.txt").write_text("untracked\n")
    assert provenance.git_commit() == head  # an untracked file changes no code that runs
    (repo / "code.py").write_text("x = 2\n")
    assert provenance.git_commit() == head + "-dirty"


def test_source_tags_name_the_program_commit_branch_and_remote(repo):
    head = _git(repo, "rev-parse", "HEAD")
    program = {"mlflow.source.name": str(provenance.ENTRY_MODULE), "mlflow.source.type": "LOCAL"}
    assert provenance.source_tags() == {**program, "mlflow.source.git.commit": head,
                                        "mlflow.source.git.branch": "trunk"}
    _git(repo, "remote", "add", "origin", "https://example.org/commlab.git")
    _git(repo, "checkout", "-q", "--detach")
    assert provenance.source_tags() == {**program, "mlflow.source.git.commit": head,
                                        "mlflow.source.git.repoURL": "https://example.org/commlab.git"}


def test_this_checkout_is_what_runs():
    """Asked in the code's own checkout, whatever the working directory: the commit git reports."""
    head = _git(ROOT, "rev-parse", "HEAD")
    dirty = bool(_git(ROOT, "status", "--porcelain", "--untracked-files=no"))
    assert provenance.git_commit() == head + ("-dirty" if dirty else "")
    assert provenance.ENTRY_MODULE == ROOT / "src" / "commlab" / "loop" / "worker.py"
    assert provenance.source_tags()["mlflow.source.git.commit"] == head


def test_source_tags_outside_a_checkout(monkeypatch):
    """Without git (or a checkout) the run still names its source, just no version."""
    monkeypatch.setenv("PATH", "/nonexistent")
    assert set(provenance.source_tags()) == {"mlflow.source.name", "mlflow.source.type"}


def test_git_commit_outside_a_checkout(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert provenance.git_commit() == "unknown"


def test_a_stalled_git_is_given_up(tmp_path, monkeypatch):
    """A git that does not answer within GIT_TIMEOUT_S counts as no git: the run starts."""
    fake = tmp_path / "bin" / "git"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nexec {shutil.which('sleep')} 30\n")  # exec: the timeout's kill ends it
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.setattr(provenance, "GIT_TIMEOUT_S", 0.2)
    assert provenance.git_commit() == "unknown"
    assert set(provenance.source_tags()) == {"mlflow.source.name", "mlflow.source.type"}


def test_a_benchmarks_environment_record():
    import platform

    import torch

    from commlab.malloc import describe

    env = provenance.environment()
    assert set(env) == {"host", "python", "torch", "cpus", "load_average", "device", "cuda", "git_commit", "time",
                        "worker_malloc"}
    assert (env["host"], env["python"], env["torch"]) == (platform.node(), platform.python_version(),
                                                          torch.__version__)
    assert env["cpus"] == os.cpu_count() and len(env["load_average"]) == 3
    assert env["cuda"] == torch.cuda.is_available() and env["device"].startswith("cpu") != env["cuda"]
    assert env["git_commit"] == provenance.git_commit() and env["worker_malloc"] == describe()
