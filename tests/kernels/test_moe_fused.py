"""Fused decode MoE (align, gate/up + SwiGLU, down + weight, combine) against per-pair float32
math, and the counting-sort align against a stable argsort."""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.moe_fused import fused_moe, fused_moe_ref, moe_align, moe_align_ref
from tests.kernels.conftest import HAS_CUDA, needs_cuda, needs_triton


def _routing(tokens: int, experts: int, k: int, seed: int, hot: int | None = None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    if hot is not None:  # every token also picks expert ``hot``: one expert gets many rows
        has = (ids == hot).any(1)
        ids[~has, 0] = hot
    weights = torch.rand(tokens, k, generator=g)
    return ids, weights


def _weights(experts: int, hidden: int, inter: int, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


@needs_triton
@pytest.mark.parametrize("tokens,experts,k", [(1, 4, 2), (13, 8, 3), (40, 6, 2)])
def test_align_is_a_stable_counting_sort(tokens, experts, k, device) -> None:
    ids, _ = _routing(tokens, experts, k, seed=tokens)
    ids[0, 0] = -1  # a pair routed to another rank
    if tokens > 1:
        ids[1, -1] = experts  # out of range: skipped too
    got = moe_align(ids.to(device), experts)
    want = moe_align_ref(ids, experts)
    assert got[1].cpu().tolist() == want[1].tolist()
    assert got[2].cpu().tolist() == want[2].tolist()
    n = int(want[2].sum())
    assert got[0][:n].cpu().tolist() == want[0].tolist()


def test_align_reference_orders_pairs_by_expert_then_token() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, -1]])
    pairs, starts, counts = moe_align_ref(ids, 3)
    assert pairs.tolist() == [1, 2, 3, 0, 4]  # expert 0: pairs 1, 2; expert 1: 3; 2: 0, 4
    assert starts.tolist() == [0, 2, 3] and counts.tolist() == [2, 1, 2]


@needs_triton
@pytest.mark.parametrize(
    "tokens,experts,k,hidden,inter,hot",
    [
        (1, 4, 2, 32, 16, None),
        (9, 8, 3, 48, 40, None),  # K not a multiple of the block: masked K tail
        (37, 6, 2, 32, 16, 3),  # one hot expert: rows over several row tiles
    ],
)
def test_fused_moe_float32_equals_reference(tokens, experts, k, hidden, inter, hot, device) -> None:
    ids, weights = _routing(tokens, experts, k, seed=7, hot=hot)
    ids[0, -1] = -1  # not on this rank
    w13, w2 = _weights(experts, hidden, inter, torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g)
    add = torch.randn(tokens, hidden, generator=g)
    cfg = {"block_m": 16, "block_n": 16, "block_k": 16, "num_stages": 1}
    got = fused_moe(
        *(t.to(device) for t in (x, w13, w2, ids, weights, add)),
        gate_up_config=cfg,
        down_config=cfg,
    )
    want = fused_moe_ref(x, w13, w2, ids, weights, add)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    without_add = fused_moe(
        *(t.to(device) for t in (x, w13, w2, ids, weights)), gate_up_config=cfg, down_config=cfg
    )
    torch.testing.assert_close(without_add.cpu(), want - add, rtol=1e-4, atol=1e-5)


@needs_triton
def test_fused_moe_half_precision_default_blocks(device) -> None:
    """bf16 at the V2-Lite decode shape on the GPU; float16 at a small shape in the
    interpreter (Triton 3.6's interpreter computes bf16 dots wrongly: NumPy has no bf16)."""
    if HAS_CUDA:
        tokens, experts, k, hidden, inter, dtype = 256, 64, 6, 2048, 1408, torch.bfloat16
    else:
        tokens, experts, k, hidden, inter, dtype = 24, 8, 2, 128, 64, torch.float16
    ids, weights = _routing(tokens, experts, k, seed=5)
    w13, w2 = _weights(experts, hidden, inter, dtype)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = fused_moe(*(t.to(device) for t in (x, w13, w2, ids, weights)))
    want = fused_moe_ref(x, w13, w2, ids, weights)
    err = float((got.cpu().double() - want.double()).norm() / want.double().norm())
    assert err < 1e-2, err


