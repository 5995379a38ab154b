"""RMSNorm (and residual add + RMSNorm) in one Triton launch, beside its torch reference.

DeepSeek's RMSNorm (:class:`dsmesh.engine.model.norm.RMSNorm`) normalises in float32, rounds to the
input dtype, then multiplies by the weight in the promoted dtype of (weight, input):

    y = weight * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype)

The kernel rounds at exactly those two places, so it differs from torch only through the
float32 sum of squares (reduction order) and ``rsqrt``: float32 outputs agree to a few ulp,
bf16 outputs are equal or one bf16 ulp apart. :func:`fused_add_rms_norm` first stores
``residual + x`` (rounded once to the residual's dtype, as torch's ``add_`` does) back into
``residual`` and normalises that sum, replacing ``x = x + attn_out; h = norm(x)`` in a decoder
layer with one launch.

Roundings are explicit (:func:`dsmesh.kernels._jit_math.round_to`): Triton's CPU interpreter
truncates float32 -> bf16 casts, so each value is rounded to nearest even by bit arithmetic
first and the store then only converts an exactly representable value (on the GPU both ways
give the same bits).
One program per row; rows may have any stride (a strided view such as the first 512 columns
of a [T, 576] tensor), the last dim must be dense (a copy is made otherwise, for ``x``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dsmesh.kernels._triton import can_launch, next_pow2

__all__ = [
    "SUPPORTED_DTYPES",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "rms_norm",
    "rms_norm_ref",
]

#: dtypes the kernels take, with their ``KIND`` code in :func:`dsmesh.kernels._jit_math.round_to`.
SUPPORTED_DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# The @triton.jit rounding helper the kernel calls, bound by ``_kernels()``. Triton's interpreter
# re-executes a kernel's source against its module's globals (closures are lost), so a helper a
# kernel calls must be a module global; binding it lazily keeps Triton out of the import.
_round_to: Any = None


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch path of :class:`dsmesh.engine.model.norm.RMSNorm` (it calls this): x [..., D] ->
    [..., D]."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place, then :func:`rms_norm_ref` of the new ``residual``."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    from dsmesh.kernels import _jit_math

    global _round_to
    _round_to = _jit_math.round_to

    @triton.jit
    def rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        n_cols,
        x_stride,
        res_stride,
        out_stride,
        eps,
        BLOCK: tl.constexpr,
        X_KIND: tl.constexpr,
        OUT_KIND: tl.constexpr,
        ADD_RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD_RESIDUAL:
            res = res_ptr + row * res_stride + cols
            x = _round_to(x + tl.load(res, mask=mask, other=0.0).to(tl.float32), X_KIND)
            tl.store(res, x, mask=mask)
        mean_sq = tl.sum(x * x, axis=0) / n_cols
        y = _round_to(x * tl.math.rsqrt(mean_sq + eps), X_KIND)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, _round_to(y * w, OUT_KIND), mask=mask)

    return rms_norm_kernel


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _check(x: torch.Tensor, weight: torch.Tensor, name: str = "x") -> torch.dtype:
    """Validates x [T, D] and weight [D]; returns the output dtype."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be [T, D], got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got shape {tuple(weight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be one of {list(SUPPORTED_DTYPES)}, got {x.dtype}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"weight dtype must be one of {list(SUPPORTED_DTYPES)}, got {weight.dtype}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, {name} on {x.device}")
    if not can_launch(x):
        raise RuntimeError("Triton RMSNorm needs a CUDA tensor (or TRITON_INTERPRET=1)")
    return torch.promote_types(x.dtype, weight.dtype)


def _output(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    if out.shape != x.shape or out.dtype != dtype or out.device != x.device:
        raise ValueError(
            f"out must be {tuple(x.shape)} {dtype} on {x.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"out must be dense in its last dim, got strides {out.stride()}")
    return out


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    t, d = x.shape
    if t == 0:
        return
    block = next_pow2(d)
    res = x if residual is None else residual
    _kernels()[(t,)](
        x,
        res,
        weight.contiguous(),
        out,
        d,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        float(eps),
        BLOCK=block,
        X_KIND=SUPPORTED_DTYPES[x.dtype],
        OUT_KIND=SUPPORTED_DTYPES[out.dtype],
        ADD_RESIDUAL=residual is not None,
        num_warps=_num_warps(block),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, D] (any row stride) -> [T, D] in promote(x.dtype, weight.dtype); same math as
    :func:`rms_norm_ref`. Shapes only decide the launch (capturable in a CUDA graph)."""
    dtype = _check(x, weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = _output(x, dtype, out)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual += x`` (in place, rounded to residual's dtype), then returns
    ``rms_norm(residual)``; same as :func:`fused_add_rms_norm_ref`. Both [T, D], same dtype."""
    dtype = _check(residual, weight, "residual")
    if x.shape != residual.shape:
        raise ValueError(
            f"x shape {tuple(x.shape)} must equal residual shape {tuple(residual.shape)}"
        )
    if x.dtype != residual.dtype:
        raise ValueError(f"x dtype {x.dtype} must equal residual dtype {residual.dtype}")
    if residual.stride(-1) != 1:
        raise ValueError(f"residual must be dense in its last dim, got strides {residual.stride()}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = _output(residual, dtype, out)
    _launch(x, residual, weight, out, eps)
    return out
