"""The FP8 KV cache's per-token quantisation (dsmesh/kernels/kv_fp8.py): the agreed format's
scales and codes, the round trip's error bound, and its edge cases."""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.kv_fp8 import KV_FP8_DTYPE, dequantize_kv_fp8, quantize_kv_fp8

RANK = 32  # latent values per token; the rope key follows


def tokens(n: int, width: int = 48, seed: int = 0) -> torch.Tensor:
    """Tokens whose latent and rope parts have very different magnitudes, per token too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[:, RANK:] *= 0.01
    return x


def test_scales_and_codes_follow_the_agreed_format() -> None:
    x = tokens(64)
    values, scales = quantize_kv_fp8(x, RANK)
    assert values.dtype == KV_FP8_DTYPE and values.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (64, 2)
    assert torch.equal(scales[:, 0], x[:, :RANK].abs().amax(-1) / 448)
    assert torch.equal(scales[:, 1], x[:, RANK:].abs().amax(-1) / 448)
    want = torch.cat([x[:, :RANK] / scales[:, :1], x[:, RANK:] / scales[:, 1:]], -1)
    assert torch.equal(values, want.clamp(-448, 448).to(KV_FP8_DTYPE))
    # each part's largest value maps to the largest code
    assert torch.equal(values[:, :RANK].float().abs().amax(-1), torch.full((64,), 448.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_bound(dtype) -> None:
    """Every value comes back within max(|x| / 16, s / 1024) (3 mantissa bits; subnormal
    steps of 2^-9 s), and the whole cache to about 2.5% RMS of its parts' amax."""
    x = tokens(256, seed=1).to(dtype)
    values, scales = quantize_kv_fp8(x, RANK)
    back = dequantize_kv_fp8(values, scales, RANK)
    exact = x.float()
    err = (back - exact).abs()
    per_value = torch.cat([scales[:, :1].expand(-1, RANK), scales[:, 1:].expand(-1, 16)], -1)
    bound = torch.maximum(exact.abs() / 16, per_value / 1024)
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())
    rms = (err / (448 * per_value)).square().mean().sqrt()
    assert 0.005 < float(rms) < 0.025  # FP8 really loses precision, within its format
    assert dequantize_kv_fp8(values, scales, RANK, dtype).dtype == dtype


def test_zero_tokens_and_zero_parts_come_back_as_zeros() -> None:
    x = tokens(4)
    x[0] = 0
    x[1, RANK:] = 0
    values, scales = quantize_kv_fp8(x, RANK)
    tiny = torch.tensor(1e-8) / 448  # the scale of an all-zero part, in float32
    assert scales[0].tolist() == [float(tiny)] * 2 and float(scales[1, 1]) == float(tiny)
    back = dequantize_kv_fp8(values, scales, RANK)
    assert not back[0].any() and not back[1, RANK:].any()
    assert back[1, :RANK].abs().amax() > 0


def test_any_leading_shape() -> None:
    x = tokens(24).view(2, 3, 4, 48)
    values, scales = quantize_kv_fp8(x, RANK)
    assert values.shape == x.shape and scales.shape == (2, 3, 4, 2)
    flat_values, flat_scales = quantize_kv_fp8(x.view(-1, 48), RANK)
    assert torch.equal(values.view(-1, 48).view(torch.uint8), flat_values.view(torch.uint8))
    assert torch.equal(scales.view(-1, 2), flat_scales)
