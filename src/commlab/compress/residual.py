"""Residual (error-feedback) memory for sparse methods (Ok-Topk, PPoPP'22; RedSync, arXiv 1808.04357).

Each step a sparse method adds the new gradient to what it has not applied yet, sends part of the
sum, and keeps the rest for later::

    memory = ResidualMemory(n, torch.float32, device)
    acc = memory.accumulate(grad)          # acc = grad + residual (a new tensor)
    ...                                    # select, communicate; `applied` = indices of acc consumed
    memory.keep(acc, applied)              # residual = acc with the applied entries set to zero

So at any time, summed over ranks, the updates applied plus the residuals equal the gradients
computed: nothing is lost and nothing is applied twice. ``enabled=False`` drops what was not sent
(sparsification without error feedback), for ablations.
"""

from __future__ import annotations

import torch


class ResidualMemory:
    """The accumulated but not yet applied part of the gradient of one flat tensor."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device | str, enabled: bool = True):
        if n < 1:
            raise ValueError(f"a residual needs at least one element, got n={n}")
        self.enabled = enabled
        self.residual = torch.zeros(n, dtype=dtype, device=device)

    def accumulate(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` as a new flat tensor (the residual itself is not changed yet)."""
        flat = grad.reshape(-1)
        if flat.numel() != self.residual.numel():
            raise ValueError(f"gradient has {flat.numel()} elements, the residual {self.residual.numel()}")
        return flat + self.residual if self.enabled else flat.clone()

    def keep(self, acc: torch.Tensor, applied: torch.Tensor | None) -> None:
        """The residual becomes ``acc`` with the applied entries zeroed: ``applied`` holds their
        int indices, or is a boolean mask over acc; ``None`` means everything was applied (a
        dense step)."""
        if applied is None or not self.enabled:
            self.residual.zero_()
            return
        flat = acc.reshape(-1)
        if applied.dtype == torch.bool:
            torch.where(applied.reshape(-1), torch.zeros((), dtype=flat.dtype, device=flat.device), flat,
                        out=self.residual)
            return
        self.residual.copy_(flat)
        if applied.numel():
            self.residual[applied.long()] = 0

    def norm(self) -> float:
        return float(self.residual.norm())  # read at log points only

    def state_dict(self) -> dict:
        return {"residual": self.residual.clone(), "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        self.residual.copy_(state["residual"].to(self.residual.device))
        self.enabled = bool(state.get("enabled", self.enabled))
