"""Triton MLA decode (split-K over the paged latent cache) equals its torch reference, and the
reference equals plain attention over the gathered context."""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.mla_decode import mla_decode, mla_decode_ref, num_splits_for
from tests.kernels.conftest import needs_cuda, needs_triton


def make_case(b, h, c, r, page_size, lens, dtype, device, seed=0, num_pages=None):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lens) + 1  # one spare column of padding
    num_pages = num_pages or b * max_pages + 3
    kv = torch.randn(num_pages, page_size, c + r, generator=g)
    pages = torch.randperm(num_pages, generator=g)[: b * max_pages].view(b, max_pages)
    q_latent = torch.randn(b, h, c, generator=g)
    q_pe = torch.randn(b, h, r, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def to(x):
        return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)

    return to(q_latent), to(q_pe), to(kv), to(pages.int()), to(seq_lens)


def gathered_attention(q_latent, q_pe, kv, page_table, seq_lens, scale) -> torch.Tensor:
    """Per request in float64: gather its tokens, attend, no masking tricks."""
    outs = []
    page_size, c = kv.shape[1], q_latent.shape[-1]
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        ctx = kv.double()[page_table[i].long()[pos // page_size], pos % page_size]
        s = (q_latent[i].double() @ ctx[:, :c].T + q_pe[i].double() @ ctx[:, c:].T) * scale
        outs.append(s.softmax(-1) @ ctx[:, :c])
    return torch.stack(outs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_reference_equals_gathered_attention() -> None:
    case = make_case(3, 4, 32, 16, 4, [1, 9, 30], torch.float32, "cpu")
    ref = mla_decode_ref(*case, scale=0.3)
    want = gathered_attention(*[x.cpu() for x in case], scale=0.3)
    assert rel_err(ref, want) < 1e-6


def test_reference_empty_context_gives_zeros() -> None:
    case = make_case(2, 4, 32, 16, 4, [0, 5], torch.float32, "cpu")
    ref = mla_decode_ref(*case, scale=0.3)
    assert ref[0].abs().max() == 0 and ref[1].abs().max() > 0


def test_num_splits_only_depends_on_shapes() -> None:
    assert num_splits_for(1, 16, 4096, 16, 132) == 32
    assert num_splits_for(256, 16, 4096, 16, 132) == 1
    assert num_splits_for(128, 16, 4096, 16, 132) == 2
    assert num_splits_for(512, 128, 4096, 16, 132) == 1
    assert num_splits_for(1, 16, 100, 16, 132) == 1
    assert num_splits_for(1, 1, 1 << 20, 16, 132) == 64


@needs_triton
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize(
    ("h", "c", "r", "page_size", "lens"),
    [(4, 32, 16, 4, [1, 13, 37]), (20, 64, 8, 16, [70, 3]), (16, 32, 16, 1, [5])],
)
def test_kernel_equals_reference(h, c, r, page_size, lens, num_splits, device) -> None:
    case = make_case(len(lens), h, c, r, page_size, lens, torch.float32, device, seed=h)
    out = mla_decode(*case, scale=0.2, num_splits=num_splits)
    ref = mla_decode_ref(*case, scale=0.2)
    assert out.shape == (len(lens), h, c) and out.dtype == torch.float32
    assert rel_err(out.cpu(), ref.cpu()) < 1e-5


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("page_size", "block_n"), [(16, 16), (32, 16), (16, 32)])
def test_tiles_inside_a_page_and_across_pages(page_size, block_n, num_splits, device) -> None:
    """With BLOCK_N dividing the page size a tile reads one page id (IN_PAGE); otherwise
    each row looks its page up. Both equal the reference, masks at the tail included."""
    lens = [1, 40, 75]
    case = make_case(3, 4, 32, 16, page_size, lens, torch.float32, device, seed=page_size)
    cfg = {"block_n": block_n, "num_stages": 1}
    out = mla_decode(*case, scale=0.2, num_splits=num_splits, config=cfg)
    assert rel_err(out.cpu(), mla_decode_ref(*case, scale=0.2).cpu()) < 1e-5


@needs_triton
def test_kernel_out_argument_empty_context_and_errors(device) -> None:
    case = make_case(3, 4, 32, 16, 4, [0, 6, 11], torch.float32, device, seed=5)
    out = torch.full((3, 4, 32), float("nan"), device=device)
    res = mla_decode(*case, scale=0.2, out=out, num_splits=2)
    assert res is out
    ref = mla_decode_ref(*case, scale=0.2)
    assert not out.isnan().any() and out[0].abs().max() == 0
    assert rel_err(out.cpu(), ref.cpu()) < 1e-5
    q, q_pe, kv, pt, lens = case
    with pytest.raises(ValueError, match="kv must be"):
        mla_decode(q, q_pe, kv[..., :-1], pt, lens, 0.2)
    with pytest.raises(ValueError, match="batch size"):
        mla_decode(q, q_pe, kv, pt[:2], lens, 0.2)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("b", "h", "ctx"), [(1, 16, 2000), (32, 16, 2000), (4, 128, 4097)])
def test_deepseek_shapes_on_gpu(b, h, ctx, dtype) -> None:
    lens = [ctx - 37 * i for i in range(b)]
    case = make_case(b, h, 512, 64, 64, lens, dtype, "cuda", seed=b)
    out = mla_decode(*case, scale=0.1)
    ref = mla_decode_ref(*case, scale=0.1)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_cuda
def test_cuda_graph_capture_and_replay() -> None:
    """Fixed signature, no host syncs: capture once, change lengths and pages, replay."""
    case = make_case(8, 16, 512, 64, 64, [300] * 8, torch.bfloat16, "cuda", seed=3)
    q, q_pe, kv, pt, lens = case
    out = torch.empty(8, 16, 512, dtype=torch.bfloat16, device="cuda")
    mla_decode(q, q_pe, kv, pt, lens, 0.1, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, q_pe, kv, pt, lens, 0.1, out=out)
    lens.copy_(torch.tensor([1, 64, 65, 128, 200, 255, 256, 17], dtype=torch.int32))
    pt.copy_(pt.flip(1))
    q.normal_()
    graph.replay()
    assert rel_err(out, mla_decode_ref(q, q_pe, kv, pt, lens, 0.1)) < 1e-2
