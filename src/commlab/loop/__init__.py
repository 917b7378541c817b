"""The training loop and its helpers: the loop itself (:mod:`.loop`), its inputs (:mod:`.batches`),
evaluation, log-point metrics, the logger, the progress display, checkpoints and the state a
resume needs (:mod:`.checkpoint`, :mod:`.runstate`), a finished run's outputs, and the worker
entry point (:mod:`.worker`, also ``python -m commlab.loop``).
"""

from commlab.loop.runstate import EXIT_PREEMPTED

__all__ = ["EXIT_PREEMPTED", "train"]


def train(config: dict, sentinel=None, options=None) -> dict:
    """:func:`commlab.loop.loop.train` (imported on first use: torch is heavy)."""
    from commlab.loop.loop import train as run

    return run(config, sentinel, options)
