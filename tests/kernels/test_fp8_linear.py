"""Block-scaled FP8 linear layers (dsmesh/kernels/fp8_linear.py): the torch reference is exactly
``dequantise(W) @ dequantise(quantise_per_token_group(x))``; the Triton GEMM equals it (CPU
interpreter at small shapes, the GPU at DeepSeek-V3's); DeepGEMM's ``fp8_gemm_nt`` equals both
where installed; every path captures in a CUDA graph.

Tolerance. The reference multiplies the dequantised operands in float32 and rounds once; the
kernels sum per-128-block float32 partial products with both scales applied to each block, in
another order, and round the output to bf16 (2**-9 relative). The error is measured as
``||out - ref|| / ||ref||`` over the whole output: below 1e-2 on the GPU (bf16 rounding gives
~3e-3), below 1e-6 in float32 under the interpreter (summation order only).
"""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.backends import available
from dsmesh.kernels.fp8 import (
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from dsmesh.kernels.fp8_linear import (
    deep_gemm_fits,
    deep_gemm_linear_problem,
    fp8_linear,
    fp8_linear_ref,
    gemm_config,
    quantize_activation_ref,
)
from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8
from tests.kernels.conftest import HAS_CUDA, needs_cuda, needs_triton

needs_deep_gemm = pytest.mark.skipif(
    not (HAS_CUDA and available("deep_gemm")),
    reason="needs a CUDA device and DeepGEMM (pip install dsmesh[deepgemm])",
)

# DeepSeek-V3's FP8 linears as the engine runs them, [N, K]: q_a + kv_a fused, kv_a alone
# (576 rows: a ragged scale block), q_b, o_proj, the shared experts' gate + up and down.
V3_SHAPES = [
    (2112, 7168),
    (576, 7168),
    (24576, 1536),
    (7168, 16384),
    (4096, 7168),
    (7168, 2048),
]
# a decode row, a decode batch, a prefill chunk (each a DeepGEMM JIT compile per shape)
V3_ROWS = [1, 200, 4000]


def _problem(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.05
    q, scale_inv = quantize_fp8_block(w)
    return x.to(device), q.to(device), scale_inv.to(device)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()
    return float((out - ref).norm() / ref.norm())


@pytest.mark.parametrize(("m", "n", "k"), [(7, 256, 384), (3, 48, 64), (5, 130, 200)])
def test_reference_is_dequantise_then_multiply(m: int, n: int, k: int) -> None:
    """Exactly, in float32, for whole and ragged blocks (K padded with zeros to 128s)."""
    x, q, scale_inv = _problem(m, n, k, torch.float32, "cpu")
    pad = -k % 128
    xq, xs = quantize_fp8_per_token_group(torch.nn.functional.pad(x, (0, pad)))
    a = dequantize_fp8_per_token_group(xq, xs)[:, :k]
    expected = a @ dequantize_fp8_block(q, scale_inv).T
    assert torch.equal(fp8_linear_ref(x, q, scale_inv), expected)
    aq, a_scale = quantize_activation_ref(x)
    assert aq.shape == x.shape and a_scale.shape == (m, -(-k // 128))
    # batched leading dims and the backend name reach the same function
    x3 = x.view(1, m, k)
    assert torch.equal(fp8_linear(x3, q, scale_inv, "torch"), expected.view(1, m, n))


def test_bad_inputs_name_what_is_wrong() -> None:
    x, q, scale_inv = _problem(2, 256, 256, torch.float32, "cpu")
    with pytest.raises(ValueError, match="last dim 128 must be the weight's K = 256"):
        fp8_linear_ref(x[:, :128], q, scale_inv)
    with pytest.raises(ValueError, match=r"weight_scale_inv .* must be float32 \(2, 2\)"):
        fp8_linear_ref(x, q, scale_inv[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear_ref(x, q.float(), scale_inv)
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_linear(x, q, scale_inv, "cublas")
    # without DeepGEMM (or a GPU) its check says why instead of raising
    if not available("deep_gemm"):
        assert deep_gemm_linear_problem("cpu").startswith("fp8_gemm_nt failed")


def test_tile_sizes_follow_the_row_count() -> None:
    assert gemm_config(1)["block_m"] == 16
    assert gemm_config(256) == {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 4}
    assert gemm_config(16000)["block_m"] == 128
    assert deep_gemm_fits(576, 7168, torch.bfloat16)
    assert not deep_gemm_fits(48, 64, torch.bfloat16)  # a toy shape: Triton
    assert not deep_gemm_fits(576, 7168, torch.float16)  # DeepGEMM writes bf16
    assert not deep_gemm_fits(576, 7168, torch.bfloat16, n_align=128)


SMALL = [(1, 256, 256), (37, 192, 384), (5, 48, 64), (70, 130, 200)]


@needs_triton
@pytest.mark.parametrize(("m", "n", "k"), SMALL)
def test_triton_equals_reference(m: int, n: int, k: int, device: str) -> None:
    """Small shapes (the CPU interpreter runs them too): thin and wide row tiles, ragged N
    and ragged K (a toy checkpoint's 64-wide hidden size). The GEMM equals the dequantised
    product of the activations as the Triton quantisation coded them (the interpreter
    rounds some e4m3 codes differently from torch: tests/kernels/conftest.py), and on the GPU
    the whole linear equals the torch reference."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, q, scale_inv = _problem(m, n, k, dtype, device)
    out = fp8_linear(x, q, scale_inv, "triton")
    assert out.shape == (m, n) and out.dtype == dtype
    xq, xs = per_token_group_quant_fp8(torch.nn.functional.pad(x, (0, -k % 128)))
    a = dequantize_fp8_per_token_group(xq.cpu(), xs.cpu())[:, :k]
    expected = a @ dequantize_fp8_block(q.cpu(), scale_inv.cpu()).T
    assert _rel(out, expected) < (1e-2 if device == "cuda" else 1e-6)
    if device == "cuda":
        assert _rel(out, fp8_linear_ref(x.float(), q, scale_inv)) < 1e-2


@needs_triton
def test_mn_major_scales_hold_the_same_values(device: str) -> None:
    """DeepGEMM's layout: each group's scales contiguous, rows padded to 4 (16 bytes)."""
    x = torch.randn(6, 384).to(device)
    q, s = per_token_group_quant_fp8(x, 128)
    q_mn, s_mn = per_token_group_quant_fp8(x, 128, mn_major_scales=True)
    assert s_mn.shape == (6, 3) and s_mn.stride() == (1, 8)
    assert torch.equal(s_mn, s) and torch.equal(q_mn.view(torch.uint8), q.view(torch.uint8))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", V3_ROWS)
@pytest.mark.parametrize(("n", "k"), V3_SHAPES)
def test_triton_equals_reference_at_v3_shapes(m: int, n: int, k: int) -> None:
    x, q, scale_inv = _problem(m, n, k, torch.bfloat16, "cuda")
    out = fp8_linear(x, q, scale_inv, "triton")
    ref = fp8_linear_ref(x.float(), q, scale_inv)
    assert _rel(out, ref) < 1e-2


@needs_deep_gemm
@pytest.mark.gpu
@pytest.mark.parametrize("m", V3_ROWS)
@pytest.mark.parametrize(("n", "k"), V3_SHAPES)
def test_deep_gemm_equals_reference_and_triton(m: int, n: int, k: int) -> None:
    x, q, scale_inv = _problem(m, n, k, torch.bfloat16, "cuda")
    out = fp8_linear(x, q, scale_inv, "deep_gemm")
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert _rel(out, fp8_linear_ref(x.float(), q, scale_inv)) < 1e-2
    assert _rel(out, fp8_linear(x, q, scale_inv, "triton")) < 1e-2


@needs_deep_gemm
@pytest.mark.gpu
def test_the_installed_deep_gemm_passes_the_dense_gemm_check() -> None:
    """The start-up check the engine runs before choosing DeepGEMM for the linears; V3's
    576-row kv_a_proj (a ragged scale block) should run on it too."""
    from dsmesh.kernels.fp8_linear import deep_gemm_n_alignment

    assert deep_gemm_linear_problem() == ""
    assert deep_gemm_n_alignment() == 64


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "deep_gemm"])
def test_graph_replay_follows_new_inputs(backend: str) -> None:
    """Quantisation and GEMM inside a CUDA graph (no host sync, static shapes): a replay
    on new activations equals the eager call on them."""
    if backend == "deep_gemm" and not available("deep_gemm"):
        pytest.skip("DeepGEMM is not installed (pip install dsmesh[deepgemm])")
    x, q, scale_inv = _problem(64, 2112, 7168, torch.bfloat16, "cuda")
    fp8_linear(x, q, scale_inv, backend)  # compile / JIT outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, q, scale_inv, backend)
    for seed in (1, 2):
        x.copy_(_problem(64, 2112, 7168, torch.bfloat16, "cuda", seed)[0])
        graph.replay()
        assert torch.equal(out, fp8_linear(x, q, scale_inv, backend))
