"""One-pass SwiGLU against torch's silu(gate) * up."""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.activation import silu_mul, silu_mul_ref
from tests.kernels.conftest import needs_triton


@needs_triton
@pytest.mark.parametrize("shape", [(1, 32), (7, 200), (3, 2816)])
def test_silu_mul_equals_torch_in_float32(shape, device) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])) * 4
    got = silu_mul(x.to(device)).cpu()
    torch.testing.assert_close(got, silu_mul_ref(x), rtol=1e-6, atol=1e-6)


@needs_triton
def test_silu_mul_half_precision_and_strided_rows(device) -> None:
    base = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)).half()
    x = base[:, :256]  # rows 300 apart
    got = silu_mul(x.to(device)).cpu().float()
    want = silu_mul_ref(x.float())
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # one fp16 rounding


@needs_triton
def test_silu_mul_errors_and_empty(device) -> None:
    with pytest.raises(ValueError, match="2 \\* inter"):
        silu_mul(torch.zeros(2, 3, device=device))
    assert silu_mul(torch.zeros(0, 8, device=device)).shape == (0, 4)
