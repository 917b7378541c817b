"""An alpha-beta cost model of each method's communication per step (docs/network.md, sections 2 and 3). A MODEL.

Every number this module produces is a *prediction* and is labelled so (``kind: "model"``) in
JSON, tables and plots. It is fed by what the runs measured (bytes sent and collectives per step
from MLflow, per-step compute time) and extrapolates to P = 4 ... 1024 workers and named links.

Time of one collective of a payload of ``n`` bytes on ``P`` ranks with per-message latency ``α``
(seconds) and per-byte time ``β = 1 / bandwidth`` (seconds per byte of one worker's link):

==================  ===================================  ============================================
pattern             time                                 bytes rank 0 sends (to read n from a run)
==================  ===================================  ============================================
ring_allreduce      2(P-1)α + 2(P-1)/P · n β             2(P-1)/P · n
allgather (ring)    (P-1)α + (P-1) · n β                 (P-1) · n          (n = one rank's share)
split_and_reduce    (P-1)α + (P-1)/P · n β               (P-1)/P · n        (n = one rank's pairs)
oktopk              (2P-1+2log2P)α + 3(P-1)/P · n β      3(P-1)/P · n       (split-and-reduce + balance
                                                                            + allgatherv, Li & Hoefler)
tree (binomial)     2⌈log2P⌉ (α + n β)                   ⌈log2P⌉ · n
periodic averaging  ring_allreduce(model) / H            (per step; H = steps between averages)
==================  ===================================  ============================================

(Ok-Topk's paper writes split-and-reduce as (P−1)α + 2k(P−1)/P·β with k (index, value) pairs:
here ``n`` counts the bytes of those pairs, so 2k words = n.)

A method's step time is ``compute + c · messages(P) · α + n_step · time_volume(P) · β``, where ``c``
is its measured collectives per step (1 for Ok-Topk, whose formula is the whole step's) and
``n_step`` is its measured bytes per step divided by the pattern's volume factor at the measured P.
Periodic averaging needs no pattern of its own: its measured collectives and bytes per step already
carry the 1/H. Assumptions: no overlap of communication with compute, every byte crosses the slow
link (pessimistic for hierarchical methods), compute per worker does not change with P, and a
method's pattern is its class's ``comm_pattern`` attribute (a method that declares none is
modelled as a ring allreduce, flagged "assumed").

Matching a laptop run to a cluster (part 2): the emulated bandwidth is chosen so that the ratio
of communication to computation time equals the cluster's::

    r_cluster = T_ring(grad_bytes_cluster, P_cluster, link) / (batch / images_per_s)
    bandwidth = 2(P-1)/P · grad_bytes_local / (r_cluster · compute_local)

e.g. the cluster ``V100x16@10Gbit`` of :data:`CLUSTERS` (ResNet-50's 102.2 MB of fp32 gradients,
the assumed 330 images/s per V100, batch 64): r = (2·15/16·102.2 MB / 1.25 GB/s) / (64/330 s),
about 0.79. A local model with G bytes of gradients and C seconds of compute per step on 4
workers matches it at 2·3/4·G / (0.79·C) bytes/s. :func:`matching_bandwidth_mbit` does this
arithmetic with the local run's measured G and C; the scaling benchmark prints the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

MODEL_LABEL = "model (alpha-beta), not a measurement"


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


@dataclass(frozen=True)
class Link:
    """A named network: per-worker link rate (each direction) and per-message latency."""

    name: str
    bandwidth_gbit: float  # link rate, Gbit/s
    alpha_s: float  # per-message latency in seconds (an assumption unless measured)

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 8.0 / (self.bandwidth_gbit * 1e9)


# Latencies are typical orders of magnitude (TCP over Ethernet; RDMA over InfiniBand), assumed.
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("100Mbit", 0.1, 100e-6),
    Link("1Gbit", 1.0, 50e-6),
    Link("10Gbit", 10.0, 25e-6),
    Link("25Gbit", 25.0, 10e-6),
    Link("100Gbit", 100.0, 5e-6),
)}


@dataclass(frozen=True)
class Pattern:
    """How one collective's time and this rank's bytes grow with P."""

    name: str
    messages: Callable[[int], float]  # α terms on the critical path
    time_volume: Callable[[int], float]  # β multiplier on the payload n (critical path)
    sent_volume: Callable[[int], float]  # bytes rank 0 sends per payload byte (what runs measure)
    # True when ``messages`` already counts every message of a whole step (Ok-Topk's formula covers
    # its count exchanges, split-and-reduce, balancing and allgatherv): the latency term is then not
    # multiplied again by the collectives the Communicator counted in that step.
    whole_step: bool = False

    def time(self, n_bytes: float, p: int, link: Link, collectives: float = 1.0) -> float:
        """Seconds for ``collectives`` collectives moving ``n_bytes`` of payload in all."""
        if p <= 1:
            return 0.0
        calls = 1.0 if self.whole_step else collectives
        return calls * self.messages(p) * link.alpha_s + n_bytes * self.time_volume(p) * link.beta


PATTERNS: dict[str, Pattern] = {pat.name: pat for pat in (
    Pattern("ring_allreduce", lambda p: 2 * (p - 1), lambda p: 2 * (p - 1) / p, lambda p: 2 * (p - 1) / p),
    Pattern("allgather", lambda p: p - 1, lambda p: p - 1, lambda p: p - 1),
    Pattern("split_and_reduce", lambda p: p - 1, lambda p: (p - 1) / p, lambda p: (p - 1) / p),
    Pattern("oktopk", lambda p: 2 * p - 1 + 2 * _log2(p), lambda p: 3 * (p - 1) / p, lambda p: 3 * (p - 1) / p,
            whole_step=True),
    Pattern("tree", lambda p: 2 * _log2(p), lambda p: 2 * _log2(p), lambda p: _log2(p)),
    # A server on rank 0 (ASGD): each worker pushes n and pulls n in 2 messages; the server's link
    # carries the P - 1 remote workers' pushes in and pulls out, and bounds the rate in steady state.
    # Rank 0, which runs measure, sends (P - 1) n: the replies.
    Pattern("parameter_server", lambda p: 2, lambda p: p - 1, lambda p: p - 1),
)}



# ---------------------------------------------------------------------- the named formulas
def ring_allreduce_time(n_bytes: float, p: int, link: Link) -> float:
    """Dense ring allreduce: 2(P-1)α + 2(P-1)/P · n β."""
    return PATTERNS["ring_allreduce"].time(n_bytes, p, link)


def allgather_time(m_bytes: float, p: int, link: Link) -> float:
    """Ring allgather of ``m_bytes`` per rank: (P-1)α + (P-1) m β."""
    return PATTERNS["allgather"].time(m_bytes, p, link)


def split_and_reduce_time(n_bytes: float, p: int, link: Link) -> float:
    """Split-and-reduce of one rank's ``n_bytes`` of (index, value) pairs: (P-1)α + (P-1)/P n β."""
    return PATTERNS["split_and_reduce"].time(n_bytes, p, link)


