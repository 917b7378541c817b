"""A killed local SLURM cluster (its daemons ended with the session or job that ran them) leaves
its network namespaces and bridge behind: the next ``up`` removes them instead of refusing, and
still refuses while any process runs in them (a live cluster)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from commlab.launch.netem import list_namespaces
from commlab.testing import localslurm
from commlab.testing.localslurm import BRIDGE, PREFIX, ClusterError, clear_stopped_cluster

pytestmark = [pytest.mark.netem, pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (network namespaces)")]

NS = f"{PREFIX}-leftover-test"


def _bridge_exists() -> bool:
    return subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0


@pytest.fixture
def leftovers():
    if _bridge_exists() or list_namespaces(PREFIX + "-"):
        pytest.skip("a local SLURM cluster is up on this machine")
    subprocess.run(["ip", "netns", "add", NS], check=True)
    subprocess.run(["ip", "link", "add", BRIDGE, "type", "bridge"], check=True)
    yield
    subprocess.run(["ip", "netns", "delete", NS], capture_output=True)
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)


def test_a_stopped_clusters_leftovers_are_removed(leftovers, capsys):
    assert clear_stopped_cluster() == [NS]
    assert NS not in list_namespaces(PREFIX + "-") and not _bridge_exists()
    assert "removing a stopped cluster's leftovers" in capsys.readouterr().err


def test_a_live_cluster_is_refused_and_kept(leftovers):
    sleeper = subprocess.Popen(["ip", "netns", "exec", NS, "sleep", "30"])
    try:
        deadline = 50
        while not localslurm.namespace_pids(NS) and deadline:
            subprocess.run(["sleep", "0.1"])
            deadline -= 1
        with pytest.raises(ClusterError, match="already up"):
            clear_stopped_cluster()
        assert NS in list_namespaces(PREFIX + "-") and _bridge_exists()
    finally:
        sleeper.kill()
        sleeper.wait()
