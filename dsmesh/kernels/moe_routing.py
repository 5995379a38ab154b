"""DeepSeekMoE routing top-k: the policies as plain-torch references, and one fused Triton
launch from router logits to (weights, expert ids).

- ``greedy`` (V2-Lite): softmax scores, plain top-k.
- ``group_limited_greedy`` (V2): softmax scores, keep the ``topk_group`` groups with the highest
  max score, top-k inside them.
- ``noaux_tc`` (V3): sigmoid scores; selection uses scores + ``e_score_correction_bias``; groups
  ranked by the sum of their top-2 biased scores; weights come from the unbiased scores.

Weight post-processing follows the official code: V3 normalises (if ``norm_topk_prob``) and
then always multiplies by ``routed_scaling_factor``; V2 normalises when ``top_k > 1`` and
``norm_topk_prob``, and scales otherwise.

:func:`fused_select_experts` covers every policy of :func:`select_experts_ref`. Selection is
repeated arg-max, so ties go to the lower group / expert id; ``torch.topk`` gives the same ids
on tie-free inputs. Ids come out in descending score order; the reference's order is
unspecified (``sorted=False``), and dispatch/combine do not depend on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsmesh.kernels._triton import can_launch, next_pow2

__all__ = ["RoutingConfig", "fused_select_experts", "select_experts_ref"]


@dataclass(frozen=True)
class RoutingConfig:
    """What routing reads of a MoE layer's config (the checkpoint's names)."""

    n_routed_experts: int
    num_experts_per_tok: int
    topk_method: str  # "greedy", "group_limited_greedy" or "noaux_tc"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def select_experts_ref(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64), in
    plain torch; the fused kernel must give the same ids and weights."""
    if cfg.topk_method == "noaux_tc":
        return _noaux_tc(router_logits, cfg, correction_bias)
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if cfg.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group).amax(-1)
        scores = scores.masked_fill(~_group_mask(group_scores, cfg), 0.0)
    weights, ids = torch.topk(scores, k=cfg.num_experts_per_tok, dim=-1, sorted=False)
    if cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def _noaux_tc(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = router_logits.sigmoid()
    biased = scores if correction_bias is None else scores + correction_bias
    per_group = cfg.n_routed_experts // cfg.n_group
    group_scores = biased.view(-1, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    biased = biased.masked_fill(~_group_mask(group_scores, cfg), float("-inf"))
    ids = torch.topk(biased, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def _group_mask(group_scores: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """group_scores [T, n_group] -> bool mask [T, E] of experts in the chosen groups."""
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    per_group = cfg.n_routed_experts // cfg.n_group
    return chosen.unsqueeze(-1).expand(-1, cfg.n_group, per_group).reshape(-1, cfg.n_routed_experts)


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
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, logical ids [T, k] int64), as the
    reference; with ``expert_map`` [E] (logical -> physical id), the ids come out mapped
    (``expert_map[ids]``) in the same launch. Capturable in a CUDA graph (no host sync)."""
    if router_logits.dim() != 2 or router_logits.shape[1] != cfg.n_routed_experts:
        raise ValueError(
            f"router_logits must be [T, {cfg.n_routed_experts}], got {tuple(router_logits.shape)}"
        )
    if not can_launch(router_logits):
        raise RuntimeError("fused routing needs a CUDA tensor (or TRITON_INTERPRET=1)")
    k = cfg.num_experts_per_tok
    t, e = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((t, k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    noaux = cfg.topk_method == "noaux_tc"
    grouped = cfg.topk_method in ("noaux_tc", "group_limited_greedy") and cfg.n_group > 1
    if noaux:
        normalize, scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
    elif k > 1 and cfg.norm_topk_prob:
        normalize, scale = True, 1.0
    else:
        normalize, scale = False, cfg.routed_scaling_factor
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
        N_GROUP=cfg.n_group if grouped else 1,
        BLOCK_G=next_pow2(cfg.n_group if grouped else 1),
        TOPK_GROUP=cfg.topk_group if grouped else 1,
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
