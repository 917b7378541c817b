"""Methods, one module each, named after the method, found by name through
:data:`commlab.registry.ALGORITHMS`; shared machinery lives in modules named for what it is
(``periodic``, ``averaging``, ``sparse_common``, ``compressed_ddp``, ``tensors``)."""

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
