"""CIFAR-style networks that also take 1-channel input: ResNet-20 (He et al. 2016, the 6n+2
family with n=3) and VGG-16 with batch norm. The ImageNet networks are torchvision's
(:mod:`commlab.models.imagenet`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commlab.registry import MODELS


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _resnet_cifar(depth: int, in_channels: int, num_classes: int) -> nn.Module:
    if (depth - 2) % 6:
        raise ValueError(f"CIFAR ResNet depth must be 6n+2, got {depth}")
    n = (depth - 2) // 6
    layers: list[nn.Module] = [nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(n):
            layers.append(_BasicBlock(cin, cout, stride if i == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


@MODELS.register("resnet20")
def resnet20(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """ResNet-20: 272k parameters."""
    return _resnet_cifar(20, in_channels, num_classes)


@MODELS.register("resnet44")
def resnet44(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """ResNet-44 (RedSync's CIFAR-10 net): 661k parameters."""
    return _resnet_cifar(44, in_channels, num_classes)


_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _vgg16_features(in_channels: int, image_size: int) -> tuple[list[nn.Module], int]:
    """VGG-16's convolutions with batch norm, and the side of the feature map they leave."""
    layers: list[nn.Module] = []
    cin, side = in_channels, image_size
    for v in _VGG16:
        if v == "M":
            # ceil_mode keeps 28x28 inputs valid through five pools (28-14-7-4-2-1).
            layers.append(nn.MaxPool2d(2, ceil_mode=True))
            side = (side + 1) // 2
        else:
            layers += [nn.Conv2d(cin, v, 3, padding=1, bias=False), nn.BatchNorm2d(v), nn.ReLU()]
            cin = v
    return layers, side


@MODELS.register("vgg16")
def vgg16(in_channels: int = 3, num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """VGG-16 with batch norm for 32x32 inputs (28x28 inputs are padded by the first pools)."""
    layers, side = _vgg16_features(in_channels, image_size)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * side * side, num_classes))


@MODELS.register("vgg16_fc")
def vgg16_fc(in_channels: int = 3, num_classes: int = 10, image_size: int = 32, fc_width: int = 4096) -> nn.Module:
    """VGG-16 with the original VGG's fully connected classifier (two ``fc_width``-wide hidden
    layers, 4096 as in the ImageNet VGG-16 of RedSync's release; its CIFAR VGG-16 is ``vgg16``),
    dropout: 34M parameters, with a 4096x4096 layer (16.8M elements) above RedSync's 4M threshold
    for its binary-search selector, and a 2.1M one for its trimmed top-k. A smaller ``fc_width``
    is for tests."""
    layers, side = _vgg16_features(in_channels, image_size)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * side * side, fc_width), nn.ReLU(), nn.Dropout(),
                         nn.Linear(fc_width, fc_width), nn.ReLU(), nn.Dropout(), nn.Linear(fc_width, num_classes))
