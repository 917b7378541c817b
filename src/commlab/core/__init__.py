"""The shared distributed core: runtime, the instrumented Communicator, the uncounted control
channel, the device clock, sparse collectives."""

from commlab.core.clock import DeviceClock
from commlab.core.communicator import Communicator, Pending
from commlab.core.control import ControlChannel
from commlab.core.runtime import Runtime, init_runtime, seed_everything, shutdown_runtime
from commlab.core.stats import CommStats

__all__ = ["CommStats", "Communicator", "ControlChannel", "DeviceClock", "Pending", "Runtime", "init_runtime",
           "seed_everything", "shutdown_runtime"]
