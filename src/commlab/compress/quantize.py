"""Gradient quantisers: QSGD stochastic rounding to s levels with a norm, and fp16 casting.

These are the quantised-gradient baselines of the ADPSGD comparison (Jiang & Agrawal, arXiv 2007.06134: "a
quantised SGD, e.g. QSGD 8-bit or 4-bit with stochastic rounding"). QSGD (Alistarh et al., 2017)
splits a flat vector into buckets of ``d`` elements; for each bucket with norm ``N`` (the L2 norm
as in QSGD, or the max norm) and each element ``v``::

    r = |v| / N * s,   l = floor(r),   level = l + Bernoulli(r - l)       (0 <= level <= s)
    Q(v) = N * sign(v) * level / s                                         E[Q(v)] = v

so the quantisation is unbiased. On the wire an element is the signed level stored as the code
``level * sign + s`` in ``[0, 2s]``, which needs ``2s + 1 <= 2^bits`` values, hence by default
``s = 2^(bits-1) - 1`` (8 bits: 127 levels, 4 bits: 7, 2 bits: 1). Codes travel in uint8 slots of
1, 2, 4 or 8 bits (the smallest that holds ``bits``): four 2-bit codes or two 4-bit codes share a
byte, 3-bit codes use 4-bit slots. A message is the packed codes plus one float32 norm per bucket;
:meth:`QSGDQuantizer.message_bytes` is its exact size, which is what the Communicator records
when the message is all-gathered.

The random draws come from a generator the caller owns (``core.runtime.rank_generator(seed,
rank, stream)``), so quantisation is reproducible per rank and independent of other randomness.

Usage::

    q = QSGDQuantizer(bits=4, bucket_size=512)
    packed, norms = q.encode(flat_grad, generator)
    approx = q.decode(packed, norms, flat_grad.numel())
"""

from __future__ import annotations

import torch

NORMS = ("l2", "max")


def default_levels(bits: int) -> int:
    """The largest ``s`` whose signed codes ``[-s, s]`` fit in ``bits`` bits: 2^(bits-1) - 1."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8, got {bits}")
    return 2 ** (bits - 1) - 1


def slot_bits(bits: int) -> int:
    """Width of the slot a ``bits``-bit code occupies in the packed message (2, 4 or 8)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8, got {bits}")
    return next(w for w in (2, 4, 8) if w >= bits)


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take once packed."""
    per_byte = 8 // slot_bits(bits)
    return -(-n // per_byte)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (each < 2^bits) into ``packed_size(n, bits)`` bytes, low slots first."""
    w = slot_bits(bits)
    if w == 8:
        return codes.to(torch.uint8).contiguous()
    per_byte = 8 // w
    n = codes.numel()
    padded = torch.zeros(packed_size(n, bits) * per_byte, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    slots = padded.view(-1, per_byte)
    out = torch.zeros(slots.shape[0], dtype=torch.uint8, device=codes.device)
    for j in range(per_byte):
        out |= slots[:, j] << (w * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``n`` codes, uint8."""
    w = slot_bits(bits)
    if w == 8:
        return packed[:n]
    per_byte = 8 // w
    mask = (1 << w) - 1
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=packed.device) * w
    slots = (packed.unsqueeze(1) >> shifts) & mask
    return slots.reshape(-1)[:n]


class QSGDQuantizer:
    """QSGD encoder/decoder for flat float vectors (see the module docstring for the scheme)."""

    def __init__(self, bits: int = 8, levels: int | None = None, bucket_size: int = 512,
                 norm: str = "l2"):
        self.bits = bits
        self.levels = default_levels(bits) if levels is None else levels
        if not 1 <= self.levels <= default_levels(bits):
            raise ValueError(f"levels must be between 1 and {default_levels(bits)} for {bits} bits, "
                             f"got {self.levels}")
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be at least 1, got {bucket_size}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.bucket_size = bucket_size
        self.norm = norm

    def num_buckets(self, n: int) -> int:
        return -(-n // self.bucket_size)

    def message_bytes(self, n: int) -> int:
        """Exact size of one encoded ``n``-element vector: packed codes + float32 norms."""
        return packed_size(n, self.bits) + 4 * self.num_buckets(n)

    def _buckets(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        padded = torch.zeros(self.num_buckets(n) * self.bucket_size, dtype=torch.float32, device=x.device)
        padded[:n] = x.reshape(-1)
        return padded.view(-1, self.bucket_size)

    def quantize(self, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Unpacked codes (uint8 in [0, 2s], one per element) and float32 norms (one per bucket)."""
        n = x.numel()
        b = self._buckets(x)
        norms = b.norm(dim=1) if self.norm == "l2" else b.abs().amax(dim=1)
        # A zero bucket quantises to zeros (its ratio would be 0/0).
        scale = torch.where(norms > 0, self.levels / norms.clamp_min(torch.finfo(torch.float32).tiny),
                            torch.zeros_like(norms))
        r = (b.abs() * scale.unsqueeze(1)).clamp_(max=self.levels)
        low = r.floor()
        u = torch.rand(b.shape, generator=generator, dtype=torch.float32, device=b.device)  # generator on b's device
        level = low + (u < (r - low)).to(torch.float32)
        signed = torch.where(b < 0, -level, level)
        codes = (signed + self.levels).to(torch.uint8).reshape(-1)[:n]
        return codes, norms

    def dequantize(self, codes: torch.Tensor, norms: torch.Tensor, n: int) -> torch.Tensor:
        """Float32 values ``N * (code - s) / s`` of ``n`` unpacked codes."""
        padded = torch.zeros(self.num_buckets(n) * self.bucket_size, dtype=torch.float32,
                             device=codes.device)
        padded[:n] = codes[:n].to(torch.float32) - self.levels
        values = padded.view(-1, self.bucket_size) * (norms.to(torch.float32) / self.levels).unsqueeze(1)
        return values.reshape(-1)[:n]

    def encode(self, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The wire message of ``x``: (packed uint8 codes, float32 norms)."""
        codes, norms = self.quantize(x, generator)
        return pack_codes(codes, self.bits), norms

    def decode(self, packed: torch.Tensor, norms: torch.Tensor, n: int) -> torch.Tensor:
        """The float32 vector a received message stands for."""
        return self.dequantize(unpack_codes(packed, self.bits, n), norms, n)

    def variance_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on Var[Q(v)]: (N/s)^2 / 4 (a Bernoulli's variance is at most 1/4)."""
        b = self._buckets(x)
        norms = b.norm(dim=1) if self.norm == "l2" else b.abs().amax(dim=1)
        per_bucket = (norms / self.levels) ** 2 / 4
        return per_bucket.repeat_interleave(self.bucket_size)[: x.numel()]


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Cast to float16 for the wire (half the bytes of float32)."""
    return x.to(torch.float16)


def from_fp16(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return x.to(dtype)

