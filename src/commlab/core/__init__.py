"""The shared distributed core: runtime, the instrumented Communicator, the uncounted control
channel, clocks, sparse collectives."""

from commlab.core.clock import Clock, HostClock
from commlab.core.communicator import Communicator, Pending
from commlab.core.control import ControlChannel
from commlab.core.runtime import Runtime, init_runtime, seed_everything, shutdown_runtime
from commlab.core.stats import CommStats

__all__ = ["Clock", "CommStats", "Communicator", "ControlChannel", "HostClock", "Pending", "Runtime", "init_runtime",
           "seed_everything", "shutdown_runtime"]
