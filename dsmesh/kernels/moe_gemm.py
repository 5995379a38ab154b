"""MoE expert compute: token permutation and grouped GEMMs (bf16 and block-scaled FP8).

Rows are grouped by expert (``tokens_per_expert`` rows of expert 0 first, then expert 1 ...),
as :class:`dsmesh.engine.model.moe_dispatch.LocalDispatcher` and the all-to-all dispatcher deliver
them.

- bf16/fp32: ``torch._grouped_mm`` (one launch for all experts) where it runs, else a loop.
- FP8: weights e4m3 with 128x128 block scales (the checkpoint's ``weight_scale_inv``),
  activations quantised per token group of 128 (:mod:`dsmesh.kernels.fp8_quant`), one Triton grouped
  GEMM launch per projection. ``torch._scaled_grouped_mm`` in torch 2.11 takes row-wise
  scales only on sm90, not 128x128 blocks, so it cannot run DeepSeek's FP8 weights as they
  are stored. The tile map is built on the device, so nothing synchronises with the host.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from dsmesh.kernels._triton import can_launch, next_pow2, use_triton
from dsmesh.kernels.fp8 import (
    BLOCK,
    FP8_DTYPE,
    Fp8ExpertWeights,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
)

__all__ = [
    "expert_ffn",
    "expert_ffn_fp8",
    "expert_ffn_fp8_ref",
    "expert_ffn_ref",
    "fp8_expert_backend",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_ref",
    "gather_combine",
    "gather_combine_ref",
    "grouped_gemm",
    "grouped_gemm_ref",
    "grouped_mm_supported",
    "permute_tokens",
    "unpermute_combine",
    "unpermute_tokens",
]


@functools.cache
def grouped_mm_supported(dtype: torch.dtype, device_type: str) -> bool:
    """Whether ``torch._grouped_mm`` runs for this dtype and device (probed once)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
        out = torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.all(out == 16))


# ---- permutation ---------------------------------------------------------------------------


def permute_tokens(
    hidden: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, H], expert_ids [T, k] -> (rows [T*k, H] grouped by expert, tokens_per_expert
    [num_experts] int64, order [T*k]: the flat (token, slot) index of each row)."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return hidden.index_select(0, order // top_k), counts, order


