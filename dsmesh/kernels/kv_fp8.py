"""The FP8 (e4m3) MLA latent cache's per-token quantisation: the torch reference every writer
and reader of ``--kv-cache-dtype fp8_e4m3`` pages follows (docs/ENGINE.md, "KV cache").

A cached token is ``kv_lora_rank`` latent values followed by the rope key. Each part gets its
own float32 scale per token, ``s = max(amax(|part|), 1e-8) / 448``, and stores
``fp8(part / s)`` (round to nearest, saturating at +-448); reading multiplies back:
``part = fp8.float() * s``. A value ``x`` comes back within ``max(|x| / 16, s / 1024)``
(and float32 rounding): e4m3 keeps 3 mantissa bits (round to nearest: 2^-4 relative) and
its subnormals, below ``2^-6 s``, step by ``2^-9 s``.

The pool (:class:`dsmesh.engine.kv.pool.MLAKVPool`) keeps the scales inside each page; the
fused writer is :func:`dsmesh.kernels.mla_rope.mla_decode_prep_fp8`.
"""

from __future__ import annotations

import torch

KV_FP8_DTYPE = torch.float8_e4m3fn
KV_FP8_MAX = 448.0  # the largest finite e4m3fn value
KV_FP8_MIN_AMAX = 1e-8  # an all-zero part gets this amax, so its scale is never 0
KV_SCALES_PER_TOKEN = 2  # the latent's scale, the rope key's scale (float32 each)

__all__ = [
    "KV_FP8_DTYPE",
    "KV_FP8_MAX",
    "KV_SCALES_PER_TOKEN",
    "dequantize_kv_fp8",
    "quantize_kv_fp8",
]


def quantize_kv_fp8(kv: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [..., kv_lora_rank + rope] (any float dtype) -> (values [..., same] float8_e4m3fn,
    scales [..., 2] float32): ``scales[..., 0]`` the latent's, ``scales[..., 1]`` the rope
    key's, each ``max(amax, 1e-8) / 448`` over that part of the token (float32 division)."""
    x = kv.float()
    latent, k_pe = x[..., :kv_lora_rank], x[..., kv_lora_rank:]
    amax = torch.stack([latent.abs().amax(-1), k_pe.abs().amax(-1)], dim=-1)
    # elementwise: CUDA torch divides by a Python scalar as a product with its reciprocal,
    # which rounds differently from the division the format (and the Triton writer) uses
    scales = amax.clamp_min(KV_FP8_MIN_AMAX) / torch.full_like(amax, KV_FP8_MAX)
    scaled = torch.cat([latent / scales[..., 0:1], k_pe / scales[..., 1:2]], dim=-1)
    values = scaled.clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE)
    return values, scales


def dequantize_kv_fp8(
    values: torch.Tensor,
    scales: torch.Tensor,
    kv_lora_rank: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """values [..., kv_lora_rank + rope] float8_e4m3fn, scales [..., 2] float32 -> the
    tokens [..., kv_lora_rank + rope] in ``dtype`` (products in float32, then rounded)."""
    x = values.float()
    x[..., :kv_lora_rank] *= scales[..., 0:1]
    x[..., kv_lora_rank:] *= scales[..., 1:2]
    return x.to(dtype)
