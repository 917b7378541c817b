"""Launching an experiment's workers: the ``commlab launch`` command (:mod:`.command`), torchrun
and srun (:mod:`.torchrun`), plain worker processes supervised as torchrun does (:mod:`.supervise`),
the emulated network they may run in (:mod:`.netem`), the warm launcher that local jobs are forked
from (:mod:`.server`, :mod:`.client`), and gloo ranks of a function in processes on this machine
(:mod:`.ranks`, for benchmarks). Workers run :mod:`commlab.loop.worker`; nothing here imports the CLI.

The names below are imported on first use: a served ``commlab launch`` imports only
:mod:`.client` (the standard library) before it hands its job over.
"""

import importlib

_LAZY = {"add_arguments": "command", "launch": "command", "main": "command", "run_in_network": "supervise",
         "run_on_loopback": "supervise"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
