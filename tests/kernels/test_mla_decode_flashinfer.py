"""FlashInfer's MLA decode behind dsmesh's decode contract
(dsmesh/kernels/mla_decode_flashinfer.py).

The host-side page layout runs everywhere. The kernel tests need a GPU with FlashInfer
installed (``pip install flashinfer-python``); they compare it with dsmesh's reference
(:func:`dsmesh.kernels.mla_decode.mla_decode_ref`) eagerly and inside CUDA graphs re-planned between
replays, for both of FlashInfer's Hopper paths (fa2, fa3).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsmesh.kernels.backends import available
from dsmesh.kernels.mla_decode import mla_decode_ref
from dsmesh.kernels.mla_decode_flashinfer import FlashInferMLADecode, paged_indices
from tests.kernels.conftest import HAS_CUDA
from tests.kernels.test_mla_decode import make_case

needs_flashinfer = pytest.mark.skipif(
    not (HAS_CUDA and available("flashinfer")),
    reason="needs a CUDA device and FlashInfer (pip install flashinfer-python)",
)
C, R = 512, 64  # DeepSeek's latent and rope widths


def test_paged_indices_lists_each_requests_pages_in_token_order() -> None:
    rng = np.random.default_rng(0)
    page_size = 4
    lens = np.array([0, 1, 4, 5, 16, 13])
    table = rng.permutation(60)[:24].reshape(6, 4).astype(np.int32)
    indptr, indices = paged_indices(table, lens, page_size)
    assert indptr.dtype == indices.dtype == np.int32
    want = [table[i, : -(-n // page_size)] for i, n in enumerate(lens)]
    assert indptr.tolist() == [0, *np.cumsum([len(w) for w in want]).tolist()]
    assert indices.tolist() == np.concatenate(want).tolist()
    for i, w in enumerate(want):  # request i's slice is its own pages
        assert indices[indptr[i] : indptr[i + 1]].tolist() == w.tolist()


def test_paged_indices_rejects_bad_tables() -> None:
    table = np.zeros((2, 3), dtype=np.int32)
    with pytest.raises(ValueError, match="row 1: 13 tokens need 4 pages"):
        paged_indices(table, np.array([1, 13]), 4)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        paged_indices(table, np.array([1, -1]), 4)
    with pytest.raises(ValueError, match=r"seq_lens \[B\]"):
        paged_indices(table, np.array([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="page_size"):
        paged_indices(table, np.array([1, 2]), 0)


def _decoder(q, q_pe, page_size, table, scale, backend, graph=False) -> FlashInferMLADecode:
    return FlashInferMLADecode(
        q.device, q.shape[1], q.shape[2], q_pe.shape[2], page_size, q.dtype, scale,
        table.shape[1], graph=graph, backend=backend,
    )  # fmt: skip


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2, float(err)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize(
    ("h", "page_size", "lens"),
    [
        (16, 16, [2000, 1, 17, 16, 640, 333]),  # V2-Lite heads, dsmesh's page size
        (128, 16, [129, 1000, 7]),  # V3 heads
        (16, 1, [5, 300]),  # one token per page
        (16, 64, [64, 65, 1]),
    ],
)
def test_equals_reference(backend, h, page_size, lens) -> None:
    q, q_pe, kv, table, seq_lens = make_case(
        len(lens), h, C, R, page_size, lens, torch.bfloat16, "cuda", seed=3
    )
    scale = 0.1
    fi = _decoder(q, q_pe, page_size, table, scale, backend)
    fi.plan(table.cpu().numpy(), seq_lens.cpu().numpy())
    ref = mla_decode_ref(q, q_pe, kv, table, seq_lens, scale)
    _assert_close(fi(q, q_pe, kv, table, seq_lens, scale), ref)
    # The graph runner's layout: q from a head-major GEMM and a head-major output, both
    # strided views; FlashInfer reads the strides, so no copies are needed.
    q_hm = q.transpose(0, 1).contiguous().transpose(0, 1)
    out = torch.empty(h, len(lens), C, dtype=q.dtype, device="cuda").transpose(0, 1)
    assert fi(q_hm, q_pe, kv, table, seq_lens, scale, out=out) is out
    _assert_close(out, ref)


@needs_flashinfer
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_graph_replays_follow_each_new_plan(backend) -> None:
    """One capture, then steps with other lengths and pages: re-planning before each replay
    is all a step needs (the schedule lives in device buffers the graph reads)."""
    page_size, b, h, scale = 16, 4, 16, 0.125
    cases = [
        make_case(b, h, C, R, page_size, lens, torch.bfloat16, "cuda", seed=s, num_pages=600)
        for s, lens in enumerate([[100, 7, 1500, 33], [101, 8, 1501, 34], [3, 1900, 16, 600]])
    ]
    q, q_pe, kv, table, seq_lens = (t.clone() for t in cases[0])
    width = max(c[3].shape[1] for c in cases)
    table = torch.zeros(b, width, dtype=torch.int32, device="cuda")
    fi = _decoder(q, q_pe, page_size, table, scale, backend, graph=True)

    def load(case) -> None:
        for dst, src in zip((q, q_pe, kv), case[:3], strict=True):
            dst.copy_(src)
        table.zero_()
        table[:, : case[3].shape[1]] = case[3]
        seq_lens.copy_(case[4])
        fi.plan(table.cpu().numpy(), seq_lens.cpu().numpy())

    load(cases[0])
    out = torch.empty(b, h, C, dtype=q.dtype, device="cuda")
    fi(q, q_pe, kv, table, seq_lens, scale, out=out)  # warm-up (and JIT) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fi(q, q_pe, kv, table, seq_lens, scale, out=out)
    for case in (*cases[1:], cases[0]):
        load(case)
        graph.replay()
        _assert_close(out, mla_decode_ref(q, q_pe, kv, table, seq_lens, scale))


@needs_flashinfer
@pytest.mark.gpu
def test_calls_must_match_the_plan() -> None:
    q, q_pe, kv, table, seq_lens = make_case(3, 16, C, R, 16, [5, 40, 9], torch.bfloat16, "cuda")
    fi = _decoder(q, q_pe, 16, table, 0.1, "auto")
    with pytest.raises(RuntimeError, match="call plan"):
        fi(q, q_pe, kv, table, seq_lens, 0.1)
    fi.plan(table.cpu().numpy(), seq_lens.cpu().numpy())
    with pytest.raises(RuntimeError, match="planned for batch 3, called with 2"):
        fi(q[:2], q_pe[:2], kv, table[:2], seq_lens[:2], 0.1)
    with pytest.raises(ValueError, match="scale"):
        fi(q, q_pe, kv, table, seq_lens, 0.2)
    with pytest.raises(ValueError, match="max_pages_per_request"):
        fi.plan(np.zeros((3, table.shape[1] + 1), np.int32), seq_lens.cpu().numpy())
