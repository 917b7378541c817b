"""Random draws keyed by (seed, epoch, sample, stream): the same numbers wherever they are drawn.

Augmentation and masking draw from a counter-based hash rather than from a generator that walks
through the samples: a sample's crop, flip or masked positions then depend on the run's seed,
the epoch and the sample's index alone, not on which rank or loader worker handles it, on how many
there are, or on where a resumed run starts. The hash works on whole index tensors at once (one
batch, on any device, no loop over samples) and on one sample in a loader worker alike.

The mix is the 32-bit integer finaliser of Mueller's ``hash prospector`` (two multiply-xorshift
rounds), applied once per key component; every intermediate stays below 2**63, so int64
arithmetic on any device computes it exactly.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: a product with a 32-bit value stays below 2**63


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = h & MASK32
    h = h ^ (h >> 16)
    h = (h * _MUL) & MASK32
    h = h ^ (h >> 16)
    h = (h * _MUL) & MASK32
    return h ^ (h >> 16)


def keyed_bits(seed: int, epoch: int, index: torch.Tensor, stream: torch.Tensor | int = 0) -> torch.Tensor:
    """32 random bits (int64 in [0, 2**32)) for every (index, stream) pair (broadcast together)."""
    index = torch.as_tensor(index, dtype=torch.int64)
    stream = torch.as_tensor(stream, dtype=torch.int64, device=index.device)
    h = _mix(torch.full((), seed, dtype=torch.int64, device=index.device) + 0x9E3779B9)
    h = _mix(h ^ (epoch & MASK32))
    h = _mix(h ^ (index & MASK32))
    return _mix(h ^ (stream & MASK32))


def keyed_uniform(seed: int, epoch: int, index: torch.Tensor, stream: torch.Tensor | int = 0,
                  dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Uniform draws in [0, 1) keyed as :func:`keyed_bits` (32 bits of resolution)."""
    return keyed_bits(seed, epoch, index, stream).to(dtype) / 2.0**32


def keyed_int(seed: int, epoch: int, index: torch.Tensor, stream: torch.Tensor | int, high: int) -> torch.Tensor:
    """Integers in [0, high) keyed as :func:`keyed_bits` (modulo bias below high / 2**32)."""
    return keyed_bits(seed, epoch, index, stream) % high
