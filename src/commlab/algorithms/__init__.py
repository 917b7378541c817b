"""Methods, one module each, named after the method, found by name through
:data:`commlab.registry.ALGORITHMS`; shared machinery lives in modules named for what it is
(``periodic``, ``averaging``, ``kstep_common``, ``outer``, ``dense_allreduce``, ``ddp_wrapper``,
``compressed_ddp``, ``sparse_common``, ``momentum_correction``, ``delayed``, ``tensors``), never in
another method's module."""

from commlab.algorithms.base import (
    Algorithm,
    MethodContext,
    OptimizerSettings,
    QuickRun,
    ResumeState,
    StepInfo,
    SyncBudget,
    parse_options,
)

__all__ = ["Algorithm", "MethodContext", "OptimizerSettings", "QuickRun", "ResumeState", "StepInfo", "SyncBudget",
           "parse_options"]
