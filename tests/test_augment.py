"""Keyed draws and the augmentation recipes: a sample's augmentation depends on (seed, epoch,
sample) alone, the batched CIFAR crop equals the per-sample recipe it replaces, and the
RandomResizedCrop boxes keep torchvision's bounds."""

import pytest
import torch
import torch.nn.functional as F

from commlab.data.augment import pad_crop_flip, resized_crop_box, train_image
from commlab.data.keyed import keyed_bits, keyed_int, keyed_uniform


def test_keyed_draws_depend_on_the_key_alone():
    index = torch.arange(1000)
    a = keyed_bits(3, 1, index, 0)
    # the same sample drawn alone, in another order, or beside others gives the same bits
    assert torch.equal(keyed_bits(3, 1, index.flip(0), 0).flip(0), a)
    assert keyed_bits(3, 1, torch.tensor(517), 0).item() == a[517].item()
    # every component of the key changes them
    for other in (keyed_bits(4, 1, index, 0), keyed_bits(3, 2, index, 0), keyed_bits(3, 1, index + 1, 0),
                  keyed_bits(3, 1, index, 1)):
        assert (other != a).float().mean() > 0.99
    assert 0 <= int(a.min()) and int(a.max()) < 2**32
    u = keyed_uniform(0, 0, torch.arange(100_000), 0)
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    counts = torch.bincount(keyed_int(0, 0, torch.arange(90_000), 5, 9), minlength=9)
    assert counts.min() > 9500 and counts.max() < 10500  # 10,000 each


def _reference_crop_flip(x, dx, dy, flip, pad=4):
    """The per-sample recipe of the earlier loop (padded crop, then flip), given the same draws."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    out = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    out[flip] = out[flip].flip(-1)
    return out


@pytest.mark.parametrize("shape", [(64, 3, 32, 32), (16, 1, 28, 28)])
def test_batched_crop_flip_equals_the_per_sample_recipe(shape):
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    index = torch.arange(500, 500 + shape[0])
    out = pad_crop_flip(x, 7, 2, index)
    dx, dy = keyed_int(7, 2, index, 0, 9), keyed_int(7, 2, index, 1, 9)
    flip = keyed_uniform(7, 2, index, 2) < 0.5
    assert torch.equal(out, _reference_crop_flip(x, dx, dy, flip))
    assert 0 < flip.sum() < shape[0] and len(set(dx.tolist())) > 3  # the draws vary
    # a sample's crop is the same in any batch: here alone
    assert torch.equal(pad_crop_flip(x[5:6], 7, 2, index[5:6]), out[5:6])


def test_resized_crop_boxes_stay_in_torchvision_bounds():
    boxes = [resized_crop_box(500, 375, 0, 0, i) for i in range(400)]
    for top, left, h, w in boxes:
        assert 0 <= top and top + h <= 375 and 0 <= left and left + w <= 500
        area, ratio = h * w / (500 * 375), w / h
        assert 0.07 < area <= 1.0 and 3 / 4 * 0.95 < ratio < 4 / 3 * 1.05
    areas = [h * w / (500 * 375) for _, _, h, w in boxes]
    assert min(areas) < 0.15 and max(areas) > 0.85  # the whole range is drawn
    assert resized_crop_box(500, 375, 0, 0, 7) == boxes[7]  # keyed: the same box again
    # an image so narrow no try fits: the centre crop of the clamped ratio
    top, left, h, w = resized_crop_box(400, 20, 0, 0, 3)
    assert (h, w) == (20, round(20 * 4 / 3)) and left == (400 - w) // 2 and top == 0


def test_train_image_is_a_flipped_resized_crop_of_its_box():
    from PIL import Image
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    img = Image.fromarray(torch.randint(0, 256, (60, 80, 3), dtype=torch.uint8).numpy())
    out = train_image(img, 32, 1, 0, 11)
    top, left, h, w = resized_crop_box(80, 60, 1, 0, 11)
    crop = TF.pil_to_tensor(TF.resized_crop(img, top, left, h, w, [32, 32], InterpolationMode.BILINEAR,
                                            antialias=True))
    flipped = keyed_uniform(1, 0, torch.tensor(11), 2).item() < 0.5
    assert out.dtype == torch.uint8 and out.shape == (3, 32, 32)
    assert torch.equal(out, crop.flip(-1) if flipped else crop)
