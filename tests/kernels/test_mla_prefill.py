"""Triton MLA prefill (ragged batch, cached prefixes, causal) equals its torch reference, and
the reference equals the engine's naive attention."""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.mla_prefill import mla_prefill, mla_prefill_ref
from tests.kernels.conftest import needs_cuda, needs_triton


def make_case(q_lens, prefixes, h, d, r, dv, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(q_lens)
    s = sum(q + p for q, p in zip(q_lens, prefixes, strict=True))
    # q_nope and k_nope as strided views into wider buffers, as the engine passes them
    q = torch.randn(t, h, d + r, generator=g)
    kv = torch.randn(s, h, d + dv, generator=g)
    k_pe = torch.randn(s, r, generator=g)
    cu_q = torch.tensor([0, *q_lens]).cumsum(0).int()
    cu_k = torch.tensor([0, *[q + p for q, p in zip(q_lens, prefixes, strict=True)]]).cumsum(0)
    q, kv, k_pe = (x.to(device, dtype) for x in (q, kv, k_pe))
    return (
        q[..., :d],
        q[..., d:],
        kv[..., :d],
        k_pe,
        kv[..., d:],
        cu_q.to(device),
        cu_k.int().to(device),
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_reference_equals_engine_naive_attention() -> None:
    """One request with a prefix: the reference equals MLAttention.attend_naive's math."""
    from dsmesh.engine.model.mla import MLAttention

    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k = make_case(
        [5], [7], 3, 8, 4, 6, torch.float32, "cpu"
    )
    ref = mla_prefill_ref(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, 0.3)
    attn = MLAttention.__new__(MLAttention)
    attn.num_heads = 3
    q = torch.cat([q_nope, q_pe], -1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(12, 3, 4)], -1)
    scores = torch.einsum("nhd,shd->hns", q, k) * 0.3
    probs = MLAttention._softmax(attn, scores, 5, 7)
    want = torch.einsum("hns,shv->nhv", probs, v)
    assert rel_err(ref, want) < 1e-6


@needs_triton
@pytest.mark.parametrize(
    ("q_lens", "prefixes"),
    [([1, 17, 40], [0, 0, 0]), ([9, 3], [20, 0]), ([70], [5]), ([1, 1], [33, 0])],
)
def test_kernel_equals_reference(q_lens, prefixes, device) -> None:
    case = make_case(q_lens, prefixes, 3, 16, 16, 16, torch.float32, device, seed=len(q_lens))
    out = mla_prefill(*case, scale=0.25, max_q_len=max(q_lens), config={"block_n": 16})
    ref = mla_prefill_ref(*case, scale=0.25)
    assert out.shape == (sum(q_lens), 3, 16)
    assert rel_err(out.cpu(), ref.cpu()) < 1e-5


@needs_triton
def test_kernel_odd_dims_and_errors(device) -> None:
    case = make_case([6, 4], [3, 9], 2, 24, 8, 20, torch.float32, device, seed=3)
    out = mla_prefill(*case, scale=0.25, max_q_len=6)
    assert rel_err(out.cpu(), mla_prefill_ref(*case, scale=0.25).cpu()) < 1e-5
    q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k = case
    with pytest.raises(ValueError, match="do not match"):
        mla_prefill(q_nope, q_pe, k_nope[:, :1], k_pe, v, cu_q, cu_k, 0.25, 6)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepseek_shapes_on_gpu(dtype) -> None:
    case = make_case([2000, 300, 1], [0, 1700, 2047], 16, 128, 64, 128, dtype, "cuda", seed=7)
    out = mla_prefill(*case, scale=0.1, max_q_len=2000)
    ref = mla_prefill_ref(*case, scale=0.1)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
