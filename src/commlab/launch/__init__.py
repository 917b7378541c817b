"""Launching an experiment's workers: the ``commlab launch`` command (:mod:`.command`), torchrun
and srun (:mod:`.torchrun`), plain worker processes supervised as torchrun does (:mod:`.supervise`),
the emulated network they may run in (:mod:`.netem`), and gloo ranks of a function in processes on
this machine (:mod:`.ranks`, for benchmarks). Workers run :mod:`commlab.loop.worker`; nothing here
imports the CLI.
"""

from commlab.launch.command import add_arguments, launch, main
from commlab.launch.supervise import run_in_network, run_on_loopback

__all__ = ["add_arguments", "launch", "main", "run_in_network", "run_on_loopback"]
