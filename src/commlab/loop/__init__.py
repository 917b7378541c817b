"""The training loop and its helpers: the loop itself (:mod:`.loop`), its inputs (:mod:`.batches`),
evaluation, log-point metrics, the logger, the progress display, checkpoints and the state a
resume needs (:mod:`.checkpoint`, :mod:`.runstate`), a finished run's outputs, and the worker
entry point (:mod:`.worker`, also ``python -m commlab.loop``).

Importing the package imports no torch: ``commlab launch`` builds its command line from
:mod:`.worker`'s options, and torch in the launcher before it starts the workers' fork server
would delay every run's workers by torch's import (:func:`commlab.launch.torchrun.start_worker_server_early`).
"""

__all__ = ["EXIT_PREEMPTED", "train"]


def __getattr__(name: str):
    if name == "EXIT_PREEMPTED":  # from runstate, which imports torch: on first use
        from commlab.loop.runstate import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    raise AttributeError(f"module 'commlab.loop' has no attribute {name!r}")


def train(config: dict, sentinel=None, options=None) -> dict:
    """:func:`commlab.loop.loop.train` (imported on first use: torch is heavy)."""
    from commlab.loop.loop import train as run

    return run(config, sentinel, options)
