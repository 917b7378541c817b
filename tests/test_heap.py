"""The worker's malloc settings (commlab.malloc, applied by commlab.loop.heap): what is set from
which environment, that glibc then keeps a freed block instead of faulting it back in, and a bad
variable's message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from commlab import malloc

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None


def test_defaults_and_glibc_variables():
    assert malloc.settings({}) == {malloc.M_TRIM_THRESHOLD: 1 << 30, malloc.M_MMAP_THRESHOLD: 32 << 20}
    assert malloc.settings({"MALLOC_TRIM_THRESHOLD_": "4096"}) == {malloc.M_TRIM_THRESHOLD: 4096,
                                                                   malloc.M_MMAP_THRESHOLD: 32 << 20}
    assert malloc.settings({"MALLOC_MMAP_THRESHOLD_": "131072"})[malloc.M_MMAP_THRESHOLD] == 131072
    assert malloc.settings({"COMMLAB_MALLOC": "system"}) == {}
    assert malloc.settings({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == {}
    assert malloc.settings({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) != {}
    assert malloc.describe({}) == "trim_threshold=1073741824 mmap_threshold=33554432"
    assert malloc.describe({"COMMLAB_MALLOC": "system"}) == "system"


@pytest.mark.parametrize(("environ", "named"), [({"COMMLAB_MALLOC": "jemalloc"}, "COMMLAB_MALLOC"),
                                                ({"MALLOC_TRIM_THRESHOLD_": "1G"}, "MALLOC_TRIM_THRESHOLD_"),
                                                ({"MALLOC_MMAP_THRESHOLD_": "-1"}, "MALLOC_MMAP_THRESHOLD_")])
def test_bad_variable_is_named(environ, named):
    with pytest.raises(ValueError, match=named):
        malloc.settings(environ)


# Three rounds of malloc, touch every page, free, of one 16 MiB block (under the 32 MiB mmap
# threshold), in a fresh interpreter; prints each round's minor page faults.
ROUNDS = """
import ctypes, resource, sys
from commlab.loop.heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "worker" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 16 << 20
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults)
"""


def _rounds(mode: str) -> tuple[str, list[int]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], env={**env, "COMMLAB_MALLOC": "worker"},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], [int(f) for f in out[1:]]


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_freed_block_stays_in_the_heap():
    pages = (16 << 20) // os.sysconf("SC_PAGE_SIZE")
    applied, faults = _rounds("worker")
    assert applied == "True"
    assert faults[0] >= pages // 2          # the heap grows once: its pages are new
    assert max(faults[1:]) < pages // 50    # then the freed block is reused, not faulted in again
    # glibc's defaults, the control: the block is mapped and unmapped, so the second round faults
    # every page again (only then does the dynamic threshold move it into the heap)
    applied, faults = _rounds("system")
    assert applied == "False"
    assert faults[1] >= pages // 2


def test_worker_rejects_a_bad_variable(tmp_path):
    env = {**os.environ, "COMMLAB_MALLOC": "tcmalloc", "RANK": "0"}
    done = subprocess.run([sys.executable, "-m", "commlab.loop", "--config", str(tmp_path / "none.yaml")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "COMMLAB_MALLOC must be 'worker' or 'system', got 'tcmalloc'" in done.stderr
