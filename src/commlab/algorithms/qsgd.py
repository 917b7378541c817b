"""QSGD, a quantised-gradient baseline of the ADPSGD comparison (Jiang & Agrawal, arXiv 2007.06134;
Alistarh et al., "QSGD", NeurIPS 2017).

Every step each rank quantises its flat gradient with QSGD (stochastic rounding to ``s`` levels
per bucket norm, ``bits`` per element; :mod:`commlab.compress.quantize`), then all ranks
all-gather the packed integer codes (uint8; two 4-bit or four 2-bit codes per byte) and the
float32 bucket norms, decode every rank's message, own included, and average them in rank order,
so every replica applies the same gradient. Nothing is summed in the quantised domain, so what
the Communicator records is exactly what is sent: ``(P - 1) * message_bytes(n)`` per rank and
step (ring all-gather). Random draws come from ``rank_generator(seed, rank, stream)``. The other
baseline of that comparison, the float16 allreduce, is ``fp16`` (:mod:`commlab.algorithms.fp16`).

Invariants: one step is one global reduction; every rank decodes the same messages in the same
order, so the replicas stay bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from commlab.algorithms.base import Algorithm, QuickRun, ResumeState, StepInfo, SyncBudget
from commlab.algorithms.tensors import flat_grads, write_grads
from commlab.compress.quantize import NORMS, QSGDQuantizer, default_levels
from commlab.core.runtime import rank_generator
from commlab.registry import ALGORITHMS

QSGD_STREAM = 41  # the rank generator stream reserved for QSGD's stochastic rounding


@ALGORITHMS.register("qsgd")
class QSGD(Algorithm):
    """All-gather QSGD-quantised gradients, decode and average them every step."""

    comm_pattern = "allgather"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "quantised"
    host_sync_budget = SyncBudget({"step": 0})
    quick_run = QuickRun()  # its defaults take its one branch
    resume = ResumeState("the stochastic rounding's random generator")

    @dataclass
    class Options:
        bits: int = 8  # bits per element on the wire (2-8); codes in 2-, 4- or 8-bit slots
        levels: int | None = None  # quantisation levels s; None: 2^(bits-1) - 1, the most that fit
        bucket_size: int = 512  # elements sharing one norm (QSGD's bucket d)
        norm: str = "l2"  # bucket norm: l2 (QSGD) or max (lower variance)

        def validate(self) -> None:
            if not 2 <= self.bits <= 8:
                raise ValueError(f"bits must be between 2 and 8, got {self.bits}")
            if self.levels is not None and not 1 <= self.levels <= default_levels(self.bits):
                raise ValueError(f"levels must be between 1 and {default_levels(self.bits)} for "
                                 f"{self.bits} bits, got {self.levels}")
            if self.bucket_size < 1:
                raise ValueError(f"bucket_size must be at least 1, got {self.bucket_size}")
            if self.norm not in NORMS:
                raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")

    def setup(self) -> None:
        super().setup()
        o = self.options
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.quantizer = QSGDQuantizer(o.bits, o.levels, o.bucket_size, o.norm)
        self.generator = rank_generator(self.ctx.seed, self.comm.rank, QSGD_STREAM, self.params[0].device)

    def after_backward(self, info: StepInfo) -> None:
        flat = flat_grads(self.params)
        n = flat.numel()
        with self.comm.reduction():
            packed, norms = self.quantizer.encode(flat, self.generator)
            all_packed = self.comm.all_gather(packed)
            all_norms = self.comm.all_gather(norms.to(torch.float32))
        mean = torch.zeros(n, dtype=torch.float32, device=flat.device)
        for r in range(self.comm.size):  # rank order: every replica sums identically
            mean += self.quantizer.decode(all_packed[r], all_norms[r], n)
        mean /= self.comm.size
        write_grads(self.params, mean.to(flat.dtype))

    def metrics(self) -> dict[str, float]:
        return {"message_bytes": float(self.quantizer.message_bytes(self.numel))}

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])
