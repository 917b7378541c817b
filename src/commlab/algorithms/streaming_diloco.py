"""Streaming DiLoCo: DiLoCo's outer steps one fragment of the model at a time, overlapped with the
inner steps, mixed with the local model and sent in low precision (Douillard et al., "Streaming
DiLoCo with overlapping communication: Towards a Distributed Free Lunch", arXiv 2501.18512;
reference implementation: torchft's ``DiLoCo`` with several fragments, ``_StreamingDiLoCoFragment``).

The model's layers (each module holding parameters of its own, with its floating buffers; the
buffers of a module without parameters go with the layer before it) are split into F =
``fragments`` fragments: ``strided`` (layer j in fragment j mod F, the paper's choice) or
``sequential`` (contiguous runs of layers, the largest run as small as possible). Each fragment
gets DiLoCo's outer step (:mod:`commlab.algorithms.outer`, which :mod:`commlab.algorithms.diloco`
shares: the same outer optimizer, policies and anchor) every H = ``period`` inner steps, fragment
f offset by f * H / F. With h = H / F and k = 0, 1, ..., fragment f's allreduce starts after step
``(f + 1) h - 1 - tau + k H`` (0-based) and its outer step comes after step ``(f + 1) h - 1 + k H``,
tau = ``delay`` steps later::

    launch (step t - tau):  d_f = theta_f - x_f               # cast to outer_precision (fp32 | bf16)
                            allreduce(d_f) started            # comm.all_reduce_async: overlaps tau steps
    apply (step t):         wait                              # the Communicator records the blocked time
                            theta_f = OuterOpt(theta_f, sum_i d_f,i / P)   # divided in float32
                            x_f = (1 - alpha) theta_f + alpha x_f          # x_f: the local value at step t

The mixing is torchft's (``lerp`` of the outer result towards the local parameters by alpha):
alpha = 0 drops the tau local steps taken since the launch, alpha = 1 keeps the local model (the
outer step then moves the anchor only). The averaged buffers and inner optimizer state (by the
policies) are mixed the same way. With tau < h at most one fragment is in flight, and it is applied
before the next one starts; tau = 0 is a blocking allreduce (nothing to overlap).

Low precision: the pseudo-gradients travel in ``outer_precision``; a bf16 allreduce sums in
bfloat16 (float32's exponent range: no pre-division needed) and the sum is divided by P in
float32. The Communicator counts the bytes in the wire's dtype; buffers and optimizer state
(when averaged) travel in their own dtype.

Counting: each fragment's outer step is one global reduction (F of them every H steps). The bytes
each fragment's allreduces sent are the metrics ``algo_fragment<f>_bytes_sent``; the fragments'
sizes the run params ``fragment.<f>.numel``.

End of the run (``final_average``): mixing is off at the last step, and every fragment without an
outer step at that step gets one there from its current pseudo-gradient (one global reduction,
one allreduce per fragment), so the run ends with one model, bit for bit on every rank. A fragment
whose outer step would fall after the last step is not launched. One fragment with tau = 0 and
alpha = 0 is DiLoCo, bit for bit.

Checkpoints: a fragment in flight is waited for and its summed messages saved with its step; a
resumed run applies them at that step, as the uninterrupted run does.

torchft's ``DiLoCo`` over F model fragments computes what ``fragment_pattern: sequential``
(fragments of consecutive layers, as its examples pass them), ``outer_precision: fp32``,
``buffers: keep_local`` and ``final_average: false`` compute here, with its ``sync_every``,
``fragment_sync_delay`` and ``fragment_update_alpha`` as ``period``, ``delay`` and ``alpha``
(whose defaults there are 0 and 0): docs/diloco.md, "torchft's configuration".

Launch (4 CPU workers, 4 fragments, an outer step of each fragment every 100 steps)::

    torchrun --standalone --nproc-per-node 4 -m commlab train --config run.yaml method=streaming_diloco \\
        method_params.period=100 method_params.fragments=4 method_params.delay=2
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from commlab.algorithms.base import QuickRun, ResumeState, StepInfo, SyncBudget
from commlab.algorithms.outer import Exchange, Fragment, Message, OuterOptions, OuterStepAveraging, OuterSync
from commlab.options import Alias
from commlab.registry import ALGORITHMS

PATTERNS = ("strided", "sequential")
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_layers(model: nn.Module) -> list[tuple[list[nn.Parameter], list[torch.Tensor]]]:
    """The model's layers in module order: (parameters, floating buffers) of every module that
    holds parameters of its own. A module without parameters gives its buffers to the layer
    before it (the first layer when none is)."""
    layers: list[tuple[list[nn.Parameter], list[torch.Tensor]]] = []
    waiting: list[torch.Tensor] = []  # buffers met before the first layer
    seen: set[int] = set()
    for module in model.modules():
        params = [param for param in module.parameters(recurse=False) if id(param) not in seen]
        seen.update(id(param) for param in params)
        buffers = [buffer for buffer in module.buffers(recurse=False) if buffer.dtype.is_floating_point]
        if params:
            layers.append((params, waiting + buffers))
            waiting = []
        elif layers:
            layers[-1][1].extend(buffers)
        else:
            waiting += buffers
    return layers


def partition(sizes: list[int], count: int, pattern: str) -> list[list[int]]:
    """Layer indices of each of ``count`` fragments. ``strided``: layer j in fragment j mod count.
    ``sequential``: contiguous runs whose largest total size is as small as possible (the linear
    partition, by dynamic programming over the cut points)."""
    if count > len(sizes):
        raise ValueError(f"fragments={count} exceeds the model's {len(sizes)} layers with parameters")
    if pattern == "strided":
        return [list(range(first, len(sizes), count)) for first in range(count)]
    prefix = [0, *itertools.accumulate(sizes)]
    n = len(sizes)
    worst = [[float("inf")] * (n + 1) for _ in range(count + 1)]  # worst[k][j]: first j layers in k runs
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    worst[0][0] = 0
    for k in range(1, count + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                cost = max(worst[k - 1][i], prefix[j] - prefix[i])
                if cost < worst[k][j]:
                    worst[k][j], cut[k][j] = cost, i
    runs, j = [], n
    for k in range(count, 0, -1):
        runs.append(list(range(cut[k][j], j)))
        j = cut[k][j]
    return runs[::-1]


@dataclass
class InFlight:
    """A fragment's outer step on its way: launched ``delay`` steps before ``apply_step``."""

    exchange: Exchange
    apply_step: int

    def state(self) -> dict:
        """As a checkpoint holds it: the summed messages (waited for) and when they apply."""
        exchange = self.exchange
        OuterSync.complete(exchange)
        return {"fragment": exchange.fragment.index, "apply_step": self.apply_step,
                "bytes_sent": exchange.bytes_sent,
                "messages": [(message.flat.clone(), message.grad_numel) for message in exchange.messages]}

    @classmethod
    def restore(cls, sync: OuterSync, fragment: Fragment, state: dict) -> InFlight:
        """The outer step a checkpoint holds, its targets taken again from the live tensors (the
        loop loads the inner optimizer's state before the method's)."""
        by_dtype = sync.averaged_by_dtype(fragment)
        saved = state["messages"]
        device = fragment.anchors[0].device
        first_flat, grad_numel = saved[0]
        messages = [Message(first_flat.to(device), grad_numel, by_dtype.pop(first_flat.dtype, []))]
        messages += [Message(flat.to(device), 0, by_dtype.pop(flat.dtype)) for flat, _ in saved[1:]]
        return cls(Exchange(fragment, messages, state["bytes_sent"]), state["apply_step"])