@needs_triton
def test_fused_moe_rejects_bad_shapes(device) -> None:
    w13, w2 = _weights(4, 32, 16, torch.float32)
    x = torch.zeros(3, 32)
    ids, weights = _routing(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, ids, weights[:, :1])
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :8], ids, weights)
    with pytest.raises(ValueError, match="topk_ids must be int"):
        fused_moe(x, w13, w2, ids.float(), weights)
    empty = fused_moe(x[:0].to(device), w13.to(device), w2.to(device), ids[:0], weights[:0])
    assert empty.shape == (0, 32)


@needs_cuda
def test_fused_moe_is_capturable_in_a_cuda_graph() -> None:
    experts, k, hidden, inter, tokens = 8, 2, 128, 64, 32
    w13, w2 = (w.cuda() for w in _weights(experts, hidden, inter, torch.bfloat16))
    ids, weights = (t.cuda() for t in _routing(tokens, experts, k, seed=1))
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    fused_moe(x, w13, w2, ids, weights)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, ids, weights)
    new_ids, new_w = _routing(tokens, experts, k, seed=2)
    ids.copy_(new_ids)
    weights.copy_(new_w)
    graph.replay()
    want = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), new_ids, new_w)
    err = float((out.cpu().double() - want.double()).norm() / want.double().norm())
    assert err < 1e-2, err


@needs_triton
@pytest.mark.parametrize("tokens,num_shared", [(5, 1), (19, 2)])
def test_shared_experts_run_as_extra_experts_without_a_copy(tokens, num_shared, device) -> None:
    """DeepSeek's shared experts (one DenseMLP of width S*I) ride along as S experts of width
    I with weight 1; their weights are read in place (strided views of the MLP's)."""
    experts, k, hidden, inter = 6, 2, 32, 16
    ids, weights = _routing(tokens, experts, k, seed=11)
    w13, w2 = _weights(experts, hidden, inter, torch.float32)
    g = torch.Generator().manual_seed(12)
    width = num_shared * inter
    gate, up = (torch.randn(width, hidden, generator=g) / hidden**0.5 for _ in range(2))
    down = torch.randn(hidden, width, generator=g) / width**0.5
    x = torch.randn(tokens, hidden, generator=g)
    add = torch.randn(tokens, hidden, generator=g)
    cfg = {"block_m": 16, "block_n": 16, "block_k": 16, "num_stages": 1}
    on = [t.to(device) for t in (x, w13, w2, ids, weights, add)]
    shared = tuple(w.to(device) for w in (gate, up, down))
    got = fused_moe(*on, shared=shared, gate_up_config=cfg, down_config=cfg)
    mlp = torch.nn.functional.linear
    dense = mlp(torch.nn.functional.silu(mlp(x, gate)) * mlp(x, up), down)
    want = fused_moe_ref(x, w13, w2, ids, weights, add) + dense
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        fused_moe_ref(x, w13, w2, ids, weights, add, shared=(gate, up, down)), want
    )
    with pytest.raises(ValueError, match="shared down"):
        fused_moe(*on, shared=(shared[0], shared[1], shared[2][:, :-1]))


@needs_triton
def test_fused_moe_reads_received_rows_in_place_with_unit_weights(device) -> None:
    """The static all-to-all's layout: rows and their int64 expert ids share one buffer, read
    through its row stride; each row is one pair of weight 1 (None), -1 marking padding."""
    from dsmesh.kernels.ep_static import ids_of

    experts, hidden, inter, rows = 4, 32, 16, 11
    w13, w2 = _weights(experts, hidden, inter, torch.float32)
    g = torch.Generator().manual_seed(9)
    buf = torch.randn(rows, hidden + 2, generator=g)  # 2 float32 columns carry the id
    ids = ids_of(buf)
    ids.copy_(torch.randint(0, experts, (rows,), generator=g))
    ids[3] = -1
    ids[7] = -1
    x, topk_ids = buf[:, :hidden], ids[:, None]
    assert x.stride(0) == hidden + 2 and topk_ids.stride(0) == (hidden + 2) // 2
    cfg = {"block_m": 16, "block_n": 16, "block_k": 16, "num_stages": 1}
    on = buf.to(device)  # sliced there, so the strides travel
    got = fused_moe(
        on[:, :hidden], w13.to(device), w2.to(device), ids_of(on)[:, None], None,
        gate_up_config=cfg, down_config=cfg,
    ).cpu()  # fmt: skip
    want = fused_moe_ref(x, w13, w2, topk_ids.clone(), None)
    real = ids >= 0
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
