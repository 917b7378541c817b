"""What each collective costs on gloo: the elements and messages every rank sends and receives.

The Communicator charges each call with these figures (its module docstring has the table). They
follow the algorithms gloo runs under torch's ProcessGroupGloo, read from gloo's sources
(``gloo/allreduce.cc``, ``allgather.cc``, ``alltoallv.cc``, ``broadcast.cc``) and checked against
the bytes the emulated links carried (docs/network.md, "Bytes on the wire"):

* allreduce is always gloo's ring (reduce-scatter, then allgather), whatever the size. The
  tensor is cut into ``S = roundUp(max(ceil(bytes / 1 MiB), 2P), P)`` segments of
  ``ceil(n / S)`` elements (the last ones shorter or empty) and rank j's chunk is segments
  ``j S/P ... (j+1) S/P - 1``: rank i sends everything but chunks i and i-1 once each, so the
  per-rank figures differ from an even split (a 4-element allreduce on 4 ranks leaves two chunks
  empty); the sum over ranks is the textbook ``2(P-1) n``. One message per non-empty segment sent.
* allgather is a ring in halves: ``(P-1) m`` elements and ``2(P-1)`` messages per rank.
* all_to_all sends each block directly (``P-1`` messages, zero-length blocks included; a rank's
  own block is a local copy).
* broadcast is a binomial tree from the root: virtual rank ``v = (i - root) mod P`` sends the
  whole tensor once for every ``k`` with ``v < 2^k`` and ``v + 2^k < P`` (the root
  ``ceil(log2 P)`` times, the last half of the ranks never); every rank but the root receives it once.
* gloo's own reduce_scatter allreduces the whole input (twice the textbook volume), so the
  Communicator exchanges the P blocks with one all_to_all instead: ``(P-1) N / P`` per rank, as
  the textbook ring reduce-scatter.

Every message also costs :data:`GLOO_FRAMING_BYTES` of gloo's tcp transport on the wire: the
sender's notify-send-ready and data ops and the receiver's notify-recv-ready, a 48-byte op
preamble each. The accounting counts tensor bytes only (what the papers count); the framing is
counted as messages, so that a table of the wire can add it.
"""

from __future__ import annotations

import math

GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's AllreduceOptions::kMaxSegmentSize
GLOO_FRAMING_BYTES = 3 * 48  # per message: three op preambles of six 64-bit fields


def ring_chunks(n: int, p: int) -> list[int]:
    """Chunk sizes of an ``n``-element tensor split as evenly as possible over ``p`` ranks."""
    return [n // p + (1 if j < n % p else 0) for j in range(p)]


def _gloo_segments(n: int, p: int, element_size: int) -> tuple[int, int]:
    """(number of segments, elements per segment) of gloo's ring allreduce."""
    max_segment = element_size * max(1, GLOO_MAX_SEGMENT_BYTES // element_size)
    needed = max(-(-n * element_size // max_segment), 2 * p)
    segments = -(-needed // p) * p
    return segments, -(-n // segments)


def gloo_ring_chunks(n: int, p: int, element_size: int = 4) -> list[int]:
    """Elements of each rank's chunk in gloo's ring allreduce of ``n`` elements on ``p`` ranks."""
    if p == 1:
        return [n]
    segments, per = _gloo_segments(n, p, element_size)
    span = segments // p * per
    return [max(0, min(n, (j + 1) * span) - j * span) for j in range(p)]


def ring_allreduce_cost(n: int, p: int, i: int, element_size: int = 4) -> tuple[int, int]:
    """Elements (sent, received) by rank ``i`` in gloo's ring allreduce of ``n`` elements."""
    if p == 1:
        return 0, 0
    c = gloo_ring_chunks(n, p, element_size)
    return 2 * n - c[i] - c[(i - 1) % p], 2 * n - c[i] - c[(i + 1) % p]


def ring_allreduce_messages(n: int, p: int, i: int, element_size: int = 4) -> int:
    """Messages rank ``i`` sends in gloo's ring allreduce: one per non-empty segment outside its
    own chunk (reduce-scatter) and one per non-empty segment outside chunk ``i-1`` (allgather)."""
    if p == 1 or n == 0:
        return 0
    segments, per = _gloo_segments(n, p, element_size)
    filled = [min(per, n - s * per) > 0 for s in range(segments)]
    spr = segments // p

    def outside(j: int) -> int:
        return sum(filled) - sum(filled[j * spr:(j + 1) * spr])

    return outside(i) + outside((i - 1) % p)


def broadcast_sends(p: int, i: int, root: int) -> int:
    """How many copies of the tensor rank ``i`` sends in gloo's binomial-tree broadcast."""
    v = (i - root) % p
    return sum(1 for k in range(math.ceil(math.log2(p)) if p > 1 else 0) if v < 2**k and v + 2**k < p)
