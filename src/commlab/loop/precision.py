"""The numeric precision of a run's training step: ``train.precision`` and ``train.tf32``
(docs/paper-scale.md, "Precision").

* ``precision: fp32`` (default): everything in float32.
* ``precision: bf16``: the forward pass and the loss run under ``torch.autocast`` with bfloat16, on
  CUDA and on the CPU alike (so that the CPU tests run it). Autocast computes the matmuls and
  convolutions on bfloat16 copies of the weights; the parameters stay float32, autograd accumulates
  their gradients in float32, and everything a method derives from the gradients (residuals and
  error feedback, momentum, compression, PowerSGD's factors, QSGD's norms) is float32 too. bfloat16
  has float32's exponent range: no loss scaling. Evaluations run in float32.
* ``tf32: true`` lets CUDA compute float32 matmuls and cuDNN convolutions in TensorFloat-32
  (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``): faster on
  Ampere and later GPUs, with a 10-bit mantissa in the products. Off by default, in both
  (torch itself lets cuDNN use TF32 unless told not to), so that float32 means the float32 the
  papers trained in; without a GPU it changes nothing.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "bf16")


def configure_tf32(train: dict) -> None:
    """Allow or forbid TF32 in CUDA matmuls and cuDNN convolutions for this process."""
    allowed = bool(train.get("tf32", False))
    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed


def autocast(train: dict, device: torch.device) -> contextlib.AbstractContextManager:
    """The context of a training step's forward pass and loss: bfloat16 autocast on ``device``'s
    type for ``precision: bf16``, nothing for fp32."""
    precision = train.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
