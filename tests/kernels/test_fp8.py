"""Tests for dsmesh.kernels.fp8: block and per-token-group FP8 e4m3 round trips, shapes and errors.

Error bound: e4m3 keeps 3 mantissa bits, so rounding a normal value x (|x| >= 2**-6) to nearest
moves it by at most half an ulp, 2**-4 * 2**floor(log2|x|) <= 2**-4 * |x|; below 2**-6 the
subnormal step is 2**-9, so the error is at most 2**-10. In weight units, with the block's scale
s: |w_hat - w| <= 2**-4 * |w| + 2**-10 * s. A 1e-5 relative slack covers float32 rounding.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from dsmesh.kernels.fp8 import (
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [nb, kb] -> per-element scales [N, K]."""
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return expanded[: shape[0], : shape[1]]


def _assert_within_fp8_bound(w: torch.Tensor, w_hat: torch.Tensor, scale: torch.Tensor) -> None:
    """|w_hat - w| <= 2**-4 |w| + 2**-10 s elementwise, with s the element's scale [same shape]."""
    err = (w_hat - w).abs()
    bound = (2**-4 * w.abs() + 2**-10 * scale) * (1 + 1e-5)
    assert bool((err <= bound).all()), float((err - bound).max())


def _reference_block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """amax / 448 of every block, computed one block at a time [ceil(N/bn), ceil(K/bk)]."""
    n, k = w.shape
    rows, cols = math.ceil(n / block[0]), math.ceil(k / block[1])
    scales = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scales[i, j] = tile.abs().max() / FP8_MAX
    return scales


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian [n, k] with row magnitudes spread over 1e-3 .. 1e3, so blocks differ in scale."""
    gen = torch.Generator().manual_seed(seed)
    row_scale = 10.0 ** torch.empty(n, 1).uniform_(-3, 3, generator=gen)
    return torch.randn(n, k, generator=gen) * row_scale


def test_block_round_trip_within_fp8_tolerance() -> None:
    w = _weight(256, 384, seed=0)
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 384)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (2, 3)
    torch.testing.assert_close(scale_inv, _reference_block_scales(w, (128, 128)))
    w_hat = dequantize_fp8_block(q, scale_inv)
    scales = _expand(scale_inv, (256, 384), (128, 128))
    _assert_within_fp8_bound(w, w_hat, scales)
    # Relative to the block amax (448 s) the error is at most 2**-4 and really is FP8-sized.
    rel_to_amax = (w_hat - w).abs() / (FP8_MAX * scales)
    assert float(rel_to_amax.max()) <= 2**-4
    assert float(rel_to_amax.max()) > 2**-9


def test_block_amax_maps_to_fp8_max() -> None:
    w = _weight(256, 256, seed=1)
    q, _ = quantize_fp8_block(w)
    block_amax = q.float().abs().view(2, 128, 2, 128).amax(dim=(1, 3))
    assert torch.equal(block_amax, torch.full((2, 2), 448.0))
    assert not torch.isnan(q.float()).any()


@pytest.mark.parametrize(
    ("block", "scale_shape"), [((128, 128), (2, 1)), ((32, 32), (7, 3)), ((64, 16), (4, 5))]
)
def test_block_ragged_shapes(block: tuple[int, int], scale_shape: tuple[int, int]) -> None:
    w = _weight(200, 72, seed=2)
    q, scale_inv = quantize_fp8_block(w, block)
    assert q.shape == (200, 72) and q.is_contiguous()
    assert scale_inv.shape == scale_shape
    torch.testing.assert_close(scale_inv, _reference_block_scales(w, block))
    w_hat = dequantize_fp8_block(q, scale_inv, block)
    assert w_hat.shape == (200, 72) and w_hat.dtype == torch.float32
    _assert_within_fp8_bound(w, w_hat, _expand(scale_inv, (200, 72), block))


def test_block_grid_values_round_trip_exactly() -> None:
    # Values already on the e4m3 grid times a power-of-two scale, with 448 in every block,
    # must come back bit-exact: scale_inv is that power of two and q the grid values.
    gen = torch.Generator().manual_seed(3)
    grid = (torch.randn(256, 256, generator=gen) * 50).clamp(-448, 448)
    grid = grid.to(torch.float8_e4m3fn).float().view(2, 128, 2, 128)
    grid[:, 0, :, 0] = 448.0
    powers = 2.0 ** torch.tensor([[-12.0, 0.0], [3.0, -1.0]])
    w = (grid * powers[:, None, :, None]).view(256, 256)
    q, scale_inv = quantize_fp8_block(w)
    assert torch.equal(scale_inv, powers)
    assert torch.equal(dequantize_fp8_block(q, scale_inv), w)


def test_block_zero_block_is_exact_and_finite() -> None:
    w = _weight(256, 256, seed=4)
    w[:128, 128:] = 0.0
    q, scale_inv = quantize_fp8_block(w)
    assert scale_inv[0, 1].item() == 1.0
    assert torch.isfinite(scale_inv).all()
    w_hat = dequantize_fp8_block(q, scale_inv)
    assert torch.equal(w_hat[:128, 128:], torch.zeros(128, 128))
    assert torch.isfinite(w_hat).all()


def test_block_accepts_bfloat16_and_returns_requested_dtype() -> None:
    w = _weight(130, 260, seed=5).bfloat16()
    q, scale_inv = quantize_fp8_block(w)
    w_hat = dequantize_fp8_block(q, scale_inv, dtype=torch.bfloat16)
    assert w_hat.dtype == torch.bfloat16 and w_hat.shape == (130, 260)
    # bfloat16 output adds its own rounding (<= 2**-9 relative) on top of the FP8 bound.
    err = (w_hat.float() - w.float()).abs()
    scales = _expand(scale_inv, (130, 260), (128, 128))
    assert bool((err <= (2**-4 + 2**-8) * w.float().abs() + 2**-9 * scales).all())


@pytest.mark.parametrize("bad_shape", [(2, 2), (1, 1), (3, 1), (2,)])
def test_dequantize_block_rejects_mismatched_scale(bad_shape: tuple[int, ...]) -> None:
    q, _ = quantize_fp8_block(_weight(200, 72, seed=6))
    with pytest.raises(
        ValueError, match=r"must have shape \(2, 1\), got " + re.escape(str(bad_shape))
    ):
        dequantize_fp8_block(q, torch.ones(bad_shape))


def test_per_token_group_round_trip() -> None:
    gen = torch.Generator().manual_seed(7)
    token_scale = 10.0 ** torch.empty(2, 3, 1).uniform_(-2, 2, generator=gen)
    x = torch.randn(2, 3, 512, generator=gen) * token_scale
    x[1, 2, 128:256] = 0.0  # an all-zero group
    q, scale = quantize_fp8_per_token_group(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 3, 512)
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 4)
    expected_scale = x.view(2, 3, 4, 128).abs().amax(dim=-1) / FP8_MAX
    expected_scale[1, 2, 1] = 1.0
    torch.testing.assert_close(scale, expected_scale)
    x_hat = dequantize_fp8_per_token_group(q, scale)
    assert x_hat.shape == x.shape
    _assert_within_fp8_bound(x, x_hat, scale.repeat_interleave(128, dim=-1))
    assert torch.equal(x_hat[1, 2, 128:256], torch.zeros(128))


def test_per_token_group_small_groups_and_bfloat16() -> None:
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(8)).bfloat16()
    q, scale = quantize_fp8_per_token_group(x, group_size=32)
    assert scale.shape == (5, 3)
    x_hat = dequantize_fp8_per_token_group(q, scale, group_size=32)
    _assert_within_fp8_bound(x.float(), x_hat, scale.repeat_interleave(32, dim=-1))


def test_per_token_group_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of group_size 128"):
        quantize_fp8_per_token_group(torch.randn(4, 200))
    q, _ = quantize_fp8_per_token_group(torch.randn(4, 256))
    with pytest.raises(ValueError, match=r"must have shape \(4, 2\), got \(4, 1\)"):
        dequantize_fp8_per_token_group(q, torch.ones(4, 1))
