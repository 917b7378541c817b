"""Threshold selection and counting on CUDA in about one read of the tensor: Triton kernels
(docs/performance.md, "Selection passes"; the selection Ok-Topk, TopkA, Gaussian-k, DGC and
RedSync make every step: Li & Hoefler, PPoPP'22, section 4; Fang et al., arXiv 1808.04357).

torch's passes for a selection are a comparison into a mask (``hardshrink``, then a cast), then
``torch.nonzero`` (a count, a host read, a compaction) and a gather of the values: about 14 bytes
moved per element against 4 for one read. Here:

* ``_mark`` reads x once and, per block of ``BLOCK`` entries, writes one bit per entry (n/8
  bytes in all) and the block's count;
* ``torch.cumsum`` of the block counts (n/BLOCK of them) gives each block its first output slot;
* ``_emit`` gives each bitmask word its first output slot (a prefix sum of the words' bit counts
  within the block) and writes the positions of its set bits and the values there, lowest bit
  first; it reads x again only at the selected entries.

At density 1% that is about 4.6 bytes per element. The comparison is on float32 bit patterns:
for t at least the smallest positive float, |x| >= t is ``(bits(x) & 0x7fffffff) >= bits(t)``
(the patterns of non-negative floats are ordered as their values, and NaN's lie above +inf's),
which is exactly ``!(|x| < t)``: NaN passes, zeros never do, as in :mod:`commlab.compress.scan`.

A count of many thresholds (``_count``) compares each entry against all of them in registers,
counts how many it passes, and adds a per-block histogram of that number to the result with one
integer atomic per bin and block (integer sums: the same result whatever the order).

Host syncs: a selection reads one number, its total (for the output's length), as
``torch.nonzero`` does; a count reads its counts. With ``capacity`` (a selector's previous count,
doubled) ``_emit`` is launched before the total is read, into buffers of that size, so that the
GPU does not wait for the host between the kernels; a total beyond it reruns ``_emit`` into
buffers of the right size. The results are views of those buffers (no copy).

Only CUDA float32 tensors take this path, and only when Triton can be imported; the scan module
falls back to torch's passes otherwise, or with ``COMMLAB_TRITON=0`` (same result). Triton's
interpreter (``TRITON_INTERPRET=1``) runs the kernels on the CPU, which is how the tests check
them without a GPU.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

BLOCK = 8192  # entries per program of _mark and _emit: 256 bitmask words, one per thread of 8 warps
WARPS = 8
COUNT_BLOCK = 8192  # entries per program of _count
WORD = 32  # entries per bitmask word
MAX_GUARDS = 5  # thresholds _emit counts among what it writes: 6 bits each in one int32 per lane


@triton.jit(do_not_specialize=["tbits"])
def _mark(x_ptr, words_ptr, counts_ptr, n, tbits, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    bits = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.int32, bitcast=True)
    keep = (((bits & 0x7FFFFFFF) >= tbits) & inside).to(tl.int32)
    tl.store(counts_ptr + pid, tl.sum(keep, axis=0))
    # bit j of word w is entry 32w + j: distinct bits, so their sum is their OR (wrapping at bit 31)
    shifted = tl.reshape(keep, (BLOCK // 32, 32)) << tl.arange(0, 32)[None, :]
    tl.store(words_ptr + pid.to(tl.int64) * (BLOCK // 32) + tl.arange(0, BLOCK // 32), tl.sum(shifted, axis=1))


@triton.jit
def _popcount(v):
    """Set bits of each int32 (SWAR; the arithmetic shifts' sign bits are masked away)."""
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return (v * 0x01010101) >> 24


@triton.jit(do_not_specialize=["capacity"])
def _emit(x_ptr, words_ptr, ends_ptr, pos_ptr, val_ptr, capacity, guards_ptr, guard_counts_ptr,
          BLOCK: tl.constexpr, VALUES: tl.constexpr, GUARDS: tl.constexpr):
    pid = tl.program_id(0)
    end = tl.load(ends_ptr + pid)
    start = tl.load(ends_ptr + pid - 1, mask=pid > 0, other=0)
    if end > start:
        # One lane per bitmask word, not per entry: at a density of 1% three words in four are 0,
        # and a word's set bits are peeled off lowest first, as many rounds as the fullest word has.
        w = tl.arange(0, BLOCK // 32)
        words = tl.load(words_ptr + pid.to(tl.int64) * (BLOCK // 32) + w)
        ones = _popcount(words)
        slot = start + (tl.cumsum(ones, axis=0) - ones).to(tl.int64)  # each word's first output slot
        base = pid.to(tl.int64) * BLOCK + w.to(tl.int64) * 32
        passed = tl.zeros([BLOCK // 32], dtype=tl.int32)  # per lane, 6 bits per guard threshold
        rounds = tl.max(ones, axis=0)
        done = tl.full([], 0, tl.int32)
        while done < rounds:  # (a while loop: Triton's interpreter cannot range over a tensor)
            low = words & -words  # the lowest set bit (0 once a word is done)
            # its index: the exponent of the power of two as a float32 (1 << 31 converts to -2^31)
            offs = base + (((low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127)
            write = (words != 0) & (slot < capacity)
            tl.store(pos_ptr + slot, offs, mask=write)
            if VALUES:
                value = tl.load(x_ptr + offs, mask=write)
                tl.store(val_ptr + slot, value, mask=write)
                if GUARDS > 0:
                    magnitude = value.to(tl.int32, bitcast=True) & 0x7FFFFFFF
                    for j in tl.static_range(GUARDS):
                        passed += ((magnitude >= tl.load(guards_ptr + j)) & write).to(tl.int32) << (6 * j)
            slot += 1
            words = words ^ low
            done += 1
        if GUARDS > 0:
            for j in tl.static_range(GUARDS):
                tl.atomic_add(guard_counts_ptr + j, tl.sum((passed >> (6 * j)) & 63, axis=0))


@triton.jit
def _count(x_ptr, tbits_ptr, hist_ptr, n, THRESHOLDS: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    magnitude = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    passed = tl.zeros([BLOCK], dtype=tl.int32)  # padding reads 0.0: it passes nothing (bin 0, unused)
    for j in tl.static_range(THRESHOLDS):
        passed += (magnitude >= tl.load(tbits_ptr + j)).to(tl.int32)
    tl.atomic_add(hist_ptr + tl.arange(0, BINS), tl.histogram(passed, BINS))


def supports(x: torch.Tensor) -> bool:
    """Whether ``x`` can take these kernels: a contiguous float32 CUDA tensor (or one under
    Triton's interpreter, which runs them on the CPU)."""
    return x.dtype == torch.float32 and x.is_contiguous() and (x.is_cuda or _interpreted())


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _on(x: torch.Tensor):
    """The context in which a kernel on ``x``'s device launches (its GPU current)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return nullcontext()


def select(x: torch.Tensor, tbits: int, values: bool = True, capacity: int | None = None,
           total: int | None = None, block: int = BLOCK, warps: int = WARPS
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ascending int64 positions of flat float32 ``x`` whose magnitude's bit pattern is at least
    ``tbits`` (>= 1: the threshold's float32 pattern), and the values there when ``values``.
    ``capacity``: how many entries to make room for before the total is read (None: read it
    first); ``total``: the number that pass, when the caller knows it (then nothing is read)."""
    positions, found, _ = _select(x, tbits, values, capacity, total, [], block, warps)
    return positions, found


def select_counting(x: torch.Tensor, tbits: int, guards: list[int], capacity: int | None = None,
                    block: int = BLOCK, warps: int = WARPS) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """:func:`select`'s positions and values, and how many of the selected entries pass each of
    ``guards`` (ascending bit patterns above ``tbits``, at most ``MAX_GUARDS``), counted by
    ``_emit`` as it writes them: no further pass, and with ``capacity`` read with the total."""
    if len(guards) > MAX_GUARDS:
        raise ValueError(f"select_counting counts at most {MAX_GUARDS} thresholds, got {len(guards)}")
    return _select(x, tbits, True, capacity, None, guards, block, warps)


def _select(x, tbits, values, capacity, total, guards, block, warps):
    n = x.numel()
    if n == 0:
        return (torch.empty(0, dtype=torch.int64, device=x.device), (x[:0].clone() if values else None),
                [0] * len(guards))
    blocks = triton.cdiv(n, block)
    with _on(x):
        words = torch.empty(blocks * (block // WORD), dtype=torch.int32, device=x.device)
        counts = torch.empty(blocks, dtype=torch.int32, device=x.device)
        _mark[(blocks,)](x, words, counts, n, tbits, BLOCK=block, num_warps=warps)
        ends = torch.cumsum(counts, 0)
        guard_bits = _on_device(guards, x) if guards else counts  # (unread without guards)
        guard_counts = torch.zeros(len(guards), dtype=torch.int32, device=x.device) if guards else counts

        def emit(size, again=False):
            if again and guards:
                guard_counts.zero_()  # the first emit counted the entries it had room for
            positions, found = _outputs(size, values, x)
            _emit[(blocks,)](x, words, ends, positions, found, size, guard_bits, guard_counts, BLOCK=block,
                             VALUES=values, GUARDS=len(guards), num_warps=warps)
            return positions, found

        if total is not None:  # the caller knows how many pass: nothing to read
            positions, found = emit(total)
            return positions, (found if values else None), (guard_counts.tolist() if guards else [])
        room = min(capacity or 0, n)
        if room:  # launched before the read: the GPU does not wait for the host between the kernels
            positions, found = emit(room)
        # the one host read: the output's length (with the guards' counts, once they are emitted)
        read = (torch.cat((ends[-1:], guard_counts.long())) if guards and room else ends[-1:]).tolist()
        total = read[0]
        if room and total <= room:
            return positions[:total], (found[:total] if values else None), read[1:]
        positions, found = emit(total, again=bool(room))
        return positions, (found if values else None), (guard_counts.tolist() if guards else [])


def _outputs(size: int, values: bool, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.empty(size, dtype=torch.int64, device=x.device)
    # without values _emit is given the positions twice and writes no value
    return positions, (torch.empty(size, dtype=x.dtype, device=x.device) if values else positions)


def count(x: torch.Tensor, tbits: list[int], block: int = COUNT_BLOCK, warps: int = WARPS) -> list[int]:
    """How many entries of flat float32 ``x`` have a magnitude's bit pattern at least each of
    ``tbits`` (ascending, each >= 1), in one read of x; one host read of the counts."""
    m = len(tbits)
    if x.numel() == 0 or m == 0:
        return [0] * m
    if any(b >= a for a, b in zip(tbits[1:], tbits, strict=False)) or tbits[0] < 1:
        raise ValueError("count needs ascending bit patterns, each >= 1")
    bins = triton.next_power_of_2(m + 1)
    with _on(x):
        patterns = _on_device(tbits, x)
        hist = torch.zeros(bins, dtype=torch.int32, device=x.device)
        _count[(triton.cdiv(x.numel(), block),)](x, patterns, hist, x.numel(), THRESHOLDS=m, BINS=bins,
                                                  BLOCK=block, num_warps=warps)
        # entries passing threshold j (ascending) are those passing more than j of them
        passing = hist.flip(0).cumsum(0).flip(0)[1:m + 1]
        return passing.tolist()


def _on_device(tbits: list[int], x: torch.Tensor) -> torch.Tensor:
    """The patterns on x's device without making the host wait (pinned, asynchronous copy), as
    ``scan.host_values`` does: importing scan here would close an import cycle (scan dispatches
    to this module)."""
    host = torch.tensor(tbits, dtype=torch.int32)  # host-side: staged for the device
    return host.pin_memory().to(x.device, non_blocking=True) if x.is_cuda else host
