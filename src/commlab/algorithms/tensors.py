"""The methods' tensor toolkit: flatten lists of tensors into one message and back, read and write
gradients as one flat tensor, and group parameters into DDP-style buckets.

Every method sends flat tensors (one collective per message, not per layer), so these few
operations stand under all of them; they live here once.
"""

from __future__ import annotations

import torch


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat (detached) copy of ``tensors``, concatenated in order."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (the inverse of :func:`flatten`)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def grads_of(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient, zeros where it has none (a layer unused in this step)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """All gradients as one flat tensor (zeros for parameters without a gradient)."""
    return flatten(grads_of(params))


def restore_into(live: torch.Tensor | None, saved: torch.Tensor | None,
                 device: torch.device | None = None) -> torch.Tensor | None:
    """A checkpoint's tensor put where the run keeps it. Checkpoints load on the CPU
    (:func:`commlab.loop.checkpoint.load_checkpoint`); state that exists is copied into its live
    tensor (same storage and device, so every reference to it stays valid), lazily created state
    (``live`` is None) is moved to ``device``."""
    if saved is None or live is None:
        return saved if saved is None or device is None else saved.to(device)
    return live.copy_(saved)


def write_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Copy a flat tensor back into the parameters' gradients (creating missing ones)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    unflatten_into(flat, [p.grad for p in params])


def grad_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group parameters, in reverse order (the order backward produces them), into buckets of at
    least ``bucket_bytes`` (the last may be smaller), as DDP does."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
