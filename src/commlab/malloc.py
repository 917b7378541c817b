"""The training workers' malloc settings: the glibc ``mallopt`` values they set
(:data:`TRIM_THRESHOLD`, :data:`MMAP_THRESHOLD`), as the environment changes them, and the line
that a run's ``worker_malloc`` tag and a benchmark's record carry.

Why the workers set them, and where: :mod:`commlab.loop.heap`. This module sets nothing, and
imports nothing of commlab, nor torch: what records a run's or a benchmark's provenance
(:mod:`commlab.tracking`, :mod:`commlab.provenance`) sits below the loop and names the settings
from here.

A value given in glibc's own environment variables (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``) wins; ``GLIBC_TUNABLES`` naming a malloc setting, or
``COMMLAB_MALLOC=system``, leaves malloc as it is. Without glibc there is nothing to set, and the
line says ``system``.
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
    if not chosen or mallopt() is None:
        return "system"
    return f"trim_threshold={chosen[M_TRIM_THRESHOLD]} mmap_threshold={chosen[M_MMAP_THRESHOLD]}"


def mallopt():
    """glibc's ``mallopt``, or None elsewhere (then nothing is set, and runs record ``system``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        found = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    found.argtypes, found.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return found
