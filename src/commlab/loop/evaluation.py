"""The test metrics of a run's evaluation model, computed by all ranks together (the task scores;
:mod:`commlab.loop.tasks`)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist


def evaluate_on_main(algo, task, rt) -> dict[str, float]:
    """The task's test metrics of rank 0's evaluation model.

    Replicas can differ (local SGD), so rank 0's parameters and buffers are broadcast into a
    copy on every rank, each rank scores its share of the test set (``task.eval_part``: means
    and a count), and the means, weighted by the counts, are added over ranks. This traffic is
    evaluation, not the method's: it bypasses the Communicator."""
    model = algo.eval_model
    if rt.world_size > 1:
        model = copy.deepcopy(model)
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
    was_training = model.training
    model.eval()
    try:
        means, n = task.eval_part(model, rt.rank, rt.world_size)
    finally:
        model.train(was_training)
    keys = list(means)  # the task's order: the buffer's layout decides how a reduction groups its sums
    sums = torch.tensor([means[k] * n for k in keys] + [n], dtype=torch.float64,
                        device=rt.device)  # gloo reduces CUDA tensors too
    if rt.world_size > 1:
        dist.all_reduce(sums)
    total = sums[-1].item()
    return task.eval_metrics({k: sums[i].item() / total if total else float("nan") for i, k in enumerate(keys)})