@ALGORITHMS.register("streaming_diloco")
class StreamingDiLoCo(OuterStepAveraging):
    """DiLoCo one fragment at a time: fragment f's outer step every H steps, offset by f H / F,
    its allreduce started ``delay`` steps before, the result mixed by ``alpha`` (formulas and
    invariants: the module docstring).

    Example (on every rank of a gloo world)::

        driven = drive("streaming_diloco", {"period": 8, "fragments": 2, "delay": 1}, model=model,
                       steps=16, batches=batches)
        driven.algo.metrics()["fragment0_bytes_sent"]    # what fragment 0's allreduces sent
    """

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "periodic"
    host_sync_budget = SyncBudget({"local": 0, "reduction": 0})
    quick_run = QuickRun({"period": 4, "fragments": 2, "delay": 1})
    resume = ResumeState("DiLoCo's anchor and outer optimizer, the fragment allreduce in flight, bytes per fragment")

    @dataclass
    class Options(OuterOptions):
        """Streaming DiLoCo's options (and DiLoCo's); torchft's names are aliases:
        ``fragment_sync_delay`` for ``delay``, ``fragment_update_alpha`` for ``alpha``."""

        ALIASES: ClassVar[dict[str, Alias]] = {**OuterOptions.ALIASES, "fragment_sync_delay": Alias("delay"),
                                               "fragment_update_alpha": Alias("alpha")}

        period: int = 100  # inner steps between two outer steps of a fragment, H (a multiple of fragments)
        fragments: int = 2  # F: fragments synced in turn, one every H / F steps (at most the model's layers)
        fragment_pattern: str = "strided"  # strided (layer j in fragment j mod F) | sequential
        delay: int = 1  # tau: steps between a fragment's allreduce start and its outer step (< H / F)
        alpha: float = 0.5  # mixing: x = (1 - alpha) * outer result + alpha * local
        outer_precision: str = "bf16"  # fp32 | bf16: the dtype the pseudo-gradients are sent in

        def validate(self) -> None:
            super().validate()
            if self.fragments < 1:
                raise ValueError(f"fragments must be >= 1, got {self.fragments}")
            if self.period % self.fragments:
                raise ValueError(f"period must be a multiple of fragments={self.fragments}, got {self.period}")
            if self.fragment_pattern not in PATTERNS:
                raise ValueError(f"fragment_pattern must be one of {PATTERNS}, got {self.fragment_pattern!r}")
            spacing = self.period // self.fragments
            if not 0 <= self.delay < spacing:
                raise ValueError(f"delay must be in [0, period / fragments = {spacing}), got {self.delay}")
            if not 0 <= self.alpha <= 1:
                raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
            if self.outer_precision not in WIRE_DTYPES:
                raise ValueError(f"outer_precision must be one of {sorted(WIRE_DTYPES)}, got {self.outer_precision!r}")

    # ---- construction -----------------------------------------------------------------------
    def wire_dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.options.outer_precision]

    def make_fragments(self) -> list[Fragment]:
        layers = model_layers(self.model)
        anchor_of = dict(zip((id(param) for param in self.model.parameters()), self.anchors, strict=True))
        sizes = [sum(param.numel() for param in params) for params, _ in layers]
        runs = partition(sizes, self.options.fragments, self.options.fragment_pattern)
        fragments = []
        for index, run in enumerate(runs):
            params = [param for layer in run for param in layers[layer][0]]
            buffers = [buffer for layer in run for buffer in layers[layer][1]]
            fragments.append(Fragment(index, params, [anchor_of[id(param)] for param in params], buffers))
        return fragments

    def setup(self) -> None:
        super().setup()  # the anchor copy, the outer optimizer over it
        self.fragments = self.make_fragments()
        self.in_flight: InFlight | None = None
        self.fragment_bytes = [0] * len(self.fragments)

    # ---- the schedule -------------------------------------------------------------------------
    @property
    def spacing(self) -> int:
        """h = H / F: steps between two fragments' outer steps."""
        return self.options.period // self.options.fragments

    def _fragment_ending(self, step: int) -> int | None:
        """The fragment whose outer step comes after ``step`` (None: none)."""
        if (step + 1) % self.spacing:
            return None
        return ((step + 1) // self.spacing - 1) % self.options.fragments

    # ---- the hook -----------------------------------------------------------------------------
    def after_step(self, info: StepInfo) -> None:
        step, options = info.step, self.options
        self._steps = step + 1
        last = step == self.ctx.total_steps - 1
        starting = self._fragment_ending(step + options.delay)
        if starting is not None and step + options.delay < self.ctx.total_steps:
            with self.comm.reduction():
                exchange = self._launch(self.fragments[starting], blocking=options.delay == 0)
            self.in_flight = InFlight(exchange, step + options.delay)
        applied = None
        if self.in_flight is not None and self.in_flight.apply_step == step:
            exchange, self.in_flight = self.in_flight.exchange, None
            applied = exchange.fragment.index
            self._apply(exchange, 0.0 if last and options.final_average else options.alpha, info)
        if last and options.final_average:
            rest = [fragment for fragment in self.fragments if fragment.index != applied]
            if rest:
                with self.comm.reduction():
                    exchanges = [self._launch(fragment, blocking=True) for fragment in rest]
                for exchange in exchanges:
                    self._apply(exchange, 0.0, info)

    def _launch(self, fragment: Fragment, blocking: bool) -> Exchange:
        exchange = self.sync.launch(fragment, blocking)
        self.fragment_bytes[fragment.index] += exchange.bytes_sent
        return exchange

    def _apply(self, exchange: Exchange, alpha: float, info: StepInfo) -> None:
        self.sync.apply(exchange, alpha)
        self.schedule.after_sync(info.step, None, info.lr)  # counts the fragment's outer step

    def finish(self) -> None:
        """Nothing is in flight after the last step (no fragment is launched past it); a run
        stopped early applies what it started."""
        if self.in_flight is not None:
            self.sync.apply(self.in_flight.exchange, self.options.alpha)
            self.in_flight = None

    # ---- metrics, params, checkpoints ---------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["in_flight"] = float(self.in_flight is not None)
        out.update({f"fragment{index}_bytes_sent": float(sent) for index, sent in enumerate(self.fragment_bytes)})
        return out

    def run_params(self) -> dict[str, Any]:
        return {**super().run_params(),
                **{f"fragment.{fragment.index}.numel": fragment.numel for fragment in self.fragments}}

    def state_dict(self) -> dict:
        flight = self.in_flight
        return {**super().state_dict(), "fragment_bytes": list(self.fragment_bytes),
                "in_flight": None if flight is None else flight.state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.fragment_bytes = list(state.get("fragment_bytes", self.fragment_bytes))
        saved = state.get("in_flight")
        self.in_flight = None if saved is None else InFlight.restore(self.sync, self.fragments[saved["fragment"]],
                                                                     saved)
