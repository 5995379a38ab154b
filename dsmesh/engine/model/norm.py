"""RMSNorm as DeepSeek defines it: normalise in float32, scale in the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from dsmesh.kernels.norm import (
    SUPPORTED_DTYPES,
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.triton = False  # one fused launch (dsmesh.kernels.norm); set once by set_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape, dtype promote(x, weight) (the model dtype).

        With Triton chosen, one fused launch (:func:`dsmesh.kernels.norm.rms_norm`) when ``x`` views
        as [T, dim] (strided rows included) and autograd is not involved; torch otherwise."""
        x2d = self._as_rows(x) if self.triton else None
        if x2d is not None:
            out = rms_norm(x2d, self.weight, self.eps)
            return out if x2d is x else out.view(x.shape)
        return rms_norm_ref(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` in place (the residual stream), then the norm of the new
        ``residual``: one launch (:func:`dsmesh.kernels.norm.fused_add_rms_norm`) with Triton."""
        if self.triton and x.dim() == 2 and self._as_rows(residual) is not None:
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        return fused_add_rms_norm_ref(x, residual, self.weight, self.eps)

    def _as_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` as [T, dim] without a copy, or None when the kernel should not run."""
        if x.dtype not in SUPPORTED_DTYPES or self.weight.dtype not in SUPPORTED_DTYPES:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return None  # the kernel has no backward
        if x.dim() == 0 or x.shape[-1] != self.weight.shape[0] or x.stride(-1) != 1:
            return None
        if x.numel() == 0:
            return None
        if x.dim() == 2:
            return x  # already [T, dim]: no view op
        try:
            return x.view(-1, x.shape[-1])
        except RuntimeError:  # rows that are not one stride apart
            return None
