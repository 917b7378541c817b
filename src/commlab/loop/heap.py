"""Keep a training worker's freed memory in its heap (glibc's malloc settings for the worker).

By default glibc gives the free top of its heap back to the system once it exceeds the trim
threshold, which follows the largest block freed so far (twice the dynamic mmap threshold, at
most 64 MiB). A training step frees its activations, gradients' temporaries and the method's
buffers and allocates them again at the next forward; when a step leaves a large free block at
the heap's top, glibc trims it and the next forward takes every page of it back through a page
fault, zeroed by the kernel. On a CPU run that is system time in every step, and it depends on
the method: one that leaves a large free block at the heap's top pays it at the next forward,
one that frees little does not. With the settings below the same forward costs every method the
same (docs/performance.md, "A worker's heap").

So every worker (:func:`commlab.loop.worker.run`) sets, before it allocates anything large:

* ``M_TRIM_THRESHOLD`` 1 GiB: the heap's top is kept (a worker's heap stays near its peak,
  which every step reaches again anyway);
* ``M_MMAP_THRESHOLD`` 32 MiB, glibc's largest: setting either value fixes both (glibc stops
  adjusting them), and a block below this comes from the heap rather than a fresh mapping.

A value given in glibc's own environment variables (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``) wins; ``GLIBC_TUNABLES`` naming a malloc setting, or
``COMMLAB_MALLOC=system``, leaves malloc as it is. Elsewhere than glibc this does nothing. CUDA
memory is the caching allocator's and is not touched.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20  # glibc ignores more on 64-bit (half its 64 MiB heap size)
ENVIRONMENT = {M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_", M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_"}


def settings(environ: dict | None = None) -> dict[int, int]:
    """The ``mallopt`` parameters to set, {parameter: value}: empty when the environment leaves
    malloc to the system (``COMMLAB_MALLOC=system``, or ``GLIBC_TUNABLES`` with a malloc setting).
    Raises ValueError naming the variable when one of glibc's is not a byte count."""
    environ = os.environ if environ is None else environ
    choice = environ.get("COMMLAB_MALLOC", "worker")
    if choice not in ("worker", "system"):
        raise ValueError(f"COMMLAB_MALLOC must be 'worker' or 'system', got {choice!r}")
    if choice == "system" or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return {}
    chosen = {M_TRIM_THRESHOLD: TRIM_THRESHOLD, M_MMAP_THRESHOLD: MMAP_THRESHOLD}
    for param, name in ENVIRONMENT.items():
        if name in environ:
            value = environ[name].strip()
            if not value.isdigit():
                raise ValueError(f"{name} must be a number of bytes, got {environ[name]!r}")
            chosen[param] = int(value)
    return chosen


def describe(environ: dict | None = None) -> str:
    """What the workers set, for a run's tag and a benchmark's record: ``trim_threshold=...
    mmap_threshold=...`` in bytes, or ``system`` when they leave malloc alone (or have no glibc)."""
    chosen = settings(environ)
    if not chosen or _mallopt() is None:
        return "system"
    return f"trim_threshold={chosen[M_TRIM_THRESHOLD]} mmap_threshold={chosen[M_MMAP_THRESHOLD]}"


def keep_freed_memory(environ: dict | None = None) -> bool:
    """Apply :func:`settings` with glibc's ``mallopt``; True when every value was accepted
    (False: not glibc, nothing to set, or a value glibc refused)."""
    chosen, mallopt = settings(environ), _mallopt()
    if not chosen or mallopt is None:
        return False
    # (glibc ignores an mmap threshold above 32 MiB, and before 2.37 still reports success)
    return all(mallopt(param, min(value, 2**31 - 1)) == 1 for param, value in chosen.items())


def _mallopt():
    """glibc's ``mallopt``, or None elsewhere (then nothing is set, and runs record ``system``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
