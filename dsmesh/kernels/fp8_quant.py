"""FP8 (e4m3) activation quantisation per token group, in Triton.

Same contract and the same bits as the torch references in :mod:`dsmesh.kernels.fp8`: each run of
``group_size`` channels of a token gets ``scale = amax / 448`` (1 where the group is all zero)
and ``q = clamp(x / scale, -448, 448)`` rounded to nearest e4m3. Divisions use round-to-nearest
(``div_rn``) so the kernel matches torch bit for bit.

:func:`silu_mul_quant_fp8` fuses the MoE SwiGLU (``silu(gate) * up`` in float32) with the
quantisation of its output, so the intermediate activation never goes to memory in bf16.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsmesh.kernels._triton import can_launch
from dsmesh.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8_per_token_group

__all__ = [
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_ref",
    "silu_mul_quant_fp8",
    "silu_mul_quant_fp8_ref",
]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        m,
        x_stride,
        up_offset,
        q_stride,
        s_stride,
        s_group_stride,
        FP8_MAX_C: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        SILU_MUL: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        g = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = g * GROUP + tl.arange(0, GROUP)
        mask = (rows < m)[:, None]
        src = x_ptr + rows.to(tl.int64)[:, None] * x_stride + cols[None, :]
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        if SILU_MUL:
            up = tl.load(src + up_offset, mask=mask, other=0.0).to(tl.float32)
            x = x / (1.0 + tl.exp(-x)) * up
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX_C, tl.float32))
        scale = tl.where(scale > 0, scale, 1.0)
        y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        y = tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C)
        dst = q_ptr + rows.to(tl.int64)[:, None] * q_stride + cols[None, :]
        tl.store(dst, y.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows.to(tl.int64) * s_stride + g * s_group_stride, scale, mask=rows < m)

    return quant_kernel


def _launch(x2d: torch.Tensor, k: int, group_size: int, silu_mul: bool, mn_major: bool = False):
    m = x2d.shape[0]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x2d.device)
    groups = k // group_size
    if mn_major:  # DeepGEMM's layout: a group's scales contiguous, rows padded to 16 bytes
        store = torch.empty((groups, -(-m // 4) * 4), dtype=torch.float32, device=x2d.device)
        scale = store[:, :m].t()
    else:
        scale = torch.empty((m, groups), dtype=torch.float32, device=x2d.device)
    if m:
        block_m = 16
        grid = ((m + block_m - 1) // block_m, k // group_size)
        _kernels()[grid](
            x2d,
            q,
            scale,
            m,
            x2d.stride(0),
            k,
            q.stride(0),
            scale.stride(0),
            scale.stride(1),
            FP8_MAX_C=float(FP8_MAX),
            GROUP=group_size,
            BLOCK_M=block_m,
            SILU_MUL=silu_mul,
            num_warps=4,
        )
    return q, scale


def _check(x: torch.Tensor, k: int, group_size: int) -> None:
    if k % group_size != 0:
        raise ValueError(f"last dim {k} must be a multiple of group_size {group_size}")
    if group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two, got {group_size}")
    if not can_launch(x):
        raise RuntimeError("Triton FP8 quantisation needs a CUDA tensor (or TRITON_INTERPRET=1)")


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int = 128, mn_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] float8_e4m3fn, scale [..., K // group_size] float32).

    ``mn_major_scales`` (x 2-D only): the scales [M, G] as a transposed view of a [G, M4]
    buffer, M4 = M rounded up to 4: each group's scales contiguous and 16-byte aligned, the
    layout DeepGEMM's FP8 GEMMs read without a copy (the same values)."""
    k = x.shape[-1]
    _check(x, k, group_size)
    if mn_major_scales and x.dim() != 2:
        raise ValueError(f"mn_major_scales needs a 2-D x, got shape {tuple(x.shape)}")
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    q, scale = _launch(x2d, k, group_size, silu_mul=False, mn_major=mn_major_scales)
    if mn_major_scales:
        return q, scale
    return q.view(x.shape), scale.view(*x.shape[:-1], k // group_size)


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (:func:`dsmesh.kernels.fp8.quantize_fp8_per_token_group`)."""
    return quantize_fp8_per_token_group(x, group_size)


def silu_mul_quant_fp8(
    gate_up: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (gate columns, then up) -> FP8 of ``silu(gate) * up`` [M, I] and its
    per-group scales [M, I // group_size]; the product is formed in float32."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [M, 2I], got shape {tuple(gate_up.shape)}")
    k = gate_up.shape[1] // 2
    _check(gate_up, k, group_size)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    return _launch(gate_up, k, group_size, silu_mul=True)


def silu_mul_quant_fp8_ref(
    gate_up: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return quantize_fp8_per_token_group(F.silu(gate) * up, group_size)
