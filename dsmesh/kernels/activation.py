"""SwiGLU activation in one pass: ``silu(gate) * up`` from the concatenated GEMM output.

The expert GEMM writes ``[gate | up]`` per row; torch then runs ``silu`` on the strided
``gate`` half and multiplies by the strided ``up`` half: two non-vectorised passes over
prefill-sized activations (tens of MB per layer). This kernel reads each half once and
writes the product once, computing in float32 and rounding once (torch rounds ``silu``'s
output to the activation dtype before the multiply, so bf16 results may differ by an ulp).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsmesh.kernels._triton import can_launch, next_pow2

__all__ = ["silu_mul", "silu_mul_ref"]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_o + cols, h.to(out_ptr.dtype.element_ty), mask=mask)

    return silu_mul_kernel


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2I] (gate columns, then up) -> silu(gate) * up [M, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [rows, 2 * inter], got shape {tuple(x.shape)}")
    if not can_launch(x):
        raise RuntimeError("silu_mul needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0 or inter == 0:
        return out
    block = min(next_pow2(inter), 1024)
    grid = (m, -(-inter // block))
    _kernel()[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
