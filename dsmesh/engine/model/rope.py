"""Rotary position embedding for MLA's decoupled rope channels, with YaRN scaling."""

from __future__ import annotations

import math

import torch

from dsmesh.engine.model.config import RopeConfig, yarn_get_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (float32) and the cos/sin magnitude scale.

    For YaRN, low-frequency channels are interpolated by ``factor``, high-frequency ones kept,
    with a linear ramp between the correction dims found from ``beta_fast``/``beta_slow``; cos
    and sin are scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim).
    """
    # Always on the CPU (also inside a meta-device context): a few dozen numbers.
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    pos_freqs = rope.theta**exponents
    inv_freq_extra = 1.0 / pos_freqs
    if rope.scaling != "yarn":
        return inv_freq_extra, 1.0
    inv_freq_inter = 1.0 / (rope.factor * pos_freqs)
    low, high = _yarn_correction_range(
        rope.beta_fast, rope.beta_slow, dim, rope.theta, rope.original_max_position_embeddings
    )
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    extra_weight = 1 - ramp
    inv_freq = inv_freq_inter * (1 - extra_weight) + inv_freq_extra * extra_weight
    magnitude = yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(
        rope.factor, rope.mscale_all_dim
    )
    return inv_freq, float(magnitude)


def _yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, max_pos: int
) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, dim - 1)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to the last dim of q/k given absolute positions.

    ``interleave=True`` rotates pairs (x0, x1), (x2, x3), ... and returns them de-interleaved
    (evens first, then odds), as DeepSeek's reference and transformers do; since q and k are
    permuted alike, their dot products are unchanged. ``interleave=False`` rotates halves.
    """

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        self.rope_config = rope
        self.dim = dim
        inv_freq, magnitude = rope_inv_freq(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.magnitude = magnitude
        self.interleave = rope.interleave

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq`` in place (after ``to_empty`` from the meta device)."""
        inv_freq, _ = rope_inv_freq(self.rope_config, self.dim)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [T] int -> cos, sin [T, dim // 2] in ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos() * self.magnitude
        sin = freqs.sin() * self.magnitude
        return cos.to(dtype), sin.to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., dim]; cos/sin [T, dim // 2] broadcast over the middle dims."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
