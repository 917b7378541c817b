"""The loop's inputs: one run's train and test tensors, its step counts, and one rank's batches.

Every rank loads the same tensors (subsets applied) and takes its own slice of each global batch
(:func:`commlab.data.shard_indices`), so the samples of a step do not depend on the world size.
Augmentation is the CIFAR recipe (4-pixel padded random crop, horizontal flip), per sample, from
a generator of the rank's own that travels in every checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from commlab.data import load_dataset, shard_indices


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random 4-pixel-padded crop and horizontal flip (the CIFAR recipe), per sample."""
    n, _, h, w = x.shape
    padded = F.pad(x, (4, 4, 4, 4))
    # host-side: offsets and flips come from the CPU augmentation generator (one stream on any device)
    dx, dy = (torch.randint(0, 9, (n,), generator=gen) for _ in range(2))  # host-side (above)
    flip = torch.rand(n, generator=gen) < 0.5  # host-side (above)
    out = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    out[flip] = out[flip].flip(-1)
    return out


class RunData:
    """The run's dataset with ``train.train_subset`` / ``train.test_subset`` applied, and how many
    steps an epoch and the whole run take on ``world_size`` workers."""

    def __init__(self, config: dict, world_size: int):
        tcfg = config["train"]
        self.prepared = data = load_dataset(config["dataset"], config["data_dir"],
                                            verify=config.get("verify_data", False))
        self.spec, self.meta = data.spec, data.meta
        self.train_x, self.train_y = data.train_x, data.train_y
        if tcfg.get("train_subset"):
            self.train_x, self.train_y = self.train_x[: tcfg["train_subset"]], self.train_y[: tcfg["train_subset"]]
        self.test_x, self.test_y = data.test_x, data.test_y
        if tcfg.get("test_subset"):
            self.test_x, self.test_y = self.test_x[: tcfg["test_subset"]], self.test_y[: tcfg["test_subset"]]
        self.batch_size = tcfg["batch_size"]
        self.seed = config["seed"]
        self.steps_per_epoch = len(self.train_y) // (world_size * self.batch_size)
        if self.steps_per_epoch == 0:  # before anything is recorded: more workers than samples
            raise ValueError(f"{len(self.train_y)} training samples of {config['dataset']!r} cannot fill one step "
                             f"of {world_size} workers x batch {self.batch_size}; lower workers or train.batch_size")
        self.total_steps = self.steps_per_epoch * tcfg["epochs"]
        if tcfg.get("max_steps"):
            self.total_steps = min(self.total_steps, tcfg["max_steps"])

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return self.prepared.normalise(x)

    def epoch_batches(self, epoch: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's sample indices of ``epoch``, one row per step."""
        return shard_indices(len(self.train_y), world_size, rank, self.batch_size, epoch, self.seed)

    def batch(self, idx: torch.Tensor, aug_gen: torch.Generator, device: torch.device):
        """The normalised inputs and labels of the samples ``idx``, on ``device``."""
        xb = self.train_x[idx]
        if self.spec.augment:
            xb = augment(xb, aug_gen)
        return self.normalise(xb).to(device), self.train_y[idx].to(device)
