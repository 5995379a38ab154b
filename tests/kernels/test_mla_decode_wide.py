"""The 64-head MLA decode kernel (dsmesh/kernels/mla_decode_wide.py) and the FP8 cache in both
decode kernels equal their torch reference; the reference over FP8 equals the reference over
the dequantised cache.

On CPU the kernels run in Triton's interpreter in float32 (its bf16 products are wrong,
docs/KERNELS.md); on a GPU in bf16, where the wide kernel's products are warpgroup MMAs.
"""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.mla_decode import (
    fp8_kv_pages,
    mla_decode,
    mla_decode_ref,
    uses_wide_kernel,
)
from dsmesh.kernels.mla_decode_wide import wide_config, wide_num_splits
from tests.kernels.conftest import HAS_CUDA, needs_cuda, needs_triton
from tests.kernels.test_mla_decode import make_case, rel_err

# float32 in the interpreter (exact up to summation order), bf16 on the GPU
DTYPE, TOL = (torch.bfloat16, 1e-2) if HAS_CUDA else (torch.float32, 1e-5)
WIDE = {"kernel": "wide"}


def dequantised(kv8: torch.Tensor, scales: torch.Tensor, c: int) -> torch.Tensor:
    lat = kv8[..., :c].float() * scales[..., :1]
    return torch.cat([lat, kv8[..., c:].float() * scales[..., 1:]], dim=-1)


def test_wide_kernel_choice_and_splits_depend_on_shapes_only() -> None:
    assert uses_wide_kernel(128, 512, 64, torch.bfloat16)
    assert uses_wide_kernel(64, 512, 64, torch.float16)
    assert not uses_wide_kernel(16, 512, 64, torch.bfloat16)  # V2-Lite: memory-bound, 16 rows
    assert not uses_wide_kernel(128, 512, 64, torch.float32)
    assert not uses_wide_kernel(128, 500, 64, torch.bfloat16)  # widths must be powers of two
    assert wide_num_splits(128, 128, 2048, 132) == 1  # 256 programs: two full waves
    assert wide_num_splits(32, 128, 2048, 132) == 2  # 128 programs
    assert wide_num_splits(1, 128, 32768, 132) == 64
    assert wide_num_splits(1, 128, 2048, 132) == 32  # pieces of at least 64 tokens
    assert wide_num_splits(1, 128, 100, 132) == 2
    cfg = wide_config(128, 128, 2048, fp8=False)
    assert cfg["num_warps"] == 8 and cfg["block_n"] in (16, 32, 64)


