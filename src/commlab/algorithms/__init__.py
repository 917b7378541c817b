"""Methods, one module each, found by name through :data:`commlab.registry.ALGORITHMS`."""

from commlab.algorithms.base import Algorithm, MethodContext, OptimizerSettings, StepInfo, parse_options

__all__ = ["Algorithm", "MethodContext", "OptimizerSettings", "StepInfo", "parse_options"]
