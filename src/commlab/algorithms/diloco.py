"""DiLoCo: local steps with an inner optimizer, then an outer optimizer on the pseudo-gradient
(Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv
2311.08105, Algorithm 1; reference implementation: torchft's ``torchft/local_sgd.py``).

Every worker i takes ``period`` (the paper's H) local steps with the loop's optimizer, the
*inner* optimizer (the run's ``train.optimizer``; the paper's is AdamW), from the global model
theta (the *anchor*, the model of the last outer step). Then one global reduction::

    delta = mean_i (theta - x_i)     # the pseudo-gradient: one float32 allreduce of (theta - x_i)
    theta = OuterOpt(theta, delta)   # a torch.optim optimizer over an anchor copy of the parameters,
                                     # delta as its gradient
    x_i = theta                      # every worker restarts from the new global model

The outer optimizer (``outer_optimizer``) is a real ``torch.optim`` optimizer over the anchor copy,
built as the loop builds its own: ``nesterov`` (SGD with Nesterov momentum, DiLoCo's: ``outer_lr``
0.7, ``outer_momentum`` 0.9), ``sgd`` (heavy ball; ``outer_momentum`` 0: plain) or ``adam``
(``outer_betas``). No weight decay and no schedule: the outer learning rate is constant, as in
the paper. ``outer_momentum`` is SGD's and ``outer_betas`` Adam's; each is unused by the other.

DiLoCo is a member of the periodic-averaging family (:mod:`commlab.algorithms.periodic`): a fixed
schedule (an outer step after every H-th local step, and one after the run's last step with
``final_average``), the family's logged schedule params, metrics and policies. It relates to
``kstep`` (:mod:`commlab.algorithms.kstep`, the same period, ``phase: last``) so:

* ``sgd`` with ``outer_lr`` 1 and ``outer_momentum`` 0 gives theta = theta - (theta - mean x) =
  mean x: K-step averaging, equal to float tolerance (the pseudo-gradient and the outer step are
  two roundings the plain average has not).
* ``sgd`` with lr eta and momentum mu (torch: buf = mu buf + delta; theta -= eta buf) is kstep's
  classical block momentum with ``block_lr`` zeta = eta and ``momentum`` mu: with v = -eta buf,
  v = mu v + eta (mean x - theta); theta += v (:mod:`commlab.algorithms.averaging`).
* ``nesterov`` is not kstep's Nesterov block momentum. torch folds the look-ahead into theta
  (theta -= eta (delta + mu buf)) and measures the next pseudo-gradient from that point; BMUF keeps
  the anchor without the look-ahead, restarts the workers from anchor + mu v and measures from the
  anchor. The first outer steps agree; later ones differ (tests/test_diloco.py shows by how much).

At an outer step (the family's policies, chosen so that the choice is explicit):

* ``buffers``: ``average`` (default) replaces the floating buffers (BatchNorm running statistics)
  by their plain average, in the same allreduce as the pseudo-gradient: they are statistics, not
  trained, so no outer optimizer acts on them; ``keep_local`` leaves each worker its own.
* ``optimizer_state``: ``keep_local`` (default, as DiLoCo: each worker keeps its inner AdamW
  moments across outer steps) or ``average`` (plainly averaged in the same allreduce).

Invariants: every rank holds the same anchor and outer-optimizer state (the same averaged
pseudo-gradient, a deterministic step); after an outer step every replica equals the anchor bit
for bit; an outer step is one global reduction, an allreduce of the parameters' size (plus the
averaged buffers and optimizer state, in the same message when they share its dtype). The anchor
and the outer optimizer's state are checkpointed, so a resumed run is bitwise the uninterrupted one.

``evaluate``: ``rank0`` (default) scores rank 0's replica; ``global`` the anchor (the model of the
last outer step, with rank 0's buffers: what the paper evaluates, no communication); ``average``
the replicas' world average (uncounted, as kstep).

The anchor copy, the outer optimizer over it and the outer step's allreduce are
:mod:`commlab.algorithms.outer`'s, which Streaming DiLoCo shares; this module says when the outer
step happens and of what (the whole model, blocking). torchft's ``DiLoCo`` with one fragment
computes what ``buffers: keep_local`` and ``final_average: false`` compute here (it leaves buffers
alone and adds no outer step at the end): docs/diloco.md, "torchft's configuration".

Launch (4 CPU workers, AdamW-like inner steps, an outer step every 50)::

    torchrun --standalone --nproc-per-node 4 -m commlab train --config run.yaml method=diloco \\
        train.optimizer=adam train.lr=0.001 method_params.period=50
"""

from __future__ import annotations

from commlab.algorithms.base import QuickRun, ResumeState, SyncBudget
from commlab.algorithms.outer import Fragment, OuterOptions, OuterStepAveraging
from commlab.registry import ALGORITHMS


@ALGORITHMS.register("diloco")
class DiLoCo(OuterStepAveraging):
    """H local steps with the inner optimizer, then an outer optimizer step on the averaged
    pseudo-gradient (formulas, policies and invariants: the module docstring).

    Example (on every rank of a gloo world)::

        driven = drive("diloco", {"period": 4, "outer_lr": 0.7}, model=model, steps=8,
                       train={"optimizer": "adam", "lr": 1e-3}, batches=batches)
        driven.comm.stats.totals()["reductions_global"]     # after steps 3 and 7: 2
    """

    comm_pattern = "ring_allreduce"  # the cost model's formula (commlab.bench.costmodel.PATTERNS)
    family = "periodic"
    host_sync_budget = SyncBudget({"local": 0, "reduction": 0})
    quick_run = QuickRun({"period": 4})
    resume = ResumeState("the anchor (the global model), the outer optimizer's state and the schedule's counts")

    Options = OuterOptions

    def setup(self) -> None:
        super().setup()  # the anchor copy theta, the outer optimizer over it
        buffers = [buffer for buffer in self.model.buffers() if buffer.dtype.is_floating_point]
        self.whole_model = Fragment(0, list(self.model.parameters()), self.anchors, buffers)

    def global_reduction(self) -> None:
        """Algorithm 1's outer step, after every H-th inner step (the schedule calls it):
        delta = mean_i (theta - x_i) in one allreduce, theta = OuterOpt(theta, delta), x_i =
        theta. The family's variance V is not measured."""
        with self.comm.reduction():
            exchange = self.sync.launch(self.whole_model, blocking=True)
        self.sync.apply(exchange, alpha=0.0)
