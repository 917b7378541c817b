"""Methods, one module each, found by name through :data:`commlab.registry.ALGORITHMS`."""

from commlab.algorithms.base import AlgoContext, Algorithm, StepInfo, parse_options

__all__ = ["AlgoContext", "Algorithm", "StepInfo", "parse_options"]
