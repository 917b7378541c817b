"""Test loss and accuracy of a run's evaluation model, computed by all ranks together."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F


@torch.no_grad()
def evaluate(model: torch.nn.Module, data, x: torch.Tensor, y: torch.Tensor, batch: int,
             device: torch.device) -> tuple[float, float]:
    """Test loss and accuracy (%) of ``model`` on ``(x, y)``; ``data.normalise`` prepares inputs."""
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for i in range(0, len(y), batch):
        xb = data.normalise(x[i:i + batch]).to(device)
        yb = y[i:i + batch].to(device)
        out = model(xb)
        loss_sum += F.cross_entropy(out, yb, reduction="sum").item()
        correct += (out.argmax(1) == yb).sum().item()
    model.train(was_training)
    return loss_sum / len(y), 100.0 * correct / len(y)


def evaluate_on_main(algo, data, eval_batch: int, rt) -> tuple[float, float]:
    """Test loss and accuracy of rank 0's evaluation model on ``data``'s test set.

    Replicas can differ (local SGD), so rank 0's parameters and buffers are broadcast into a
    copy on every rank, each rank scores its slice of the test set, and the sums are added.
    This traffic is evaluation, not the method's: it bypasses the Communicator."""
    model = algo.eval_model
    if rt.world_size > 1:
        model = copy.deepcopy(model)
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
    part = torch.arange(rt.rank, len(data.test_y), rt.world_size)  # host-side: indexes the host test set
    loss, acc = evaluate(model, data, data.test_x[part], data.test_y[part], eval_batch, rt.device)
    sums = torch.tensor([loss * len(part), acc * len(part), len(part)], dtype=torch.float64,
                        device=rt.device)
    if rt.world_size > 1:
        dist.all_reduce(sums)
    return sums[0].item() / sums[2].item(), sums[1].item() / sums[2].item()
