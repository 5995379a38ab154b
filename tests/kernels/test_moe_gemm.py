"""MoE GEMMs: permutation round trip, bf16 grouped GEMM, the Triton FP8 grouped GEMM against
dequantised float32 math, and FP8 experts attached from the checkpoint's raw FP8 tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsmesh.engine.model.build import build_model, init_random
from dsmesh.engine.model.tiny_model import tiny_config
from dsmesh.engine.model.weights import Fp8Weight
from dsmesh.kernels.fp8 import (
    Fp8ExpertWeights,
    dequantize_fp8_block,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
)
from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8, silu_mul_quant_fp8
from dsmesh.kernels.moe_gemm import (
    _tile_map,
    attach_fp8_experts,
    expert_ffn,
    expert_ffn_fp8,
    expert_ffn_fp8_ref,
    expert_ffn_ref,
    fp8_grouped_gemm,
    fp8_grouped_gemm_ref,
    grouped_gemm,
    grouped_gemm_ref,
    permute_tokens,
    unpermute_tokens,
)
from tests.kernels.conftest import HAS_CUDA, needs_cuda, needs_triton


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_permute_then_unpermute_is_the_weighted_expert_sum() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(7)])
    w = torch.rand(7, 3, generator=g)
    rows, counts, order = permute_tokens(x, ids, 6)
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=6).tolist()
    expert_of_row = torch.repeat_interleave(torch.arange(6), counts)
    scale = (expert_of_row + 1).float()[:, None]  # "expert e multiplies by e + 1"
    out = unpermute_tokens(rows * scale, order, w, 7)
    want = (x[:, None, :] * (ids + 1).float()[..., None] * w[..., None]).sum(1)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("counts", [[3, 0, 2, 4], [0, 0, 0, 5], [0, 0, 0, 0]])
def test_grouped_gemm_and_ffn_equal_loops(counts) -> None:
    g = torch.Generator().manual_seed(1)
    tokens = torch.tensor(counts)
    x = torch.randn(int(tokens.sum()), 16, generator=g)
    w13, w2 = torch.randn(4, 12, 16, generator=g), torch.randn(4, 16, 6, generator=g)
    torch.testing.assert_close(grouped_gemm(x, w13, tokens), grouped_gemm_ref(x, w13, tokens))
    torch.testing.assert_close(
        expert_ffn(x, tokens, w13, w2), expert_ffn_ref(x, tokens, w13, w2), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("counts", [[5, 0, 70, 1], [0, 0, 0, 0], [64, 64, 0, 1]])
def test_tile_map_covers_every_row_once(counts) -> None:
    tokens = torch.tensor(counts)
    expert, row0, ends, max_tiles = _tile_map(tokens, int(tokens.sum()), 16)
    covered = []
    for t in range(max_tiles):
        e = int(expert[t])
        if e >= 0:
            covered += [(r, e) for r in range(int(row0[t]), min(int(row0[t]) + 16, int(ends[e])))]
    want = [(r, int(e)) for r, e in enumerate(torch.repeat_interleave(torch.arange(4), tokens))]
    assert sorted(covered) == want


def fp8_case(counts, n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    x = torch.randn(sum(counts), k, generator=g)
    w = torch.randn(e, n, k, generator=g) * 0.05
    a, a_scale = quantize_fp8_per_token_group(x)
    pairs = [quantize_fp8_block(w[i]) for i in range(e)]
    wq = torch.stack([q for q, _ in pairs])
    ws = torch.stack([s for _, s in pairs])
    tokens = torch.tensor(counts)
    return [t.to(device) for t in (a, a_scale, wq, ws, tokens)]


@needs_triton
@pytest.mark.parametrize("counts", [[5, 0, 70], [1, 1, 1], [0, 0, 0], [0, 33, 0]])
@pytest.mark.parametrize("n", [256, 192])
def test_fp8_grouped_gemm_equals_dequantised_reference(counts, n, device) -> None:
    case = fp8_case(counts, n, 256, device)
    out = fp8_grouped_gemm(*case, out_dtype=torch.float32, config={"block_m": 16, "block_n": 64})
    ref = fp8_grouped_gemm_ref(*[t.cpu() for t in case], out_dtype=torch.float32)
    assert out.shape == (sum(counts), n)
    if sum(counts):
        assert rel_err(out.cpu(), ref) < 1e-5


@needs_triton
def test_fp8_grouped_gemm_rejects_bad_shapes(device) -> None:
    a, a_scale, wq, ws, tokens = fp8_case([2, 3], 128, 256, device)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_grouped_gemm(a[:, :200], a_scale, wq, ws, tokens)
    with pytest.raises(ValueError, match="scales"):
        fp8_grouped_gemm(a, a_scale[:, :1], wq, ws, tokens)


def experts_case(counts, hidden, inter, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(e, hidden, inter, generator=g) * inter**-0.5
    x = torch.randn(sum(counts), hidden, generator=g)
    fp8 = Fp8ExpertWeights.from_dense(w13, w2)
    fp8 = Fp8ExpertWeights(*[t.to(device) for t in dataclasses.astuple(fp8)])
    tokens = torch.tensor(counts, device=device)
    return x.to(device, dtype), tokens, fp8, w13.to(device, dtype), w2.to(device, dtype)


@needs_triton
def test_fp8_expert_ffn_equals_reference_and_tracks_dense(device) -> None:
    x, tokens, fp8, w13, w2 = experts_case([9, 0, 20], 256, 128, device, torch.float32)
    out = expert_ffn_fp8(x, tokens, fp8).cpu()
    cpu_fp8 = Fp8ExpertWeights(*[t.cpu() for t in dataclasses.astuple(fp8)])
    if HAS_CUDA:
        ref = expert_ffn_fp8_ref(x.cpu(), tokens.cpu(), cpu_fp8)
    else:
        # Triton's interpreter rounds some e4m3 codes wrongly (see assert_fp8_codes_equal):
        # check the composition with the same (kernel) quantisation, GEMMs from the reference.
        a, a_s = per_token_group_quant_fp8(x)
        gate_up = fp8_grouped_gemm_ref(a, a_s, cpu_fp8.w13, cpu_fp8.w13_scale, tokens, x.dtype)
        h, h_s = silu_mul_quant_fp8(gate_up)
        ref = fp8_grouped_gemm_ref(h, h_s, cpu_fp8.w2, cpu_fp8.w2_scale, tokens, x.dtype)
    # GPU: float32 GEMM rounding differs from the CPU's, and re-quantising the SwiGLU output
    # turns some of those ulps into one-step FP8 code changes (about 1/16 each).
    assert rel_err(out, ref) < (2e-2 if HAS_CUDA else 1e-3)
    dense = expert_ffn_ref(x.cpu(), tokens.cpu(), w13.cpu(), w2.cpu())
    assert rel_err(out, dense) < 0.15  # sanity: FP8 weights and activations vs float32


def tiny_fp8_model():
    """The tiny V3 with 128-wide hidden and expert sizes, and the record load_weights(keep_fp8=
    True) would leave for an FP8 checkpoint of it."""
    cfg = tiny_config("v3")
    cfg = dataclasses.replace(
        cfg, hidden_size=128, moe=dataclasses.replace(cfg.moe, moe_intermediate_size=128)
    )
    model = build_model(cfg, torch.float32, "cpu")
    init_random(model, seed=0)
    for layer in cfg.moe_layer_ids:
        experts = model.model.layers[layer].mlp.experts
        for e in range(cfg.moe.n_routed_experts):
            for proj, w in (
                ("gate_proj", experts.w13[e, :128]),
                ("up_proj", experts.w13[e, 128:]),
                ("down_proj", experts.w2[e]),
            ):
                q, s = quantize_fp8_block(w.detach())
                # dense weights become the FP8 values, so the two paths differ only in the
                # activation quantisation
                w.data.copy_(dequantize_fp8_block(q, s))
                model.fp8_weights[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = (
                    Fp8Weight(q, s, (128, 128))
                )
    return model


def test_attach_fp8_experts_stacks_the_checkpoint_tensors() -> None:
    model = tiny_fp8_model()
    assert attach_fp8_experts(model) == len(model.config.moe_layer_ids)
    experts = model.moe_layers()[1].experts
    fp8 = experts.fp8
    assert fp8 is not None and fp8.w13.shape == (16, 256, 128) and fp8.w2_scale.shape == (16, 1, 1)
    name = f"model.layers.{model.config.moe_layer_ids[1]}.mlp.experts.5"
    assert torch.equal(
        fp8.w13[5, 128:].view(torch.uint8),
        model.fp8_weights[f"{name}.up_proj.weight"].data.view(torch.uint8),
    )
    assert torch.equal(fp8.w2_scale[5], model.fp8_weights[f"{name}.down_proj.weight"].scale_inv)


@needs_cuda
def test_model_with_fp8_experts_on_gpu() -> None:
    """On CUDA an MoE layer with attached FP8 experts equals routing + permutation + the FP8
    torch reference + shared experts; the whole model runs and stays near its dense logits."""
    from dsmesh.engine.kv.pool import MLAKVPool
    from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
    from dsmesh.engine.model.kernel_choice import KernelChoice

    model = tiny_fp8_model().to("cuda")
    # Triton glue: the FP8 experts run only where kernels were chosen with Triton on
    model.set_kernels(KernelChoice(triton=True, decode_attention="torch", fused_moe=False))
    cfg = model.config
    batch = ForwardBatch.build([SequenceChunk(list(range(1, 40)), 0, torch.arange(3))], 16, "cuda")

    def logits():
        pool = MLAKVPool(cfg.num_hidden_layers, 8, 16, cfg.mla.kv_cache_dim, torch.float32, "cuda")
        return model(batch, pool, all_logits=True)

    dense = logits()
    assert attach_fp8_experts(model) == len(cfg.moe_layer_ids)
    fp8 = logits()
    assert fp8.isfinite().all() and 0 < rel_err(fp8, dense) < 0.15

    moe = model.moe_layers()[0]
    assert moe.experts.fp8 is not None
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        out = moe(x)
        weights, ids = moe.route(x)
        rows, counts, order = permute_tokens(x, ids, cfg.moe.n_routed_experts)
        cpu_fp8 = Fp8ExpertWeights(*[t.cpu() for t in dataclasses.astuple(moe.experts.fp8)])
        expert_out = expert_ffn_fp8_ref(rows.cpu(), counts.cpu(), cpu_fp8).cuda()
        ref = unpermute_tokens(expert_out, order, weights, 40) + moe.shared_experts(x)
    assert rel_err(out, ref) < 2e-2


@needs_cuda
@pytest.mark.parametrize("m", [16, 4096])
def test_fp8_grouped_gemm_deepseek_shape_on_gpu(m) -> None:
    g = torch.Generator().manual_seed(m)
    counts = torch.multinomial(torch.ones(32), m, replacement=True, generator=g).bincount(
        minlength=32
    )
    case = fp8_case(counts.tolist(), 4096, 7168, "cuda", seed=1)
    out = fp8_grouped_gemm(*case)
    ref = fp8_grouped_gemm_ref(*case, out_dtype=torch.float32)
    assert rel_err(out, ref) < 1e-2


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unpermute_combine_equals_the_index_add_reference(dtype, device) -> None:
    from dsmesh.kernels.moe_gemm import unpermute_combine

    g = torch.Generator().manual_seed(5)
    tokens, experts, k, hidden = 23, 7, 3, 40
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    rows, _, order = permute_tokens(x, ids, experts)
    expert_rows = (rows * 3 - 1).to(dtype)  # "the experts"
    got = unpermute_combine(expert_rows.to(device), order.to(device), w.to(device)).cpu()
    want = unpermute_tokens(expert_rows.float(), order, w, tokens)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="order"):
        unpermute_combine(expert_rows.to(device), order[:-1].to(device), w.to(device))
