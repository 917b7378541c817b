"""Momentum-corrected residual gradient compression, DGC's scheme as RedSync runs it: what
``redsync`` and ``dgc`` share (:mod:`commlab.algorithms.redsync`, :mod:`commlab.algorithms.dgc`;
Lin et al., "Deep Gradient Compression", ICLR 2018; Fang et al., RedSync, arXiv 1808.04357).

Per layer and step, on every worker (g: this worker's gradient of the layer, m: momentum)::

    u = m*u + g                      momentum correction (the optimizer itself has no momentum)
    v = v + u                        residual accumulation        (Nesterov: v = v + m*u + g)
    S = select(v, k)                 k = ceil(density * n), the method's selector for the layer's size
    send (S, v[S]);  u[S] = v[S] = 0 momentum factor masking
    grad = (sum over ranks of scatter(S_j, v_j[S])) / P;   plain SGD step with it

Layers of at most ``dense_at_most`` (1024) elements are averaged dense, and keep their momentum
(nothing is delayed, so nothing is masked: at density 1.0 the update is momentum SGD on the
averaged gradient exactly). All compressed layers of a step travel in one allgather of variable
length: indices and the values' bit patterns packed in one integer message (int32 words below
2^31 elements in all, int64 above), with the counts gathered first
(:func:`commlab.core.sparse.allgatherv_pairs`) unless every compressed layer's selector returns
exactly k entries (exact and trimmed top-k), when every rank already knows them. Weight decay
(``train.weight_decay``) is added to the gradient before compression, after the optional local
clipping (``local_clip``: each worker's gradient norm at most ``local_clip / sqrt(P)``); the
density warms up by stages (``warmup``). The sign-and-mean quantised form (a method's
:attr:`~MomentumCorrectedCompression.quantized`) sends, of the selected entries, those of one sign
(positive on even steps, negative on odd ones) as indices plus one mean per layer; ``v`` keeps
``v - mean`` there, so the residual stays conserved.

Invariants: every rank sums the same pairs in a canonical order, so the replicas stay bitwise
equal; the residual ``v`` plus what was sent is what was accumulated.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from commlab.algorithms.base import Algorithm, OptimizerSettings, StepInfo
from commlab.compress.base import index_dtype, k_for_density
from commlab.core.sparse import allgatherv_pairs, reduce_pairs
from commlab.registry import SELECTORS

WARMUP_DENSITIES = [0.25, 0.0625, 0.015625, 0.004]  # DGC's exponential warm-up, one per stage


@dataclass
class CompressionOptions:
    """Options shared by ``redsync`` and ``dgc`` (``dgc``'s all)."""

    density: float = 0.001  # k = ceil(density * n) per compressed layer (the paper's 0.1%)
    momentum: float | None = None  # m of the momentum correction; None: the run's train.momentum
    nesterov: bool | None = None  # Nesterov correction; None: the run's train.nesterov
    dense_at_most: int = 1024  # layers of at most this many elements are allreduced dense
    warmup: bool = False  # density warm-up: warmup_densities stage by stage, then density
    warmup_densities: list[float] = field(default_factory=lambda: list(WARMUP_DENSITIES))  # per stage
    warmup_stage_epochs: float = 1.0  # epochs per warm-up stage
    local_clip: float | None = None  # clip each worker's gradient norm to local_clip/sqrt(P); None: off

    def validate(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.dense_at_most < 0:
            raise ValueError(f"dense_at_most must be >= 0, got {self.dense_at_most}")
        if not isinstance(self.warmup_densities, list) or \
                not all(isinstance(d, (int, float)) and 0 < d <= 1 for d in self.warmup_densities):
            raise ValueError(f"warmup_densities must be a list of numbers in (0, 1], got {self.warmup_densities}")
        if self.warmup_stage_epochs <= 0:
            raise ValueError(f"warmup_stage_epochs must be positive, got {self.warmup_stage_epochs}")
        if self.local_clip is not None and self.local_clip <= 0:
            raise ValueError(f"local_clip must be positive or null, got {self.local_clip}")


def warmup_density(progress_epochs: float, options: CompressionOptions) -> float:
    """The density at ``progress_epochs`` (fractional epochs since the start)."""
    if options.warmup:
        stage = int(progress_epochs // options.warmup_stage_epochs)
        if stage < len(options.warmup_densities):
            return max(float(options.warmup_densities[stage]), options.density)
    return options.density


@dataclass
class Layer:
    """One parameter's compression state: momentum ``u`` and residual ``v`` (flat)."""

    param: torch.nn.Parameter
    u: torch.Tensor
    v: torch.Tensor
    selector_name: str | None  # None: always dense (tiny layer)
    selector: object = None
    offset: int = 0  # start in the flat index space of the compressed layers
    last_indices: torch.Tensor | None = None  # local indices sent at the last step (None: dense)

    @property
    def n(self) -> int:
        return self.u.numel()


class MomentumCorrectedCompression(Algorithm):
    """Momentum-corrected residual compression (the module docstring); a method on it says which
    selector finds each layer's k entries (:meth:`selector_for`) and whether it sends the
    sign-and-mean quantised form (:attr:`quantized`)."""

    Options = CompressionOptions

    # ---- policy (what each method chooses) -----------------------------------------------------
    def selector_for(self, n: int) -> str | None:
        """Registered selector for a layer of ``n`` elements, or None to send it dense."""
        raise NotImplementedError

    def make_selector(self, name: str):
        return SELECTORS.get(name)()

    @property
    def quantized(self) -> bool:
        return False

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def loop_optimizer(cls, options: CompressionOptions, run: OptimizerSettings) -> OptimizerSettings:
        """Plain SGD at the run's learning rate: momentum and weight decay live in the compressor."""
        if run.name != "sgd":
            raise ValueError(f"{cls.__name__} needs train.optimizer 'sgd' (momentum lives in the "
                             f"compressor), got {run.name!r}")
        return dataclasses.replace(run, momentum=0.0, nesterov=False, weight_decay=0.0)

    def setup(self) -> None:
        super().setup()
        o, run = self.options, self.ctx.run_optimizer
        self.m = run.momentum if o.momentum is None else float(o.momentum)
        self.nesterov = run.nesterov if o.nesterov is None else bool(o.nesterov)
        self.weight_decay = run.weight_decay
        self.layers: list[Layer] = []
        offset = 0
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            flat = p.detach().reshape(-1)
            name = self.selector_for(flat.numel())
            layer = Layer(p, torch.zeros_like(flat), torch.zeros_like(flat), name,
                          self.make_selector(name) if name else None, offset)
            offset += flat.numel() if name else 0
            self.layers.append(layer)
        self.n_compressed = offset
        self.n_total = sum(layer.n for layer in self.layers)
        self.density = o.density
        self._dense_out: torch.Tensor | None = None  # decompression buffer of the compressed layers
        self.totals: dict[str, float] = defaultdict(float)  # cumulative counters (checkpointed)

    # ---- one step ------------------------------------------------------------------------------
    def after_backward(self, info: StepInfo) -> None:
        with torch.no_grad():
            self.density = warmup_density(info.step / max(1, self.ctx.steps_per_epoch), self.options)
            grads = self._local_gradients()
            dense, sparse = [], []
            for layer, g in zip(self.layers, grads, strict=True):
                self._correct(layer, g)
                k = k_for_density(layer.n, self.density)
                (sparse if layer.selector_name and k < layer.n else dense).append((layer, k))
            messages = [self._compress(layer, k, info.step) for layer, k in sparse]
            with self.comm.reduction():
                self._sync_dense([layer for layer, _ in dense])
                self._sync_sparse([layer for layer, _ in sparse], messages)
            self._count(dense, sparse, messages)

    def _local_gradients(self) -> list[torch.Tensor]:
        """This worker's flat gradients, locally clipped, plus weight decay."""
        grads = [(layer.param.grad.reshape(-1) if layer.param.grad is not None else torch.zeros_like(layer.u))
                 for layer in self.layers]
        if self.options.local_clip is not None:
            limit = self.options.local_clip / math.sqrt(self.comm.size)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            # on the device (no host read): a factor of 1 below the limit
            scale = torch.where(norm > limit, limit / (norm + 1e-6), torch.ones_like(norm))
            grads = [g * scale for g in grads]
        if self.weight_decay:
            grads = [g + self.weight_decay * layer.param.detach().reshape(-1)
                     for g, layer in zip(grads, self.layers, strict=True)]
        return grads

    def _correct(self, layer: Layer, g: torch.Tensor) -> None:
        """Momentum correction and residual accumulation (Nesterov: v += m*u + g)."""
        torch.add(g, layer.u, alpha=self.m, out=layer.u)  # u = m*u + g in one pass
        if self.nesterov:
            layer.v.add_(layer.u, alpha=self.m).add_(g)
        else:
            layer.v.add_(layer.u)

    def _compress(self, layer: Layer, k: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Select, mask and return (local indices, values or the one-element mean)."""
        key = f"{layer.selector_name}_n{layer.n}"
        with self.ctx.clock.timed(layer.v.device, lambda seconds: self._selection_seconds(key, seconds)):
            idx = layer.selector(layer.v, k)
        values = layer.v[idx]
        if self.quantized:
            keep = values > 0 if step % 2 == 0 else values < 0
            idx, values = idx[keep], values[keep]
            mean = values.mean().reshape(1) if idx.numel() else values.new_zeros(1)
            layer.v[idx] -= mean  # v keeps the quantisation error: conserved
            values = mean
        else:
            layer.v[idx] = 0
        layer.u[idx] = 0  # momentum factor masking
        layer.last_indices = idx
        self.comm.stats.add_selection(idx.numel())
        self.totals[f"select_calls_{key}"] += 1
        return idx, values

    def _selection_seconds(self, key: str, seconds: float) -> None:
        """A clock sink: one selection's seconds (device time on CUDA, read at the log point)."""
        self.comm.stats.add_selection(0, seconds)
        self.totals[f"select_s_{key}"] += seconds

    def _sync_dense(self, layers: list[Layer]) -> None:
        """Allreduce (average) the residuals of the dense layers; no masking (nothing delayed)."""
        if not layers:
            return
        flat = torch.cat([layer.v for layer in layers])
        self.comm.all_reduce(flat, op="avg")
        offset = 0
        for layer in layers:
            self._write_grad(layer, flat[offset:offset + layer.n])
            layer.v.zero_()
            layer.last_indices = None
            offset += layer.n

    def _sync_sparse(self, layers: list[Layer], messages: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One variable-length allgather for all compressed layers, then scatter-add / P."""
        if not layers:
            return
        p = self.comm.size
        itype = index_dtype(self.n_compressed)
        idx = torch.cat([i + layer.offset for (i, _), layer in zip(messages, layers, strict=True)]).to(itype)
        if self._dense_out is None:  # reused every step: allocating it costs page faults
            self._dense_out = torch.empty(self.n_compressed, dtype=layers[0].v.dtype, device=layers[0].v.device)
        out = self._dense_out.zero_()
        if self.quantized:
            means = torch.cat([mean for _, mean in messages])
            parts = self.comm.all_gatherv(idx)
            all_means = self.comm.all_gather(means)  # (P, layers)
            starts = torch.tensor([layer.offset for layer in layers], dtype=torch.int64, device=out.device)
            for rank, part in enumerate(parts):
                which = torch.searchsorted(starts, part.long(), right=True) - 1
                out.index_add_(0, part.long(), all_means[rank][which] / p)
        else:
            values = torch.cat([v for _, v in messages])
            # selectors that return exactly k give every rank the same, known count
            known = [values.numel()] * p if all(getattr(layer.selector, "exact_count", False)
                                                for layer in layers) else None
            all_idx, all_val, _ = allgatherv_pairs(self.comm, idx, values, self.n_compressed, known)
            # Every rank sums the same pairs on its own: in a canonical order, so that replicas stay
            # bitwise equal (CUDA's index_add_ adds duplicates in no fixed order). Divide the few
            # values, not the dense sum.
            u_idx, u_val = reduce_pairs(all_idx, all_val / p, self.n_compressed)
            out.index_copy_(0, u_idx, u_val)
        for layer in layers:
            self._write_grad(layer, out[layer.offset:layer.offset + layer.n])

    @staticmethod
    def _write_grad(layer: Layer, flat: torch.Tensor) -> None:
        p = layer.param
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(flat.view_as(p))

    # ---- accounting ----------------------------------------------------------------------------
    def _count(self, dense, sparse, messages) -> None:
        t = self.totals
        selected = sum(int(i.numel()) for i, _ in messages)
        t["steps"] += 1
        t["values_sent"] += selected + sum(layer.n for layer, _ in dense)
        t["selected"] += selected
        t["k"] += sum(k for _, k in sparse)
        t["compressed_elements"] += sum(layer.n for layer, _ in sparse)

    def metrics(self) -> dict[str, float]:
        """``density`` now; cumulative means: ``sent_fraction`` (values sent per step, dense layers
        included, over the model's size), ``selected_over_k`` and ``selected_fraction`` (compressed
        layers only); ``select_ms_<selector>_n<size>``: mean selection time per call per layer size."""
        t = self.totals
        out = {"density": self.density}
        if t["steps"]:
            out["sent_fraction"] = t["values_sent"] / (t["steps"] * self.n_total)
        if t["k"]:
            out["selected_over_k"] = t["selected"] / t["k"]
            out["selected_fraction"] = t["selected"] / t["compressed_elements"]
        for key, seconds in t.items():
            if key.startswith("select_s_"):
                name = key[len("select_s_"):]
                out[f"select_ms_{name}"] = 1000 * seconds / t[f"select_calls_{name}"]
        return out

    # ---- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"u": [layer.u.clone() for layer in self.layers],
                "v": [layer.v.clone() for layer in self.layers],
                "selectors": [layer.selector.state_dict() if hasattr(layer.selector, "state_dict") else None
                              for layer in self.layers],
                "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        for layer, u, v, sel in zip(self.layers, state["u"], state["v"], state["selectors"], strict=True):
            layer.u.copy_(u)
            layer.v.copy_(v)
            if sel is not None and hasattr(layer.selector, "load_state_dict"):
                layer.selector.load_state_dict(sel)
        self.totals = defaultdict(float, state.get("totals", {}))
