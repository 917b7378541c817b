"""Float formats by their bit patterns, in plain Python: the host arithmetic of the thresholds a
selection compares (:mod:`commlab.compress.scan`), a bisection on patterns (Ok-Topk's bounded
global threshold, :mod:`commlab.compress.bounded`) and the GPU kernels' comparisons
(:mod:`commlab.compress.triton_select` compares magnitudes' bit patterns against :func:`pattern`).

Thresholds are host numbers, and host arithmetic done with torch scalars would read like device
work. Rounding is to nearest even, as a comparison of a tensor with a Python float rounds it;
bfloat16 is the high half of a float32. Example::

    >>> import torch
    >>> to_bits(1.0, torch.float32) == 0x3F800000
    True
    >>> next_up(1.0, torch.float16) == 1.0 + 2**-10
    True
    >>> compared(0.0, torch.float32) == smallest_positive(torch.float32)  # zeros never pass
    True
"""

from __future__ import annotations

import math
import struct

import torch

_FORMATS = {torch.float64: ("<d", "<Q"), torch.float32: ("<f", "<I"), torch.float16: ("<e", "<H")}


def to_bits(t: float, dtype: torch.dtype) -> int:
    """The bit pattern of ``t`` rounded (to nearest even) to ``dtype``."""
    if dtype == torch.bfloat16:  # the high half of a float32, rounded to nearest even
        high = to_bits(t, torch.float32)
        if math.isnan(t):
            return high >> 16
        return (high + 0x7FFF + ((high >> 16) & 1)) >> 16
    if dtype not in _FORMATS:
        raise ValueError(f"no float format for dtype {dtype}")
    value, bits = _FORMATS[dtype]
    try:
        return struct.unpack(bits, struct.pack(value, t))[0]
    except OverflowError:  # beyond the format's largest finite value: rounds to infinity
        return to_bits(math.copysign(math.inf, t), dtype)


def from_bits(bits: int, dtype: torch.dtype) -> float:
    """The value of a bit pattern of ``dtype``."""
    if dtype == torch.bfloat16:
        return from_bits(bits << 16, torch.float32)
    value, bits_format = _FORMATS[dtype]
    return struct.unpack(value, struct.pack(bits_format, bits))[0]


def in_dtype(t: float, dtype: torch.dtype) -> float:
    """``t`` rounded to ``dtype``, as a comparison with a tensor of that dtype rounds it."""
    return from_bits(to_bits(t, dtype), dtype)


def neighbour(t: float, dtype: torch.dtype, toward: float) -> float:
    """The neighbour of ``t`` >= 0 (rounded to ``dtype``) in ``dtype``, toward ``toward``."""
    bits = to_bits(t, dtype)
    if bits == 0 or (toward == 0 and math.copysign(1.0, from_bits(bits, dtype)) < 0):
        return from_bits(1, dtype) if toward > 0 else 0.0  # from +-0: the smallest positive value
    return from_bits(bits + (1 if toward > from_bits(bits, dtype) else -1), dtype)


def next_up(t: float, dtype: torch.dtype) -> float:
    """The smallest value of ``dtype`` above ``t`` (>= 0): |x| > t is |x| >= next_up(t)."""
    return neighbour(t, dtype, math.inf)


def smallest_positive(dtype: torch.dtype) -> float:
    """The smallest positive value of ``dtype``: |x| >= it is x != 0."""
    return from_bits(1, dtype)


def compared(t: float, dtype: torch.dtype) -> float:
    """``t`` as a selection compares it: rounded to ``dtype``, and at least its smallest positive
    value (so that zeros never pass)."""
    return max(in_dtype(t, dtype), smallest_positive(dtype))


def pattern(t: float, dtype: torch.dtype) -> int:
    """The bit pattern of :func:`compared` ``t``: what the GPU kernels compare magnitudes against."""
    return to_bits(compared(t, dtype), dtype)