def unpermute_tokens(
    expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Inverse of :func:`permute_tokens` with the routing weights [T, k]: [T, H] weighted sums."""
    top_k = weights.shape[1]
    out = torch.zeros(
        (num_tokens, expert_out.shape[1]), dtype=expert_out.dtype, device=expert_out.device
    )
    w = weights.reshape(-1)[order].to(expert_out.dtype)
    return out.index_add_(0, order // top_k, expert_out * w[:, None])


@functools.cache
def _combine_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def combine_kernel(
        rows_ptr, index_ptr, w_ptr, out_ptr, hidden, stride_r, stride_o,
        TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < hidden
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for j in tl.static_range(TOP_K):
            row = tl.load(index_ptr + t * TOP_K + j).to(tl.int64)
            w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
            x = tl.load(rows_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            acc += w * x
        tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return combine_kernel


def unpermute_combine(
    expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """:func:`unpermute_tokens` in one Triton pass: token ``t`` reads its ``k`` rows where
    :func:`permute_tokens` put them and sums them with its routing weights in float32,
    rounding once (no atomics, no unsorted copy). expert_out [T*k, H], order [T*k],
    weights [T, k] -> [T, H] in expert_out's dtype."""
    num_tokens, top_k = weights.shape
    if expert_out.dim() != 2 or expert_out.shape[0] != num_tokens * top_k:
        raise ValueError(
            f"expert_out {tuple(expert_out.shape)} must be [{num_tokens * top_k}, hidden]"
        )
    if order.shape != (num_tokens * top_k,):
        raise ValueError(f"order {tuple(order.shape)} must be [{num_tokens * top_k}]")
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return gather_combine(expert_out, inv, weights)


def gather_combine_ref(
    rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """rows [N, H]; index [T*k]: the row of each flat (token, slot) pair; weights [T, k]
    -> [T, H] in rows' dtype: ``out[t] = sum_j weights[t, j] * rows[index[t * k + j]]``,
    summed with ``index_add_`` in rows' dtype, pairs in flat order."""
    num_tokens, top_k = weights.shape
    pairs = rows.index_select(0, index) * weights.reshape(-1)[:, None].to(rows.dtype)
    out = torch.zeros((num_tokens, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    token = torch.arange(num_tokens * top_k, device=rows.device) // top_k
    return out.index_add_(0, token, pairs)


def gather_combine(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """:func:`gather_combine_ref` in one Triton launch: one program per (token, column block)
    reads its ``k`` rows and sums them in float32, rounding once (no atomics). Rows may be
    any subset of ``rows`` (unread rows may hold anything) and ``rows`` may have a row
    stride."""
    num_tokens, top_k = weights.shape
    if rows.dim() != 2:
        raise ValueError(f"rows {tuple(rows.shape)} must be [N, hidden]")
    if index.shape != (num_tokens * top_k,):
        raise ValueError(f"index {tuple(index.shape)} must be [{num_tokens * top_k}]")
    if not can_launch(rows):
        raise RuntimeError("gather_combine needs a CUDA tensor (or TRITON_INTERPRET=1)")
    hidden = rows.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=rows.dtype, device=rows.device)
    if num_tokens == 0:
        return out
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    block = min(next_pow2(hidden), 1024)
    _combine_kernel()[(num_tokens, -(-hidden // block))](
        rows, index.contiguous(), weights.contiguous(), out, hidden, rows.stride(0),
        out.stride(0), TOP_K=top_k, BLOCK_N=block,
    )  # fmt: skip
    return out


# ---- bf16 ----------------------------------------------------------------------------------


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor):
    """x [M, K] grouped by expert, w [E, N, K] -> [M, N]; a loop over experts."""
    out = x.new_empty((x.shape[0], w.shape[1]))
    start = 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        out[start : start + n] = F.linear(x[start : start + n], w[e])
        start += n
    return out


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    offs: torch.Tensor | None = None,
):
    """x [M, K] grouped by expert, w [E, N, K] -> [M, N]: one ``torch._grouped_mm``.
    ``offs``: the groups' ends [E] int32 (``tokens_per_expert.cumsum(0)``), when the caller
    has them already."""
    aligned = all(d * x.element_size() % 16 == 0 for d in (x.shape[1], w.shape[1]))
    if x.shape[0] and aligned and grouped_mm_supported(x.dtype, x.device.type):
        if offs is None:
            offs = tokens_per_expert.cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return grouped_gemm_ref(x, w, tokens_per_expert)


def expert_ffn(
    hidden: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]; [M, H] -> [M, H].
    On CUDA the SwiGLU between the GEMMs is one Triton pass (:mod:`dsmesh.kernels.activation`)."""
    offs = tokens_per_expert.cumsum(0, dtype=torch.int32)  # both GEMMs' group ends, once
    gate_up = grouped_gemm(hidden, w13, tokens_per_expert, offs)
    if use_triton(gate_up):
        from dsmesh.kernels.activation import silu_mul

        h = silu_mul(gate_up)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
    return grouped_gemm(h, w2, tokens_per_expert, offs)


def expert_ffn_ref(
    hidden: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    gate, up = grouped_gemm_ref(hidden, w13, tokens_per_expert).chunk(2, dim=-1)
    return grouped_gemm_ref(F.silu(gate) * up, w2, tokens_per_expert)


# ---- FP8 -----------------------------------------------------------------------------------


def _tile_map(tokens_per_expert: torch.Tensor, num_rows: int, block_m: int):
    """Per M-tile (expert, first row), -1 for unused tiles, computed on the device."""
    counts = tokens_per_expert.to(torch.int32)
    num_experts = counts.shape[0]
    ends = counts.cumsum(0, dtype=torch.int32)
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0, dtype=torch.int32)
    max_tiles = math.ceil(num_rows / block_m) + num_experts
    t = torch.arange(max_tiles, dtype=torch.int32, device=counts.device)
    expert = torch.searchsorted(tile_end, t, right=True).to(torch.int32)
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    row0 = (ends - counts)[e] + (t - (tile_end - tiles)[e]) * block_m
    return torch.where(valid, e, -1), row0, ends, max_tiles


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm_kernel(
        a_ptr,
        as_ptr,
        b_ptr,
        bs_ptr,
        c_ptr,
        tile_expert_ptr,
        tile_row_ptr,
        ends_ptr,
        n,
        k,
        stride_am,
        stride_asm,
        stride_be,
        stride_bn,
        stride_bse,
        stride_bsn,
        stride_cm,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        e = tl.load(tile_expert_ptr + pid_m)
        if e >= 0:
            row0 = tl.load(tile_row_ptr + pid_m)
            row_end = tl.load(ends_ptr + e)
            rows = row0 + tl.arange(0, BLOCK_M)
            rmask = rows < row_end
            rows64 = rows.to(tl.int64)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < n
            kk = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + rows64[:, None] * stride_am + kk[None, :]
            b_ptrs = (
                b_ptr + e.to(tl.int64) * stride_be + cols.to(tl.int64)[None, :] * stride_bn
            ) + kk[:, None]
            as_ptrs = as_ptr + rows64 * stride_asm
            bs_ptrs = bs_ptr + e.to(tl.int64) * stride_bse + ((pid_n * BLOCK_N) // 128) * stride_bsn
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for kb in range(0, tl.cdiv(k, BLOCK_K)):
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
                sa = tl.load(as_ptrs + kb, mask=rmask, other=0.0)
                sb = tl.load(bs_ptrs + kb)
                acc += tl.dot(a, b) * (sa[:, None] * sb)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            c = c_ptr + rows64[:, None] * stride_cm + cols[None, :]
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    return gemm_kernel


_GEMM_CONFIG = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 4}


def fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """a [M, K] e4m3 grouped by expert with a_scale [M, K/128]; w [E, N, K] e4m3 with w_scale
    [E, N/128, K/128] -> [M, N] in ``out_dtype``: ``(a * a_scale) @ (w[e] * w_scale[e]).T``
    for the rows of each expert ``e``. K must be a multiple of 128."""
    m, k = a.shape
    num_experts, n, k_w = w.shape
    if k != k_w or k % BLOCK:
        raise ValueError(
            f"a [{m}, {k}] and w [{num_experts}, {n}, {k_w}] need one K, a multiple of 128"
        )
    if a_scale.shape != (m, k // BLOCK) or w_scale.shape != (
        num_experts,
        math.ceil(n / BLOCK),
        k // BLOCK,
    ):
        raise ValueError(
            f"scales {tuple(a_scale.shape)} and {tuple(w_scale.shape)} do not match "
            f"a {tuple(a.shape)} and w {tuple(w.shape)} with 128-blocks"
        )
    if not can_launch(a):
        raise RuntimeError("fp8_grouped_gemm needs a CUDA tensor (or TRITON_INTERPRET=1)")
    cfg = dict(_GEMM_CONFIG, **(config or {}))
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    tile_expert, tile_row, ends, max_tiles = _tile_map(tokens_per_expert, m, cfg["block_m"])
    grid = (math.ceil(n / cfg["block_n"]), max_tiles)
    _kernels()[grid](
        a,
        a_scale,
        w,
        w_scale,
        out,
        tile_expert,
        tile_row,
        ends,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        w.stride(0),
        w.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        out.stride(0),
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=BLOCK,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def fp8_grouped_gemm_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantise both sides to float32, multiply per expert."""
    x = dequantize_fp8_per_token_group(a, a_scale, BLOCK)
    dense = torch.stack(
        [dequantize_fp8_block(w[e], w_scale[e], (BLOCK, BLOCK)) for e in range(w.shape[0])]
    )
    return grouped_gemm_ref(x, dense, tokens_per_expert).to(out_dtype)


def fp8_expert_backend(hidden: torch.Tensor, weights: Fp8ExpertWeights) -> str:
    """``"deep_gemm"`` where DeepGEMM is installed with a tested adapter (dsmesh.kernels.backends),
    the rows are bf16 on CUDA and the problem has enough rows per expert for it to win
    (:func:`dsmesh.kernels.moe_gemm_deepgemm.prefers_deep_gemm`); else ``"triton"``."""
    from dsmesh.kernels.backends import choose

    if not (hidden.is_cuda and hidden.dtype == torch.bfloat16):
        return "triton"
    if choose("moe_fp8_gemm") != "deep_gemm":
        return "triton"
    from dsmesh.kernels import moe_gemm_deepgemm as dg

    if dg.prefers_deep_gemm(hidden.shape[0], weights.w13.shape[0]) and dg.load_deep_gemm():
        return "deep_gemm"
    return "triton"


def expert_ffn_fp8(
    hidden: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    weights: Fp8ExpertWeights,
    backend: str | None = None,
) -> torch.Tensor:
    """FP8 SwiGLU experts: quantise, grouped GEMM, fused silu*up + quantise, grouped GEMM.
    ``backend`` (``"triton"`` or ``"deep_gemm"``) defaults to :func:`fp8_expert_backend`."""
    from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8, silu_mul_quant_fp8

    backend = backend or fp8_expert_backend(hidden, weights)
    if backend == "deep_gemm":
        from dsmesh.kernels.moe_gemm_deepgemm import deepgemm_expert_ffn_fp8

        return deepgemm_expert_ffn_fp8(hidden, tokens_per_expert, weights)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'deep_gemm', got {backend!r}")
    a, a_scale = per_token_group_quant_fp8(hidden, BLOCK)
    gate_up = fp8_grouped_gemm(
        a, a_scale, weights.w13, weights.w13_scale, tokens_per_expert, hidden.dtype
    )
    h, h_scale = silu_mul_quant_fp8(gate_up, BLOCK)
    return fp8_grouped_gemm(
        h, h_scale, weights.w2, weights.w2_scale, tokens_per_expert, hidden.dtype
    )


def expert_ffn_fp8_ref(
    hidden: torch.Tensor, tokens_per_expert: torch.Tensor, weights: Fp8ExpertWeights
) -> torch.Tensor:
    from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8_ref, silu_mul_quant_fp8_ref

    a, a_scale = per_token_group_quant_fp8_ref(hidden, BLOCK)
    gate_up = fp8_grouped_gemm_ref(
        a, a_scale, weights.w13, weights.w13_scale, tokens_per_expert, torch.float32
    )
    h, h_scale = silu_mul_quant_fp8_ref(gate_up.to(hidden.dtype), BLOCK)
    return fp8_grouped_gemm_ref(
        h, h_scale, weights.w2, weights.w2_scale, tokens_per_expert, hidden.dtype
    )


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def attach_fp8_experts(model) -> int:
    """Give each MoE layer of ``model`` (a DeepseekForCausalLM loaded with ``keep_fp8=True``)
    its local experts in FP8 (``experts.fp8``), on the experts' device, from the checkpoint's
    raw FP8 tensors. Returns how many layers got them; layers whose experts are not FP8 in
    the checkpoint, or not whole 128-blocks, keep the dense path. Experts moved later (EPLB)
    must be attached again."""
    cfg = model.config
    local = model.expert_location.local_physical_ids(model.ep_rank)
    p2l = model.expert_location.physical_to_logical
    done = 0
    for moe_idx, layer in enumerate(cfg.moe_layer_ids):
        experts = model.model.layers[layer].mlp.experts
        logical = [int(p2l[moe_idx, phys]) for phys in local]
        try:
            parts = [
                [
                    model.fp8_weights[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]
                    for proj in ("gate_proj", "up_proj", "down_proj")
                ]
                for e in logical
            ]
        except KeyError:
            continue
        if any(p.block_size != (BLOCK, BLOCK) for ps in parts for p in ps):
            continue
        device = experts.w13.device
        fp8 = Fp8ExpertWeights(
            torch.stack([torch.cat([g.data, u.data]) for g, u, _ in parts]).to(device),
            torch.stack([torch.cat([g.scale_inv, u.scale_inv]) for g, u, _ in parts]).to(device),
            torch.stack([d.data for _, _, d in parts]).to(device),
            torch.stack([d.scale_inv for _, _, d in parts]).to(device),
        )
        if fp8.usable:
            experts.fp8 = fp8
            done += 1
    return done
