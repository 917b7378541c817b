"""A generated dataset for tests and volume-only runs: 10 classes of 28x28 grey images whose mean
pattern depends on the class, plus noise. Deterministic for a seed; nothing to download."""

from __future__ import annotations

import torch

from commlab.data.base import DatasetSpec, PreparedData
from commlab.registry import DATASETS


def generate(seed: int = 0, n_train: int = 4096, n_test: int = 1024) -> PreparedData:
    g = torch.Generator().manual_seed(12345)  # class patterns fixed across seeds
    patterns = torch.rand(10, 1, 28, 28, generator=g) * 60 + 70
    g.manual_seed(seed + 1)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=g)
        # Noise much larger than the pattern differences: learnable, but not in a few steps.
        x = patterns[y] + torch.randn(n, 1, 28, 28, generator=g) * 90
        return x.clamp(0, 255).to(torch.uint8), y

    train, test = draw(n_train), draw(n_test)
    return PreparedData(SPEC, *train, *test, meta={"name": "synthetic", "content_hash": f"synthetic-{seed}"})


SPEC = DATASETS.register("synthetic")(DatasetSpec(
    name="synthetic", channels=1, image_size=28, num_classes=10, mean=(0.5,), std=(0.25,),
    prepare=generate, generated=True,
))