def tree_allreduce_time(n_bytes: float, p: int, link: Link) -> float:
    """Binomial-tree reduce then broadcast: 2⌈log2 P⌉(α + n β)."""
    return PATTERNS["tree"].time(n_bytes, p, link)


def periodic_averaging_time(model_bytes: float, p: int, period: int, link: Link) -> float:
    """Per-step cost of averaging the model with a ring allreduce every ``period`` steps."""
    if period < 1:
        raise ValueError(f"period must be >= 1, got {period}")
    return ring_allreduce_time(model_bytes, p, link) / period


# ---------------------------------------------------------------------- methods
@dataclass
class MethodProfile:
    """What the runs measured for one method, per step, at ``workers`` workers."""

    method: str
    compute_s: float  # seconds of computation per step (forward, backward, selection, optimizer)
    bytes_per_step: float  # bytes rank 0 sent per step (all collectives)
    collectives_per_step: float  # collectives per step (global + local)
    workers: int  # P of the run that measured this
    pattern: str = "ring_allreduce"  # key of PATTERNS
    pattern_source: str = "assumed"  # class attribute, known name, measured, or assumed
    batch_per_worker: int = 32  # samples per worker per step
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown pattern {self.pattern!r}; known: {sorted(PATTERNS)}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    @property
    def payload_bytes(self) -> float:
        """The P-independent payload per step, read back through the pattern's volume factor."""
        factor = PATTERNS[self.pattern].sent_volume(self.workers) if self.workers > 1 else 0.0
        return self.bytes_per_step / factor if factor else 0.0


@dataclass
class Prediction:
    kind: str
    method: str
    workers: int
    link: str
    compute_s: float
    comm_s: float
    step_s: float
    samples_per_s: float
    speedup_vs_dense: float | None = None
    label: str = field(default=MODEL_LABEL)

    def as_dict(self) -> dict:
        return asdict(self)


def predict(profile: MethodProfile, p: int, link: Link, dense: MethodProfile | None = None) -> Prediction:
    """Predicted time per step of ``profile`` at ``p`` workers on ``link`` (and speed-up vs ``dense``)."""
    comm = PATTERNS[profile.pattern].time(profile.payload_bytes, p, link, profile.collectives_per_step)
    step = profile.compute_s + comm
    pred = Prediction("model", profile.method, p, link.name, profile.compute_s, comm, step,
                      p * profile.batch_per_worker / step if step > 0 else math.inf)
    if dense is not None:
        base = predict(dense, p, link)
        pred.speedup_vs_dense = base.step_s / step if step > 0 else math.inf
    return pred


