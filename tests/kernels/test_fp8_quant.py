"""Triton per-token-group FP8 quantisation equals dsmesh.kernels.fp8's torch reference bit for
bit."""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.fp8 import FP8_MAX, dequantize_fp8_per_token_group
from dsmesh.kernels.fp8_quant import (
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    silu_mul_quant_fp8,
    silu_mul_quant_fp8_ref,
)
from tests.kernels.conftest import assert_fp8_codes_equal, needs_cuda, needs_triton


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 30
    x[..., :128] = 0.0  # an all-zero group takes scale 1
    return x.to(dtype).to(device)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 256), (37, 384), (2, 5, 256)])
def test_quant_equals_reference(shape, dtype, device) -> None:
    x = _inputs(shape, dtype, device)
    q, s = per_token_group_quant_fp8(x)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x.cpu())
    assert q.shape == x.shape and s.shape == (*x.shape[:-1], x.shape[-1] // 128)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=0, atol=0)
    assert_fp8_codes_equal(q, q_ref)
    assert float(s_ref[..., 0].min()) == 1.0  # the zero group
    assert q.float().abs().max() <= FP8_MAX


@needs_triton
def test_quant_small_groups_and_errors(device) -> None:
    x = _inputs((9, 64), torch.float32, device, seed=3)
    q, s = per_token_group_quant_fp8(x, group_size=32)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x.cpu(), group_size=32)
    assert_fp8_codes_equal(q, q_ref)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of group_size"):
        per_token_group_quant_fp8(x[:, :40])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_quant_matches_reference(dtype, device) -> None:
    gate_up = _inputs((33, 512), dtype, device, seed=1) / 10
    q, s = silu_mul_quant_fp8(gate_up)
    q_ref, s_ref = silu_mul_quant_fp8_ref(gate_up.cpu())
    assert q.shape == (33, 256) and s.shape == (33, 2)
    # silu's exp may differ from torch's by an ulp: scales agree to float32 rounding and a
    # code may land one e4m3 step away.
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    assert_fp8_codes_equal(q, q_ref, neighbours_ok=True)
    same = (q.cpu().view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.9


def test_reference_roundtrip_error_is_bounded() -> None:
    x = _inputs((8, 256), torch.float32, "cpu", seed=2)
    q, s = per_token_group_quant_fp8_ref(x)
    back = dequantize_fp8_per_token_group(q, s)
    err = (back - x).abs() / (x.abs() + 1e-3)
    assert err.max() < 0.07  # e4m3 keeps 3 mantissa bits


@needs_cuda
def test_quant_large_on_gpu() -> None:
    x = _inputs((4096, 7168), torch.bfloat16, "cuda", seed=4)
    q, s = per_token_group_quant_fp8(x)
    # The reference runs on the CPU: torch on CUDA divides by the Python scalar 448 as a
    # multiplication by its (rounded) reciprocal, which moves some scales by an ulp.
    q_ref, s_ref = per_token_group_quant_fp8_ref(x.cpu())
    assert torch.equal(s.cpu(), s_ref)
    assert_fp8_codes_equal(q, q_ref)
