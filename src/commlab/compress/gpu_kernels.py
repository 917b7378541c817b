"""Whether a selection pass on a GPU runs commlab's Triton kernels
(:mod:`commlab.compress.triton_select`) or torch's passes (:mod:`commlab.compress.scan`).

The kernels take contiguous CUDA float32 tensors when Triton can be imported (PyTorch's CUDA
builds bring it) and ``COMMLAB_TRITON`` is not ``0``; a selection only from ``MIN_ELEMENTS``
entries up. Below that torch's passes are faster: a Triton launch costs more host time than a
torch launch, and on a small tensor (a layer, a guard's subset of selected values) the launches,
not the reads, are the cost. On a large tensor the kernels' single read wins. A count keeps its
kernel at any size: torch's way, a bucketize and an ``index_add_`` histogram, piles its atomics
onto a few bins. ``commlab bench selection --devices cuda`` times the selections, with
``COMMLAB_TRITON=0`` on torch's passes.

A Triton that cannot compile a kernel here costs speed, not the run: the first failure of an
entry point warns once, naming it and the error, and torch's passes take over for that entry
point; once an entry point has run, its errors (out of memory, say) are errors.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

MIN_ELEMENTS = 1 << 23  # 8M entries (32 MiB of float32): smaller selections take torch's passes
WORKED: set[str] = set()  # entry points that ran once
BROKEN: set[str] = set()  # those whose first use failed: torch's passes instead


@functools.cache
def module():
    """:mod:`commlab.compress.triton_select`, or None without Triton or with ``COMMLAB_TRITON=0``."""
    if os.environ.get("COMMLAB_TRITON", "1") == "0":
        return None
    try:
        from commlab.compress import triton_select
    except ImportError:
        return None
    return triton_select


def kernels_for(t: torch.Tensor, min_elements: int | None = None):
    """The Triton kernels' module for CUDA float32 ``t`` of at least ``min_elements`` entries
    (default :data:`MIN_ELEMENTS`), else None (torch's passes)."""
    if not t.is_cuda or t.numel() < (MIN_ELEMENTS if min_elements is None else min_elements):
        return None
    kernels = module()
    return kernels if kernels is not None and kernels.supports(t) else None


def run(call, *args):
    """``call(*args)``, one of the kernels' entry points; None when torch's passes must run
    instead (this entry point failed on its first use, now or before)."""
    name = call.__name__
    if name in BROKEN:
        return None
    try:
        out = call(*args)
    except Exception as err:  # noqa: BLE001 - only before this entry point ever worked
        if name in WORKED:
            raise
        BROKEN.add(name)
        warnings.warn(f"commlab: the Triton kernel {name} failed ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); selections use torch's passes "
                      f"(same result, slower). COMMLAB_TRITON=0 silences this.", RuntimeWarning, stacklevel=3)
        return None
    WORKED.add(name)
    return out
