"""DeepGEMM's FP8 grouped GEMM behind dsmesh's contract (dsmesh/kernels/moe_gemm_deepgemm.py).

The padded layout is plain torch and runs everywhere. The GEMM tests need a Hopper GPU with
DeepGEMM installed (``pip install dsmesh[deepgemm]``); they compare it with the dequantised
reference and with dsmesh's Triton FP8 grouped GEMM, eagerly and in a CUDA graph replayed
with other routing, and check that FP8 experts take DeepGEMM exactly where
``prefers_deep_gemm`` says. Measured on the H200 with torch 2.11 and sgl-deep-gemm 0.1.5.
"""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.backends import available
from dsmesh.kernels.fp8 import Fp8ExpertWeights, quantize_fp8_block
from dsmesh.kernels.moe_gemm import (
    expert_ffn_fp8,
    expert_ffn_fp8_ref,
    fp8_expert_backend,
    fp8_grouped_gemm,
    fp8_grouped_gemm_ref,
)
from dsmesh.kernels.moe_gemm_deepgemm import MIN_ROWS_PER_EXPERT, padded_layout, prefers_deep_gemm
from tests.kernels.conftest import HAS_CUDA

needs_deep_gemm = pytest.mark.skipif(
    not (HAS_CUDA and available("deep_gemm")),
    reason="needs a CUDA device and DeepGEMM (pip install dsmesh[deepgemm])",
)


@pytest.mark.parametrize("counts", [[3, 0, 130, 1, 0, 128], [0, 0, 0, 5], [256]])
def test_padded_layout_aligns_each_expert_and_keeps_row_order(counts) -> None:
    align = 128
    tokens = torch.tensor(counts)
    m = int(tokens.sum())
    dst, layout = padded_layout(tokens, m, align)
    e_count = len(counts)
    assert layout.dtype == torch.int32
    assert layout.shape[0] % align == 0 and layout.shape[0] >= m + e_count * (align - 1)
    expert = torch.repeat_interleave(torch.arange(e_count), tokens)
    assert layout[dst].tolist() == expert.tolist()  # each row keeps its expert
    assert int((layout >= 0).sum()) == m  # every other row is padding (-1)
    assert len(set(dst.tolist())) == m
    start = 0
    for e, n in enumerate(counts):
        rows = dst[start : start + n]
        start += n
        if n:
            assert int(rows[0]) % align == 0  # the expert's segment starts aligned
            assert rows.tolist() == list(range(int(rows[0]), int(rows[0]) + n))  # in order
            assert not bool((layout[int(rows[0]) : int(rows[0]) + n] != e).any())


def test_deep_gemm_is_preferred_only_with_many_rows_per_expert() -> None:
    assert not prefers_deep_gemm(256 * 8, 256)  # V3 decode, batch 256: 8 rows per expert
    assert not prefers_deep_gemm(4096 * 8, 256)  # 128 rows per expert: Triton still wins
    assert prefers_deep_gemm(8192 * 8, 256)  # V3 prefill of 8192 tokens: 256 per expert
    assert prefers_deep_gemm(MIN_ROWS_PER_EXPERT * 64, 64)
    assert not prefers_deep_gemm(MIN_ROWS_PER_EXPERT * 64 - 1, 64)
    assert prefers_deep_gemm(10, 1, min_rows_per_expert=10)
    assert not prefers_deep_gemm(0, 0)


