"""DeepSeek-V3 style FP8 (e4m3) quantisation: 2-D block scales for weights, per-token groups
for activations.

Checkpoints store ``weight`` as float8_e4m3fn [N, K] beside ``weight_scale_inv`` float32
[ceil(N / 128), ceil(K / 128)]; the real weight is ``weight * weight_scale_inv`` block-wise.
Scales map each block's absolute maximum onto the largest finite e4m3 value, 448. These are
plain-torch references; the Triton kernels (:mod:`dsmesh.kernels.fp8_quant`,
:mod:`dsmesh.kernels.moe_gemm`) are tested against them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
BLOCK = 128  # DeepSeek's FP8 scale block (weights 128x128, activations 1x128)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Scale (float32, same shape) taking amax to FP8_MAX; 1 where amax is 0 or underflows."""
    scale = amax / FP8_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 already divided by its scale -> float8_e4m3fn, saturating at +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def block_scale_shape(shape: tuple[int, int], block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of the block scales of an [N, K] matrix: (ceil(N / bn), ceil(K / bk))."""
    return math.ceil(shape[0] / block_size[0]), math.ceil(shape[1] / block_size[1])


def quantize_fp8_block(
    weight: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32).

    ``scale_inv = amax(|block|) / 448`` (1 for an all-zero block); ragged edge blocks take the
    amax of the elements they hold.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    bn, bk = block_size
    num_row_blocks, num_col_blocks = block_scale_shape((n, k), block_size)
    # Zero padding cannot raise a block's amax.
    padded = F.pad(weight.float(), (0, num_col_blocks * bk - k, 0, num_row_blocks * bn - n))
    blocks = padded.view(num_row_blocks, bn, num_col_blocks, bk)
    scale_inv = _scale_from_amax(blocks.abs().amax(dim=(1, 3)))
    q = _to_fp8(blocks / scale_inv[:, None, :, None])
    q = q.view(num_row_blocks * bn, num_col_blocks * bk)[:n, :k].contiguous()
    return q, scale_inv


def dequantize_fp8_block(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)] float32 -> weight [N, K] in ``dtype``."""
    if q.dim() != 2:
        raise ValueError(f"q must be [N, K], got shape {tuple(q.shape)}")
    n, k = q.shape
    expected = block_scale_shape((n, k), block_size)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv for a [{n}, {k}] weight with block {tuple(block_size)} must have shape "
            f"{expected}, got {tuple(scale_inv.shape)}"
        )
    bn, bk = block_size
    scales = scale_inv.float().repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)
    return (q.float() * scales[:n, :k]).to(dtype)


def quantize_fp8_per_token_group(
    x: torch.Tensor, group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (q [..., K] float8_e4m3fn, scale [..., K // group_size] float32).

    Each run of ``group_size`` consecutive channels of a token shares ``scale = amax / 448``;
    ``K`` must be a multiple of ``group_size``.
    """
    k = x.shape[-1]
    if k % group_size != 0:
        raise ValueError(f"last dim {k} must be a multiple of group_size {group_size}")
    groups = x.float().reshape(*x.shape[:-1], k // group_size, group_size)
    scale = _scale_from_amax(groups.abs().amax(dim=-1))
    q = _to_fp8(groups / scale.unsqueeze(-1)).view(x.shape)
    return q, scale


def dequantize_fp8_per_token_group(
    q: torch.Tensor, scale: torch.Tensor, group_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [..., K] fp8, scale [..., K // group_size] float32 -> x [..., K] in ``dtype``."""
    k = q.shape[-1]
    if k % group_size != 0:
        raise ValueError(f"last dim {k} must be a multiple of group_size {group_size}")
    expected = (*q.shape[:-1], k // group_size)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale must have shape {expected}, got {tuple(scale.shape)}")
    groups = q.float().reshape(expected + (group_size,))
    return (groups * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


@dataclass
class Fp8ExpertWeights:
    """One rank's experts in the checkpoint's FP8 form, stacked like RoutedExperts.

    w13 [E, 2I, H] e4m3 with w13_scale [E, 2I/128, H/128]; w2 [E, H, I] with w2_scale
    [E, H/128, I/128] (float32 ``weight_scale_inv`` blocks)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @classmethod
    def from_dense(cls, w13: torch.Tensor, w2: torch.Tensor) -> Fp8ExpertWeights:
        """Quantise dense expert weights block-wise (benchmarks, tests)."""

        def stack(w):
            pairs = [quantize_fp8_block(w[e]) for e in range(w.shape[0])]
            return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

        return cls(*stack(w13), *stack(w2))

    @property
    def usable(self) -> bool:
        """The Triton path needs whole 128-blocks along every dimension."""
        return all(d % BLOCK == 0 for d in (*self.w13.shape[1:], self.w2.shape[1]))
