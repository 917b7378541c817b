"""The augmentation recipes, with their random numbers keyed by (seed, epoch, sample).

* :func:`pad_crop_flip`: the CIFAR recipe of He et al. 2016 (section 4.2): 4-pixel zero padding,
  a random 32x32 crop, a horizontal flip with probability 1/2. Batched: one gather over a whole
  batch of uint8 images on the data's device (no loop over samples).
* :func:`resized_crop_box` + :func:`train_image` / :func:`eval_image`: the ImageNet recipes of
  torchvision and pytorch/examples' imagenet/main.py: RandomResizedCrop (scale 0.08-1 of the area,
  aspect ratio 3/4-4/3 log-uniform, ten tries, then a centre crop of the clamped ratio) and a flip
  for training; resize of the short side then a centre crop for evaluation. One decoded PIL image
  at a time, in the loader's workers.

Every draw comes from :mod:`commlab.data.keyed`, so a sample's augmentation is the same on any
rank, in any loader worker, and after a resume.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from commlab.data.keyed import keyed_bits, keyed_int, keyed_uniform

# Streams of the keyed draws: one per random quantity of a sample.
CROP_X, CROP_Y, FLIP = 0, 1, 2
RRC_TRIES = 10  # torchvision's RandomResizedCrop: ten tries before the centre-crop fallback
RRC_STREAM0 = 16  # try t draws from streams 16 + 4t .. 19 + 4t


def pad_crop_flip(x: torch.Tensor, seed: int, epoch: int, index: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Random ``pad``-pixel padded crop and horizontal flip of the uint8 batch ``x`` (N x C x H x W);
    ``index`` holds the samples' dataset indices, which key the draws."""
    n, c, h, w = x.shape
    index = index.to(x.device)
    dx = keyed_int(seed, epoch, index, CROP_X, 2 * pad + 1)
    dy = keyed_int(seed, epoch, index, CROP_Y, 2 * pad + 1)
    flip = keyed_uniform(seed, epoch, index, FLIP) < 0.5
    padded = F.pad(x, (pad, pad, pad, pad)).flatten(2)  # N x C x (H+2p)(W+2p)
    cols = torch.arange(w, device=x.device)
    cols = torch.where(flip[:, None], dx[:, None] + (w - 1) - cols, dx[:, None] + cols)  # N x W
    rows = dy[:, None] + torch.arange(h, device=x.device)  # N x H
    flat = (rows[:, :, None] * (w + 2 * pad) + cols[:, None, :]).view(n, 1, h * w)
    return padded.gather(2, flat.expand(n, c, h * w)).view(n, c, h, w)


def resized_crop_box(width: int, height: int, seed: int, epoch: int, index: int,
                     scale: tuple[float, float] = (0.08, 1.0),
                     ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box ``(top, left, height, width)`` for one image, as torchvision's
    ``RandomResizedCrop.get_params`` draws it, with keyed draws in place of the global generator."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    # Four draws per try (area, ratio, top, left), all at once.
    bits = keyed_bits(seed, epoch, torch.tensor(index), torch.arange(RRC_STREAM0, RRC_STREAM0 + 4 * RRC_TRIES)).tolist()
    for t in range(RRC_TRIES):
        u_area, u_ratio, b_top, b_left = bits[4 * t: 4 * t + 4]
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u_area / 2.0**32)
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u_ratio / 2.0**32)
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return b_top % (height - h + 1), b_left % (width - w + 1), h, w
    in_ratio = width / height  # fallback: centre crop of the whole image, ratio clamped
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def train_image(img, size: int, seed: int, epoch: int, index: int) -> torch.Tensor:
    """RandomResizedCrop to ``size`` x ``size`` and a flip with probability 1/2: uint8 C x H x W."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    top, left, h, w = resized_crop_box(img.width, img.height, seed, epoch, index)
    img = TF.resized_crop(img, top, left, h, w, [size, size], InterpolationMode.BILINEAR, antialias=True)
    if keyed_uniform(seed, epoch, torch.tensor(index), FLIP).item() < 0.5:
        img = TF.hflip(img)
    return TF.pil_to_tensor(img)


def eval_image(img, size: int, resize: int) -> torch.Tensor:
    """Resize of the short side to ``resize``, then a ``size`` x ``size`` centre crop: uint8 C x H x W."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    img = TF.resize(img, resize, InterpolationMode.BILINEAR, antialias=True)
    return TF.pil_to_tensor(TF.center_crop(img, [size, size]))