class _FakeDeepGemm:
    """Stands in for DeepGEMM's host library, which cannot run without a Hopper GPU."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour

    def get_mn_major_tma_aligned_tensor(self, x: torch.Tensor) -> torch.Tensor:
        if self.behaviour == "mismatched torch":
            raise RuntimeError("Assertion error (csrc/utils/layout.hpp:16): dim == 2 or dim == 3")
        if self.behaviour == "garbage":
            return torch.zeros_like(x)
        return x.t().contiguous().t()  # MN-major: same values, transposed storage


@pytest.mark.parametrize(
    ("behaviour", "expect"),
    [("works", ""), ("mismatched torch", "dim == 2 or dim == 3"), ("garbage", "other values")],
)
def test_a_deep_gemm_built_for_another_torch_is_refused(behaviour, expect) -> None:
    from dsmesh.kernels.moe_gemm_deepgemm import reads_tensors_correctly

    problem = reads_tensors_correctly(_FakeDeepGemm(behaviour), "cpu")
    assert (expect in problem) if expect else problem == ""


@needs_deep_gemm
@pytest.mark.gpu
def test_the_installed_deep_gemm_passes_its_load_check() -> None:
    from dsmesh.kernels.moe_gemm_deepgemm import load_deep_gemm

    assert load_deep_gemm() is not None


def _problem(e: int, n: int, k: int, counts: list[int], seed: int = 0):
    from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    blocks = [quantize_fp8_block(w[i]) for i in range(e)]
    w_fp8, w_scale = torch.stack([q for q, _ in blocks]), torch.stack([s for _, s in blocks])
    a, a_scale = per_token_group_quant_fp8(x, 128)
    return a, a_scale, w_fp8, w_scale, torch.tensor(counts, device="cuda")


def _assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float = 1e-2) -> None:
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < tol, float(err)


@needs_deep_gemm
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("e", "n", "k", "counts"),
    [
        (4, 256, 512, [3, 0, 130, 1]),  # empty experts, one spanning two 128-row blocks
        (8, 4096, 7168, [1, 0, 2, 7, 0, 0, 3, 1]),  # V3 gate/up, decode-sized
        (8, 7168, 2048, [300, 41, 0, 0, 512, 9, 77, 128]),  # V3 down, prefill-sized
    ],
)
def test_equals_reference_and_triton(e, n, k, counts) -> None:
    from dsmesh.kernels.moe_gemm_deepgemm import deepgemm_fp8_grouped_gemm

    a, a_scale, w, w_scale, tokens = _problem(e, n, k, counts)
    out = deepgemm_fp8_grouped_gemm(a, a_scale, w, w_scale, tokens)
    assert out.shape == (sum(counts), n) and out.dtype == torch.bfloat16
    _assert_close(out, fp8_grouped_gemm_ref(a, a_scale, w, w_scale, tokens.cpu()))
    _assert_close(out, fp8_grouped_gemm(a, a_scale, w, w_scale, tokens))


@needs_deep_gemm
@pytest.mark.gpu
def test_graph_replay_follows_new_routing() -> None:
    """Same row count, other expert counts: the layout is built on the device inside the
    graph, so a replay follows the new routing."""
    from dsmesh.kernels.moe_gemm_deepgemm import deepgemm_fp8_grouped_gemm

    a, a_scale, w, w_scale, tokens = _problem(6, 512, 1024, [10, 0, 50, 3, 0, 1])
    out = deepgemm_fp8_grouped_gemm(a, a_scale, w, w_scale, tokens)  # JIT outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = deepgemm_fp8_grouped_gemm(a, a_scale, w, w_scale, tokens)
    for counts in ([0, 64, 0, 0, 0, 0], [1, 2, 3, 4, 5, 49], [10, 0, 50, 3, 0, 1]):
        tokens.copy_(torch.tensor(counts))
        graph.replay()
        _assert_close(out, fp8_grouped_gemm_ref(a, a_scale, w, w_scale, tokens.cpu()))


def test_fp8_expert_backend_is_triton_off_cuda_and_rejects_unknown_names() -> None:
    w13 = torch.randn(2, 256, 128) * 0.05
    w2 = torch.randn(2, 128, 128) * 0.05
    weights = Fp8ExpertWeights.from_dense(w13, w2)
    hidden = torch.randn(4096, 128, dtype=torch.bfloat16)  # 2048 rows per expert, on CPU
    assert fp8_expert_backend(hidden, weights) == "triton"
    with pytest.raises(ValueError, match="backend"):
        expert_ffn_fp8(hidden, torch.tensor([4000, 96]), weights, backend="cutlass")


def _experts(counts: list[int], hidden_size: int = 256, inter: int = 256):
    g = torch.Generator(device="cuda").manual_seed(1)
    e = len(counts)
    w13 = torch.randn(e, 2 * inter, hidden_size, device="cuda", generator=g) * 0.05
    w2 = torch.randn(e, hidden_size, inter, device="cuda", generator=g) * 0.05
    weights = Fp8ExpertWeights.from_dense(w13, w2)
    hidden = torch.randn(sum(counts), hidden_size, device="cuda", generator=g)
    return hidden.to(torch.bfloat16), torch.tensor(counts, device="cuda"), weights


@needs_deep_gemm
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("counts", "hidden_size", "inter"),
    [
        ([130, 0, 3, 1, 256], 256, 384),  # empty expert, rows spanning 128-row blocks
        ([40, 7, 0, 300], 7168, 2048),  # V3 widths
        ([0, 0, 5], 2048, 1408),  # V2-Lite widths (1408 = 11 blocks of 128)
    ],
)
def test_padded_ffn_equals_reference_and_triton(counts, hidden_size, inter) -> None:
    from dsmesh.kernels.moe_gemm_deepgemm import deepgemm_expert_ffn_fp8

    hidden, tokens, weights = _experts(counts, hidden_size, inter)
    out = deepgemm_expert_ffn_fp8(hidden, tokens, weights)
    assert out.shape == hidden.shape and out.dtype == torch.bfloat16
    # Both FP8 pipelines round the bf16 gate/up product before quantising it, where the
    # reference keeps float32: the same 2e-2 as the Triton pipeline's own test. Against the
    # Triton pipeline the products agree to the last bit on the H200 (same per-128 promotion).
    _assert_close(out, expert_ffn_fp8_ref(hidden, tokens.cpu(), weights), tol=2e-2)
    _assert_close(out, expert_ffn_fp8(hidden, tokens, weights, backend="triton"), tol=1e-3)


def _spy_experts(monkeypatch, counts: list[int]) -> tuple[list, torch.Tensor, torch.Tensor]:
    """FP8 experts on ``counts`` rows per expert, with DeepGEMM's calls recorded."""
    import dsmesh.kernels.moe_gemm_deepgemm as adapter

    calls = []
    real = adapter.deepgemm_expert_ffn_fp8

    def spy(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(adapter, "deepgemm_expert_ffn_fp8", spy)
    hidden, tokens, weights = _experts(counts)
    out = expert_ffn_fp8(hidden, tokens, weights)
    return calls, out, expert_ffn_fp8_ref(hidden, tokens.cpu(), weights)


@needs_deep_gemm
@pytest.mark.gpu
def test_fp8_experts_use_deep_gemm_for_many_rows_per_expert(monkeypatch) -> None:
    counts = [2 * MIN_ROWS_PER_EXPERT, 0, 3 * MIN_ROWS_PER_EXPERT + 5, MIN_ROWS_PER_EXPERT]
    calls, out, ref = _spy_experts(monkeypatch, counts)
    assert calls == [(sum(counts), 256)]
    _assert_close(out, ref, tol=2e-2)


@needs_deep_gemm
@pytest.mark.gpu
def test_fp8_experts_keep_triton_for_few_rows_per_expert(monkeypatch) -> None:
    calls, out, ref = _spy_experts(monkeypatch, [5, 0, 12, 3])
    assert calls == []
    _assert_close(out, ref, tol=2e-2)