def test_fp8_pages_layout_and_reference() -> None:
    """The pool's page layout (values, then two float32 scales per token, in one uint8 page)
    and the reference over it: equal to the reference over the dequantised cache."""
    case = make_case(3, 4, 32, 16, 4, [0, 9, 30], torch.float32, "cpu", seed=2)
    q, q_pe, kv, pt, lens = case
    kv8, scales = fp8_kv_pages(kv, 32)
    page_bytes = 4 * 48 + 4 * 8
    assert kv8.dtype == torch.float8_e4m3fn and kv8.stride() == (page_bytes, 48, 1)
    assert scales.shape == (kv.shape[0], 4, 2) and scales.stride() == (page_bytes // 4, 2, 1)
    deq = dequantised(kv8, scales, 32)
    assert 0 < rel_err(deq, kv) < 0.04  # e4m3 keeps 3 mantissa bits
    assert kv8[..., :32].float().abs().amax() == 448  # each token's largest value maps to 448
    ref8 = mla_decode_ref(q, q_pe, kv8, pt, lens, 0.3, kv_scales=scales)
    assert rel_err(ref8, mla_decode_ref(q, q_pe, deq, pt, lens, 0.3)) < 1e-6
    assert ref8[0].abs().max() == 0


@needs_triton
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize(
    ("h", "page_size", "lens"),
    [
        (128, 16, [0, 1, 70, 33]),
        (128, 1, [1, 17, 0]),
        (128, 64, [130, 64, 1]),
        (16, 16, [5, 0, 40]),  # 16 heads in a 64-head block: the other rows masked
        (72, 64, [65, 2]),  # a second, partial head block
    ],
)
def test_wide_kernel_equals_reference(h, page_size, lens, num_splits, device) -> None:
    case = make_case(len(lens), h, 64, 16, page_size, lens, DTYPE, device, seed=h + page_size)
    out = mla_decode(*case, scale=0.2, num_splits=num_splits, config=WIDE)
    ref = mla_decode_ref(*case, scale=0.2)
    assert out.shape == (len(lens), h, 64) and out.dtype == DTYPE
    assert rel_err(out.cpu(), ref.cpu()) < TOL
    for i, n in enumerate(lens):
        assert (out[i].abs().max() == 0) == (n == 0)  # an empty context gives zeros


@needs_triton
@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_wide_kernel_tiles(block_n, device) -> None:
    """Tiles inside one page and across pages, pieces cut at tile multiples."""
    lens = [1, 40, 75]
    case = make_case(3, 64, 32, 16, 16, lens, DTYPE, device, seed=block_n)
    cfg = {**WIDE, "block_n": block_n, "num_stages": 2}
    out = mla_decode(*case, scale=0.2, num_splits=2, config=cfg)
    assert rel_err(out.cpu(), mla_decode_ref(*case, scale=0.2).cpu()) < TOL


@needs_triton
@pytest.mark.parametrize("kernel", ["wide", "narrow"])
@pytest.mark.parametrize(("h", "page_size", "num_splits"), [(128, 16, 1), (16, 4, 3), (64, 1, 2)])
def test_fp8_cache_equals_reference_and_dequantised_run(
    kernel, h, page_size, num_splits, device
) -> None:
    """FP8 values with per-token scales (a strided view of the page buffer) equal the
    reference over them, and the same kernel over the dequantised cache (exactly so in
    float32; in bf16 up to the dequantised cache's rounding)."""
    lens = [0, 37, 20, 1]
    q, q_pe, kv, pt, seq = make_case(4, h, 64, 16, page_size, lens, DTYPE, device, seed=h)
    kv8, scales = fp8_kv_pages(kv, 64)
    cfg = {"kernel": kernel}
    out = mla_decode(
        q, q_pe, kv8, pt, seq, 0.2, num_splits=num_splits, config=cfg, kv_scales=scales
    )
    ref = mla_decode_ref(q, q_pe, kv8, pt, seq, 0.2, kv_scales=scales)
    assert out.dtype == DTYPE and out[0].abs().max() == 0
    assert rel_err(out.cpu(), ref.cpu()) < TOL
    deq = dequantised(kv8, scales, 64).to(DTYPE)
    plain = mla_decode(q, q_pe, deq, pt, seq, 0.2, num_splits=num_splits, config=cfg)
    assert rel_err(out.cpu(), plain.cpu()) < TOL
    assert rel_err(ref.cpu(), mla_decode_ref(q, q_pe, kv, pt, seq, 0.2).cpu()) > 1e-3  # it is FP8


@needs_triton
def test_fp8_argument_errors(device) -> None:
    q, q_pe, kv, pt, lens = make_case(2, 4, 32, 16, 4, [3, 5], torch.float32, device)
    kv8, scales = fp8_kv_pages(kv, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mla_decode(q, q_pe, kv, pt, lens, 0.2, kv_scales=scales)
    with pytest.raises(ValueError, match="needs kv_scales"):
        mla_decode(q, q_pe, kv8, pt, lens, 0.2)
    with pytest.raises(ValueError, match="kv_scales must be"):
        mla_decode(q, q_pe, kv8, pt, lens, 0.2, kv_scales=scales[:, :2])


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("b", "ctx"), [(1, 2000), (8, 4097), (130, 300)])
def test_deepseek_v3_shapes_on_gpu(b, ctx, fp8) -> None:
    """128 heads, 512 + 64: the shapes choose the wide kernel; the narrow one agrees."""
    lens = [max(0, ctx - 37 * i) for i in range(b)]
    q, q_pe, kv, pt, seq = make_case(b, 128, 512, 64, 16, lens, torch.bfloat16, "cuda", seed=b)
    extra = {}
    if fp8:
        kv, extra["kv_scales"] = fp8_kv_pages(kv, 512)
    assert uses_wide_kernel(128, 512, 64, q.dtype)
    out = mla_decode(q, q_pe, kv, pt, seq, 0.1, **extra)
    ref = mla_decode_ref(q, q_pe, kv, pt, seq, 0.1, **extra)
    assert rel_err(out, ref) < 1e-2
    narrow = mla_decode(q, q_pe, kv, pt, seq, 0.1, config={"kernel": "narrow"}, **extra)
    assert rel_err(out, narrow) < 1e-2


@needs_cuda
def test_wide_kernel_cuda_graph_capture_and_replay() -> None:
    case = make_case(4, 128, 512, 64, 16, [300] * 4, torch.bfloat16, "cuda", seed=7)
    q, q_pe, kv, pt, lens = case
    out = torch.empty(4, 128, 512, dtype=torch.bfloat16, device="cuda")
    mla_decode(q, q_pe, kv, pt, lens, 0.1, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, q_pe, kv, pt, lens, 0.1, out=out)
    lens.copy_(torch.tensor([1, 64, 0, 255], dtype=torch.int32))
    pt.copy_(pt.flip(1))
    q.normal_()
    graph.replay()
    assert rel_err(out, mla_decode_ref(q, q_pe, kv, pt, lens, 0.1)) < 1e-2
    assert out[2].abs().max() == 0
