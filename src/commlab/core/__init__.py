"""The shared distributed core: runtime, the instrumented Communicator, sparse collectives."""

from commlab.core.communicator import Communicator, Pending
from commlab.core.runtime import Runtime, init_runtime, seed_everything, shutdown_runtime
from commlab.core.stats import CommStats

__all__ = ["CommStats", "Communicator", "Pending", "Runtime", "init_runtime", "seed_everything",
           "shutdown_runtime"]
