"""ASGD: asynchronous SGD with a parameter server, the baseline SSD-SGD and OD-SGD compare with
(Xu et al., arXiv 2005.06728 and 2012.05396: MXNet's ``dist_async`` key-value store; docs/asgd.md).

Workers push gradients and pull weights with no global barrier: the server applies each gradient
as it arrives, with the run's optimizer at the pushing worker's learning rate, and answers with
its current weights, on which that worker computes its next gradient. A gradient is thus applied
to weights that other workers' updates have moved since it was computed; its **staleness** is the
server's version (updates applied so far) minus the version the worker computed on.

The design on torch.distributed (why: docs/asgd.md):

* **The server is a thread of rank 0**, and every rank, rank 0 included, is a worker, so the run
  has the workers and the global batch of the other methods of its grid (the released scripts
  run one server beside their workers). The server keeps its own replica of the parameters
  (``eval_model``) and an optimizer over it (``ctx.build_optimizer``: the run's).
* **Pushes are served in arrival order** by point-to-point receives from any source
  (``Communicator.recv_any``), on a gloo group of the method's own (``Communicator.separate``):
  NCCL has no receive from any source, and a thread's traffic needs a group that no other thread
  uses. A push is a 16-byte header (kind, learning rate; float64) and the flat gradient; the pull
  is the reply, the flat weights after the update. Rank 0's own worker pushes and pulls in
  memory, under the server's lock: nothing goes on a wire.
* **What the loop adds**: the loop's log point (every ``train.log_every`` steps), evaluations and
  checkpoints are collectives of every rank, so they are barriers: between two of them workers
  run freely, and none can run more than ``log_every`` steps ahead of another, which bounds the
  staleness by about ``(P - 1) * log_every``; the paper grids log every 20-50 steps.
* At the end (``finish``) every worker tells the server it is done, and rank 0 broadcasts the
  server's weights: every rank then holds them (``replicated_tensors``), which the run evaluates.

Bytes (exact, per rank and step): a worker sends ``16 + 4n`` bytes in 2 messages and receives
``4n`` (n parameters in float32); rank 0 receives ``(P - 1)(16 + 4n)`` and sends ``(P - 1) 4n``.
The server thread records into counters of its own, which rank 0's hooks move into the run's
(``comm.stats``) at every step, all but the seconds: rank 0's ``comm_seconds`` stays its own
worker's, and the server's time is ``algo_server_comm_seconds`` (in receives and sends, waiting
for pushes included) and ``algo_server_apply_seconds``.

Per-step metrics (``algo_``, rank 0): ``staleness_mean`` and ``staleness_max`` over the updates
applied since the previous log point, ``staleness_mean_run``, ``server_version``, and the
server's seconds above.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque

import torch

from commlab.algorithms.base import Algorithm, NoOptions, QuickRun, ResumeState, StepInfo, SyncBudget
from commlab.algorithms.tensors import flat_grads, unflatten_into
from commlab.core.communicator import Communicator
from commlab.core.stats import CommStats
from commlab.registry import ALGORITHMS

PUSH, DONE = 1.0, 0.0  # a header's kind
HISTORY = 65_536  # updates remembered (worker, base version, version, lr): tests replay them
# The server waits for pushes across evaluations and checkpoints (minutes at ImageNet scale); a dead
# peer is still caught within timeout_s by the loop's collectives, and the launcher ends the job.
SERVER_TIMEOUT_S = 24 * 3600.0


class _Relay(CommStats):
    """The server thread's counters, recorded under a lock and moved by rank 0's main thread into
    the run's (all but the seconds, which are the server's own)."""

    def __init__(self):
        super().__init__(wire=None)
        self.lock = threading.Lock()

    def record(self, *args, **kwargs):
        with self.lock:
            return super().record(*args, **kwargs)

    def _sink(self, key, record):
        add = super()._sink(key, record)

        def locked(seconds: float) -> None:  # the clock reports from the server thread
            with self.lock:
                add(seconds)
        return locked

    def move_into(self, stats: CommStats) -> float:
        """Add the counters into ``stats`` and reset them; return the seconds recorded."""
        with self.lock:
            for key, value in self.counters.items():
                if not key.endswith("_seconds"):
                    stats.counters[key] += value
            for op, mine in self.by_op.items():
                theirs = stats.by_op.setdefault(op, {k: 0 for k in mine})
                for key, value in mine.items():
                    theirs[key] += value
            if stats.keep_calls:
                stats.calls.extend(self.calls)
            seconds = self.counters["comm_seconds"]
            self.counters = {k: 0 for k in self.counters}
            self.by_op, self.calls = {}, type(self.calls)(maxlen=self.calls.maxlen)
        return seconds


@ALGORITHMS.register("asgd")
class AsynchronousSGD(Algorithm):
    """Workers push gradients to a server thread on rank 0, which applies them in arrival order."""

    Options = NoOptions
    comm_pattern = "parameter_server"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "asynchronous"
    # Its steps mark no reduction (the bench's kind "local"); the push and the pull wait on the
    # network, not on the device, and the server thread is not the step's.
    host_sync_budget = SyncBudget({"local": 0})
    quick_run = QuickRun()  # no options
    resume = ResumeState("rank 0: the server's replica, its optimizer, version and staleness records",
                         inexact="the server applies pushes in arrival order, which the ranks' timing decides")

    # ---- construction -----------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()  # every replica starts from rank 0's parameters
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.weights = torch.empty(self.numel, dtype=self.params[0].dtype, device=self.ctx.device)  # pulls
        self.is_server = self.comm.rank == 0
        self.p2p: Communicator | None = None
        if self.comm.size > 1:
            self.relay = _Relay() if self.is_server else None
            self.p2p = self.comm.separate(stats=self.relay or self.comm.stats, timeout_s=SERVER_TIMEOUT_S)
        if self.is_server:
            self.server_model = copy.deepcopy(self.model)
            self.server_params = [p for p in self.server_model.parameters() if p.requires_grad]
            for sp in self.server_params:
                sp.grad = torch.zeros_like(sp)
            self.server_opt = self.ctx.build_optimizer(self.server_params)  # the run's optimizer
            self.applied = threading.Condition()  # the server's lock; notified after every update
            self.version = 0  # updates applied
            self.base = [0] * self.comm.size  # the version each worker computes its next gradient on
            self.pushes = [0] * self.comm.size  # updates applied per worker
            self.history: deque[tuple[int, int, int, float]] = deque(maxlen=HISTORY)
            self.window = {"n": 0, "sum": 0, "max": 0}  # staleness since the last log point
            self.totals = {"n": 0, "sum": 0, "server_comm_seconds": 0.0, "server_apply_seconds": 0.0}
            self.thread: threading.Thread | None = None
            self.error: BaseException | None = None

    @property
    def eval_model(self) -> torch.nn.Module:
        """Rank 0: the server's replica once every worker's pushes of the steps taken so far are
        applied (the other ranks are then at the evaluation's broadcast), with this rank's buffers."""
        if not self.is_server:
            return self.model
        with self.applied:
            self._wait_for_workers()
            with torch.no_grad():
                for mine, local in zip(self.server_model.buffers(), self.model.buffers(), strict=True):
                    mine.copy_(local)
        return self.server_model

    # ---- the hooks ----------------------------------------------------------------------------
    def after_backward(self, info: StepInfo) -> None:
        """Push this rank's gradient, pull the weights the server answers with; the loop's
        optimizer then has nothing to do (gradients set to None, which torch optimizers skip)."""
        if self.ctx.grad_clip:  # as the loop clips a synchronised gradient, before it leaves
            torch.nn.utils.clip_grad_norm_(self.params, self.ctx.grad_clip)
        grad = flat_grads(self.params)
        if self.is_server:
            self._check_server()
            with self.applied:
                self._apply(0, grad, info.lr)
                torch.cat([sp.detach().reshape(-1) for sp in self.server_params], out=self.weights)
            self._move_stats()
        else:
            # host-side: the header travels on the gloo group and is read on the host
            header = torch.tensor([PUSH, info.lr], dtype=torch.float64)
            self.p2p.send(header, 0)
            self.p2p.send(grad, 0)
            self.p2p.recv(self.weights, 0)
        unflatten_into(self.weights, self.params)
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """Every worker says it is done; rank 0 waits for the server to serve them all, then
        broadcasts its weights, which every rank keeps."""
        if self.comm.size > 1:
            if self.is_server:
                self._check_server()  # started, if this process took no step, to hear the others
                self.thread.join()
                self._check_server()
                self._move_stats()
            else:
                self.p2p.send(torch.tensor([DONE, 0.0], dtype=torch.float64), 0)  # host-side: a header
        if self.is_server:
            torch.cat([sp.detach().reshape(-1) for sp in self.server_params], out=self.weights)
        if self.comm.size > 1:
            self.comm.broadcast(self.weights, src=0)
        unflatten_into(self.weights, self.params)

    def metrics(self) -> dict[str, float]:
        if not self.is_server:
            return {}
        with self.applied:
            w, t = self.window, self.totals
            out = {"staleness_mean": w["sum"] / w["n"] if w["n"] else 0.0, "staleness_max": float(w["max"]),
                   "staleness_mean_run": t["sum"] / t["n"] if t["n"] else 0.0, "server_version": float(self.version),
                   "server_comm_seconds": t["server_comm_seconds"],
                   "server_apply_seconds": t["server_apply_seconds"]}
            self.window = {"n": 0, "sum": 0, "max": 0}
        return out

    # ---- the server -----------------------------------------------------------------------------
    def _apply(self, worker: int, grad: torch.Tensor, lr: float) -> None:
        """One update of the server's replica with ``worker``'s gradient (the lock is held)."""
        t0 = time.perf_counter()
        staleness = self.version - self.base[worker]
        unflatten_into(grad, [sp.grad for sp in self.server_params])
        for group in self.server_opt.param_groups:
            group["lr"] = lr
        self.server_opt.step()
        self.history.append((worker, self.base[worker], self.version, lr))
        self.version += 1
        self.base[worker] = self.version  # the reply carries this version
        self.pushes[worker] += 1
        self.window["n"] += 1
        self.window["sum"] += staleness
        self.window["max"] = max(self.window["max"], staleness)
        self.totals["n"] += 1
        self.totals["sum"] += staleness
        self.totals["server_apply_seconds"] += time.perf_counter() - t0
        self.applied.notify_all()

    def _serve(self) -> None:
        """The server thread: pushes in arrival order until every other worker is done."""
        # host-side: headers are read on the host
        header = torch.empty(2, dtype=torch.float64)
        grad = torch.empty_like(self.weights)
        reply = torch.empty_like(self.weights)
        remaining = self.comm.size - 1
        try:
            while remaining:
                worker = self.p2p.recv_any(header)
                if header[0].item() == DONE:
                    remaining -= 1
                    continue
                self.p2p.recv(grad, worker)
                with self.applied:
                    self._apply(worker, grad, float(header[1]))
                    torch.cat([sp.detach().reshape(-1) for sp in self.server_params], out=reply)
                self.p2p.send(reply, worker)
        except BaseException as err:  # reported by the main thread at its next hook
            self.error = err

    def _check_server(self) -> None:
        """Start the server thread (at the first step: after a resume has loaded the state) and
        raise what stopped it, if anything did."""
        if self.comm.size > 1 and self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="asgd-server", daemon=True)
            self.thread.start()
        if self.error is not None:
            raise RuntimeError(f"the ASGD server thread failed: {self.error}") from self.error

    def _wait_for_workers(self) -> None:
        """Wait (lock held) until every worker's pushes have caught up with rank 0's."""
        while min(self.pushes) < self.pushes[0]:
            self._check_server()
            self.applied.wait(timeout=1.0)

    def _move_stats(self) -> None:
        if self.p2p is not None:
            seconds = self.relay.move_into(self.comm.stats)
            with self.applied:
                self.totals["server_comm_seconds"] += seconds

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Rank 0: the server (replica, optimizer, versions, counters), once every push of the
        steps taken is applied; the other ranks' state is their model, which the loop saves."""
        if not self.is_server:
            return {}
        self._move_stats()  # before the loop saves comm.stats
        with self.applied:
            self._wait_for_workers()
            return {"server_model": copy.deepcopy(self.server_model.state_dict()),
                    "server_optimizer": copy.deepcopy(self.server_opt.state_dict()),
                    "version": self.version, "base": list(self.base), "pushes": list(self.pushes),
                    "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        if not self.is_server:
            return
        with self.applied:
            self.server_model.load_state_dict(state["server_model"])
            self.server_opt.load_state_dict(state["server_optimizer"])
            self.version, self.base, self.pushes = state["version"], list(state["base"]), list(state["pushes"])
            self.totals.update(state["totals"])
