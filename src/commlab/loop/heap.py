"""Keep a training worker's freed memory in its heap (glibc's malloc settings for the worker).

By default glibc gives the free top of its heap back to the system once it exceeds the trim
threshold, which follows the largest block freed so far (twice the dynamic mmap threshold, at
most 64 MiB). A training step frees its activations, gradients' temporaries and the method's
buffers and allocates them again at the next forward; when a step leaves a large free block at
the heap's top, glibc trims it and the next forward takes every page of it back through a page
fault, zeroed by the kernel. On a CPU run that is system time in every step, and it depends on
the method: one that leaves a large free block at the heap's top pays it at the next forward,
one that frees little does not. With the settings below the same forward costs every method the
same (docs/performance.md, "A worker's heap").

So every worker (:func:`commlab.loop.worker.run`) sets, before it allocates anything large,
the values of :mod:`commlab.malloc` (which reads them from the environment and describes them for
a run's ``worker_malloc`` tag, below the loop so that tracking and provenance need not import it):

* ``M_TRIM_THRESHOLD`` 1 GiB: the heap's top is kept (a worker's heap stays near its peak,
  which every step reaches again anyway);
* ``M_MMAP_THRESHOLD`` 32 MiB, glibc's largest: setting either value fixes both (glibc stops
  adjusting them), and a block below this comes from the heap rather than a fresh mapping.

glibc's own variables (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``) change them,
``GLIBC_TUNABLES`` naming a malloc setting or ``COMMLAB_MALLOC=system`` leaves malloc as it is
(:func:`commlab.malloc.settings`). Elsewhere than glibc this does nothing. CUDA memory is the
caching allocator's and is not touched.
"""

from __future__ import annotations

from commlab import malloc


def keep_freed_memory(environ: dict | None = None) -> bool:
    """Apply :func:`commlab.malloc.settings` with glibc's ``mallopt``; True when every value was
    accepted (False: not glibc, nothing to set, or a value glibc refused)."""
    chosen, mallopt = malloc.settings(environ), malloc.mallopt()
    if not chosen or mallopt is None:
        return False
    # (glibc ignores an mmap threshold above 32 MiB, and before 2.37 still reports success)
    return all(mallopt(param, min(value, 2**31 - 1)) == 1 for param, value in chosen.items())
