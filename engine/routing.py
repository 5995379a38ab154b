"""DeepSeekMoE routing policies as pure functions over router logits.

- ``greedy`` (V2-Lite): softmax scores, plain top-k.
- ``group_limited_greedy`` (V2): softmax scores, keep the ``topk_group`` groups with the highest
  max score, top-k inside them.
- ``noaux_tc`` (V3): sigmoid scores; selection uses scores + ``e_score_correction_bias``; groups
  ranked by the sum of their top-2 biased scores; weights come from the unbiased scores.

Weight post-processing follows the official code: V3 normalises (if ``norm_topk_prob``) and
then always multiplies by ``routed_scaling_factor``; V2 normalises when ``top_k > 1`` and
``norm_topk_prob``, and scales otherwise.
"""

from __future__ import annotations

import torch

from engine.config import MoEConfig


def select_experts(
    router_logits: torch.Tensor,
    moe: MoEConfig,
    correction_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64):
    logical ids, or ``expert_map[ids]`` when a logical -> physical map [E] is given.

    On CUDA (with Triton) one fused kernel (kernels.routing) does it; elsewhere the reference.
    """
    from kernels._triton import use_triton

    if use_triton(router_logits):
        from kernels.routing import fused_select_experts

        return fused_select_experts(router_logits, moe, correction_bias, expert_map)
    weights, ids = select_experts_reference(router_logits, moe, correction_bias)
    return weights, ids if expert_map is None else expert_map[ids]


def select_experts_reference(
    router_logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch; the fused kernel must give the same ids and weights."""
    if moe.topk_method == "noaux_tc":
        return _noaux_tc(router_logits, moe, correction_bias)
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if moe.topk_method == "group_limited_greedy":
        group_scores = scores.view(-1, moe.n_group, moe.n_routed_experts // moe.n_group).amax(-1)
        scores = scores.masked_fill(~_group_mask(group_scores, moe), 0.0)
    weights, ids = torch.topk(scores, k=moe.num_experts_per_tok, dim=-1, sorted=False)
    if moe.num_experts_per_tok > 1 and moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * moe.routed_scaling_factor
    return weights, ids


def _noaux_tc(
    router_logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = router_logits.sigmoid()
    biased = scores if correction_bias is None else scores + correction_bias
    per_group = moe.n_routed_experts // moe.n_group
    group_scores = biased.view(-1, moe.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    biased = biased.masked_fill(~_group_mask(group_scores, moe), float("-inf"))
    ids = torch.topk(biased, k=moe.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def _group_mask(group_scores: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """group_scores [T, n_group] -> bool mask [T, E] of experts in the chosen groups."""
    group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    per_group = moe.n_routed_experts // moe.n_group
    return chosen.unsqueeze(-1).expand(-1, moe.n_group, per_group).reshape(-1, moe.n_routed_experts)
