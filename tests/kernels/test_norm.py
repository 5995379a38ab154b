"""Triton RMSNorm and residual-add + RMSNorm equal dsmesh.engine.model.norm.RMSNorm's torch math:
float32 to a few ulp, bf16/fp16 to one ulp (the residual sum bit for bit), strided rows included;
the engine's RMSNorm dispatches to the kernel."""

from __future__ import annotations

import pytest
import torch

import dsmesh.engine.model.norm as engine_norm
from dsmesh.engine.model.norm import RMSNorm
from dsmesh.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from tests.kernels.conftest import needs_triton

EPS = 1e-6


def assert_close_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within 2e-6 relative; bf16/fp16: at most one ulp of the dtype apart."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.cpu(), want.cpu()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    bits = 8 if want.dtype == torch.bfloat16 else 11  # significand bits
    _, exponent = torch.frexp(want.float())
    ulp = torch.ldexp(torch.ones_like(want, dtype=torch.float32), exponent - bits)
    diff = (got.float() - want.float()).abs()
    bad = diff > ulp
    assert not bad.any(), list(zip(got[bad].tolist(), want[bad].tolist(), strict=True))[:5]


def _rows(t: int, d: int, dtype: torch.dtype, device: str, seed: int, pad: int = 0):
    """[t, d] with rows of very different scales; a strided view when ``pad`` > 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d + pad, generator=g) * torch.logspace(-2, 2, t)[:, None]
    return x.to(dtype).to(device)[:, :d]


def _weight(d: int, dtype: torch.dtype, device: str, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(d, generator=g) * 2 - 0.5).to(dtype).to(device)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("t", "d", "pad"),
    [(1, 64, 0), (5, 100, 0), (3, 512, 64), (2, 7168, 0)],  # 512 of 576: latent view
)
def test_rms_norm_equals_reference(t, d, pad, dtype, device) -> None:
    x = _rows(t, d, dtype, device, seed=d, pad=pad)
    w = _weight(d, dtype, device)
    assert x.is_contiguous() == (pad == 0)
    y = rms_norm(x, w, EPS)
    assert_close_ulp(y, rms_norm_ref(x, w, EPS))


@needs_triton
def test_rms_norm_promotes_like_torch_and_fills_out(device) -> None:
    x = _rows(4, 48, torch.bfloat16, device, seed=1)
    w32 = _weight(48, torch.float32, device)
    y = rms_norm(x, w32, EPS)  # float32 weight: torch multiplies in float32
    assert y.dtype == torch.float32
    assert_close_ulp(y, rms_norm_ref(x, w32, EPS))
    w = w32.to(torch.bfloat16)
    big = torch.zeros(4, 64, dtype=torch.bfloat16, device=device)
    out = big[:, 8:56]  # a strided output
    assert rms_norm(x, w, EPS, out=out) is out
    assert_close_ulp(out, rms_norm_ref(x, w, EPS))
    assert big[:, :8].abs().sum() == 0 and big[:, 56:].abs().sum() == 0
    x_t = _rows(48, 4, torch.bfloat16, device, seed=2).T  # last dim not dense: copied
    assert_close_ulp(rms_norm(x_t, w, EPS), rms_norm_ref(x_t, w, EPS))
    assert rms_norm(x[:0], w, EPS).shape == (0, 48)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "d", "pad"), [(3, 64, 0), (4, 200, 24)])
def test_fused_add_rms_norm_equals_reference(t, d, pad, dtype, device) -> None:
    x = _rows(t, d, dtype, device, seed=3, pad=pad)
    residual = _rows(t, d, dtype, device, seed=4, pad=pad)
    w = _weight(d, dtype, device)
    residual_ref = residual.clone()
    want = fused_add_rms_norm_ref(x, residual_ref, w, EPS)
    before = residual.clone()
    padding = None if residual._base is None else residual._base[:, d:].clone()
    got = fused_add_rms_norm(x, residual, w, EPS)
    assert not torch.equal(residual, before)  # updated in place ...
    assert torch.equal(residual, residual_ref)  # ... to torch's sum, bit for bit
    assert_close_ulp(got, want)
    if pad:  # the padding columns of the strided view stay untouched
        assert padding is not None and torch.equal(residual._base[:, d:], padding)


@needs_triton
def test_bad_shapes_name_the_argument(device) -> None:
    x = _rows(2, 32, torch.float32, device, seed=5)
    w = _weight(32, torch.float32, device)
    with pytest.raises(ValueError, match=r"^x must be \[T, D\]"):
        rms_norm(x[None], w, EPS)
    with pytest.raises(ValueError, match="^weight must be"):
        rms_norm(x, w[:16], EPS)
    with pytest.raises(ValueError, match="^x dtype"):
        rms_norm(x.double(), w, EPS)
    with pytest.raises(ValueError, match="^out must be"):
        rms_norm(x, w, EPS, out=torch.empty(2, 31, device=device))
    with pytest.raises(ValueError, match="^x shape"):
        fused_add_rms_norm(x[:1], x.clone(), w, EPS)
    with pytest.raises(ValueError, match="^x dtype"):
        fused_add_rms_norm(x.bfloat16(), x.clone(), w, EPS)
    with pytest.raises(ValueError, match="^residual must be dense"):
        fused_add_rms_norm(x, x.clone().T.contiguous().T, w, EPS)


@needs_triton
def test_engine_rmsnorm_dispatches_to_the_kernel(monkeypatch, device) -> None:
    """With the Triton kernels chosen (KernelChoice.triton, set once by set_kernels), RMSNorm
    calls the kernel for 2-D, strided 2-D and 3-D inputs, and keeps torch when autograd needs
    the graph."""
    calls: list[tuple[int, ...]] = []

    def spy(x, weight, eps, out=None):
        calls.append(tuple(x.shape))
        return rms_norm(x, weight, eps, out)

    monkeypatch.setattr(engine_norm, "rms_norm", spy)
    norm = RMSNorm(96).to(device, torch.bfloat16)
    norm.triton = True
    with torch.no_grad():
        norm.weight.copy_(_weight(96, torch.bfloat16, device))
    wide = _rows(6, 128, torch.bfloat16, device, seed=6)
    with torch.inference_mode():
        for x in (wide[:, :96], wide[:, :96].contiguous().view(2, 3, 96)):
            y = norm(x)
            assert y.shape == x.shape
            assert_close_ulp(y, rms_norm_ref(x, norm.weight, norm.eps))
    assert calls == [(6, 96), (6, 96)]
    x = wide[:, :96].clone().requires_grad_(True)
    y = norm(x)  # autograd on: the torch path, which has a backward
    assert torch.equal(y, rms_norm_ref(x, norm.weight, norm.eps))
    y.float().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None and len(calls) == 2
