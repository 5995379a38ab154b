"""Fused MoE routing top-k in Triton: one launch from router logits to (weights, expert ids).

Covers every policy of :func:`engine.routing.select_experts_reference` (the plain-torch
reference): ``noaux_tc`` (sigmoid, correction bias, groups ranked by the sum of their top-2
biased scores), ``greedy`` and ``group_limited_greedy`` (softmax; groups ranked by their max).
Selection is repeated arg-max, so ties go to the lower group / expert id; ``torch.topk`` gives
the same ids on tie-free inputs. Ids come out in descending score order; the reference's order
is unspecified (``sorted=False``), and dispatch/combine do not depend on it.
"""

from __future__ import annotations

import functools

import torch

from engine.config import MoEConfig
from kernels._triton import can_launch, next_pow2

__all__ = ["fused_select_experts", "select_experts_ref"]


def select_experts_ref(
    router_logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch reference (engine.routing)."""
    from engine.routing import select_experts_reference

    return select_experts_reference(router_logits, moe, correction_bias)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def route_kernel(
        logits_ptr,
        bias_ptr,
        w_ptr,
        ids_ptr,
        map_ptr,
        t,
        stride_t,
        E: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_T: tl.constexpr,
        N_GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SIGMOID: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        NORMALIZE: tl.constexpr,
        SCALE: tl.constexpr,
        HAS_MAP: tl.constexpr,
    ):
        PER_GROUP: tl.constexpr = E // N_GROUP
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < t
        col_ok = cols < E
        ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :]
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=float("-inf"))
        x = tl.where(row_ok[:, None], x.to(tl.float32), 0.0)  # rows past t: no NaN
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-x))
        else:
            e = tl.exp(x - tl.max(x, axis=1)[:, None])
            scores = e / tl.sum(e, axis=1)[:, None]
        scores = tl.where(col_ok[None, :], scores, float("-inf"))
        sel = scores
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            sel = scores + bias[None, :]
        if N_GROUP > 1:
            group_of = cols // PER_GROUP
            gidx = tl.arange(0, BLOCK_G)
            gscore = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
            for g in tl.static_range(N_GROUP):
                in_g = (group_of == g)[None, :]
                v = tl.where(in_g, sel, float("-inf"))
                best = tl.max(v, axis=1)
                if SIGMOID:  # noaux_tc: sum of the top two (a repeated maximum counts twice)
                    first = tl.argmax(v, axis=1)
                    v = tl.where(cols[None, :] == first[:, None], float("-inf"), v)
                    best = best + tl.max(v, axis=1)
                gscore = tl.where(gidx[None, :] == g, best[:, None], gscore)
            keep = tl.zeros((BLOCK_T, BLOCK_E), tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                gbest = tl.argmax(gscore, axis=1)
                keep = keep | (group_of[None, :] == gbest[:, None])
                gscore = tl.where(gidx[None, :] == gbest[:, None], float("-inf"), gscore)
            sel = tl.where(keep, sel, float("-inf"))
        kidx = tl.arange(0, BLOCK_K)
        out_w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
        out_i = tl.zeros((BLOCK_T, BLOCK_K), tl.int64)
        for k in tl.static_range(TOP_K):
            best = tl.argmax(sel, axis=1)
            hit = cols[None, :] == best[:, None]
            w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
            sel = tl.where(hit, float("-inf"), sel)
            out_w = tl.where(kidx[None, :] == k, w[:, None], out_w)
            if HAS_MAP:  # logical -> physical expert id (one replica each)
                best = tl.load(map_ptr + best, mask=row_ok, other=0)
            out_i = tl.where(kidx[None, :] == k, best.to(tl.int64)[:, None], out_i)
        if NORMALIZE:
            out_w = out_w / (tl.sum(out_w, axis=1)[:, None] + 1e-20)
        out_w = out_w * SCALE
        optr = rows.to(tl.int64)[:, None] * TOP_K + kidx[None, :]
        omask = row_ok[:, None] & (kidx < TOP_K)[None, :]
        tl.store(w_ptr + optr, out_w, mask=omask)
        tl.store(ids_ptr + optr, out_i, mask=omask)

    return route_kernel


def fused_select_experts(
    router_logits: torch.Tensor,
    moe: MoEConfig,
    correction_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, logical ids [T, k] int64), as the
    reference; with ``expert_map`` [E] (logical -> physical id), the ids come out mapped
    (``expert_map[ids]``) in the same launch. Capturable in a CUDA graph (no host sync)."""
    if router_logits.dim() != 2 or router_logits.shape[1] != moe.n_routed_experts:
        raise ValueError(
            f"router_logits must be [T, {moe.n_routed_experts}], got {tuple(router_logits.shape)}"
        )
    if not can_launch(router_logits):
        raise RuntimeError("fused routing needs a CUDA tensor (or TRITON_INTERPRET=1)")
    k = moe.num_experts_per_tok
    t, e = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((t, k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    noaux = moe.topk_method == "noaux_tc"
    grouped = moe.topk_method in ("noaux_tc", "group_limited_greedy") and moe.n_group > 1
    if noaux:
        normalize, scale = moe.norm_topk_prob, moe.routed_scaling_factor
    elif k > 1 and moe.norm_topk_prob:
        normalize, scale = True, 1.0
    else:
        normalize, scale = False, moe.routed_scaling_factor
    has_bias = noaux and correction_bias is not None
    if expert_map is not None and tuple(expert_map.shape) != (e,):
        raise ValueError(f"expert_map must be [{e}], got {tuple(expert_map.shape)}")
    block_e = next_pow2(e)
    block_t = max(1, min(16, 4096 // block_e))
    _kernels()[(triton_cdiv(t, block_t),)](
        router_logits,
        correction_bias if has_bias else router_logits,
        weights,
        ids,
        expert_map.contiguous() if expert_map is not None else ids,
        t,
        router_logits.stride(0),
        E=e,
        BLOCK_E=block_e,
        BLOCK_T=block_t,
        N_GROUP=moe.n_group if grouped else 1,
        BLOCK_G=next_pow2(moe.n_group if grouped else 1),
        TOPK_GROUP=moe.topk_group if grouped else 1,
        TOP_K=k,
        BLOCK_K=next_pow2(k),
        SIGMOID=noaux,
        HAS_BIAS=has_bias,
        NORMALIZE=normalize,
        SCALE=float(scale),
        HAS_MAP=expert_map is not None,
        num_warps=4,
    )
    return weights, ids


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