def pattern_for(method: str, cls: type | None = None) -> tuple[str, str]:
    """The communication pattern of ``method`` and where it comes from."""
    declared = getattr(cls, "comm_pattern", None) if cls is not None else None
    if declared in PATTERNS:
        return declared, "declared by the method class"
    if declared is not None:
        raise ValueError(f"{method}: comm_pattern {declared!r} is not one of {sorted(PATTERNS)}")
    return "ring_allreduce", "assumed (the method declares no comm_pattern)"


def infer_pattern(bytes_by_workers: dict[int, float]) -> str:
    """The pattern whose volume growth best matches bytes per step measured at several P."""
    ps = sorted(p for p in bytes_by_workers if p > 1 and bytes_by_workers[p] > 0)
    if len(ps) < 2:
        raise ValueError(f"need measurements at two or more P > 1, got {sorted(bytes_by_workers)}")
    lo, hi = ps[0], ps[-1]
    measured = bytes_by_workers[hi] / bytes_by_workers[lo]

    def error(pat: Pattern) -> float:
        return abs(math.log(pat.sent_volume(hi) / pat.sent_volume(lo) / measured))

    return min(PATTERNS.values(), key=error).name


def profile_from_metrics(method: str, points: list[dict], workers: int, batch_per_worker: int,
                         pattern: str | None = None, source: str = "") -> MethodProfile:
    """A profile from a run's logged metric points (cumulative counters at several steps).

    Uses the difference between the first and the last point, so start-up costs drop out."""
    pts = sorted(points, key=lambda m: m["step"])
    if len(pts) < 2 or pts[-1]["step"] <= pts[0]["step"]:
        raise ValueError(f"{method}: need metric points at two different steps, got {len(pts)}")
    first, last = pts[0], pts[-1]
    steps = last["step"] - first["step"]

    def rate(key: str) -> float:
        return (last.get(key, 0.0) - first.get(key, 0.0)) / steps

    collectives = rate("collectives_global") + rate("collectives_local")
    if pattern is None:
        from commlab.registry import ALGORITHMS

        cls = ALGORITHMS.get(method) if method in ALGORITHMS else None
        pattern, origin = pattern_for(method, cls)
    else:
        origin = "given"
    return MethodProfile(method, rate("compute_seconds"), rate("bytes_sent"), collectives, workers, pattern,
                         origin, batch_per_worker, source)


# ---------------------------------------------------------------------- clusters (part 2)
@dataclass(frozen=True)
class Cluster:
    """A named GPU cluster running a named model, for compute/communication ratio matching."""

    name: str
    gpu: str
    model: str
    grad_bytes: float  # fp32 gradient size of the model
    images_per_s: float  # training throughput of one GPU (assumed, see `note`)
    batch_per_gpu: int
    workers: int
    link: Link
    note: str = ""

    @property
    def compute_s(self) -> float:
        return self.batch_per_gpu / self.images_per_s

    @property
    def comm_s(self) -> float:
        return ring_allreduce_time(self.grad_bytes, self.workers, self.link)

    @property
    def ratio(self) -> float:
        """Communication over computation time of one dense synchronous step."""
        return self.comm_s / self.compute_s


_R50 = 25_557_032 * 4  # ResNet-50 parameters x 4 bytes
_P100_NOTE = "P100: 219 img/s, TensorFlow benchmarks (ResNet-50, batch 64, synthetic data); assumed"
_V100_NOTE = "V100: 1.5x P100 in FP32 (vendor comparisons report >40% faster); assumed"
CLUSTERS: dict[str, Cluster] = {c.name: c for c in (
    Cluster("V100x16@10Gbit", "V100", "resnet50", _R50, 330.0, 64, 16, LINKS["10Gbit"], _V100_NOTE),
    Cluster("V100x16@100Gbit", "V100", "resnet50", _R50, 330.0, 64, 16, LINKS["100Gbit"], _V100_NOTE),
    Cluster("P100x16@10Gbit", "P100", "resnet50", _R50, 219.0, 64, 16, LINKS["10Gbit"], _P100_NOTE),
    Cluster("P100x16@100Gbit", "P100", "resnet50", _R50, 219.0, 64, 16, LINKS["100Gbit"], _P100_NOTE),
)}


def matching_bandwidth_mbit(grad_bytes: float, compute_s: float, workers: int, cluster: Cluster) -> float:
    """Emulated link rate (Mbit/s) giving a local dense run the cluster's comm/compute ratio."""
    if compute_s <= 0 or workers < 2:
        raise ValueError(f"need compute_s > 0 and workers >= 2, got {compute_s}, {workers}")
    local_bytes = 2 * (workers - 1) / workers * grad_bytes
    return local_bytes / (cluster.ratio * compute_s) * 8 / 1e6


def link_from_measurement(name: str, mbit: float, alpha_s: float = 50e-6) -> Link:
    """A link described by a measured throughput (e.g. the emulated network's check)."""
    return Link(name, mbit / 1000.0, alpha_s)
