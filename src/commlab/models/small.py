"""Laptop-scale models: the ~220k-parameter CNN of the default runs and a tiny MLP for tests and
volume-scaling runs (where only message sizes matter)."""

from __future__ import annotations

import torch
from torch import nn

from commlab.registry import MODELS


@MODELS.register("cnn")
class SmallCNN(nn.Module):
    """Two 5x5 conv layers and two linear layers: about 218k parameters on 28x28 inputs."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
                 hidden: int = 160):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        side = ((image_size - 4) // 2 - 4) // 2
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * side * side, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@MODELS.register("mlp")
class TinyMLP(nn.Module):
    """One hidden layer on flattened pixels; fast enough for many-rank tests."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
                 hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@MODELS.register("wide_mlp")
class WideMLP(nn.Module):
    """A communication-heavy net: large fully connected layers, little compute per parameter."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
                 hidden: int = 1024):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
