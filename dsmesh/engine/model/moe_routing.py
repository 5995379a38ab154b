"""The engine's routing hook: one fused Triton launch when the Triton kernels are chosen
(dsmesh/engine/model/kernel_choice.py), the plain-torch reference otherwise. The policies themselves
(``greedy``, ``group_limited_greedy``, ``noaux_tc``) are :mod:`dsmesh.kernels.moe_routing`'s."""

from __future__ import annotations

import torch

from dsmesh.engine.model.config import MoEConfig
from dsmesh.kernels.moe_routing import RoutingConfig, fused_select_experts, select_experts_ref


def routing_config(moe: MoEConfig) -> RoutingConfig:
    """The fields of ``moe`` that routing reads."""
    return RoutingConfig(
        n_routed_experts=moe.n_routed_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        topk_method=moe.topk_method,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        norm_topk_prob=moe.norm_topk_prob,
        routed_scaling_factor=moe.routed_scaling_factor,
    )


def select_experts(
    router_logits: torch.Tensor,
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64):
    logical ids, or ``expert_map[ids]`` when a logical -> physical map [E] is given.

    With ``triton`` one fused kernel does it; otherwise the reference.
    """
    if triton:
        return fused_select_experts(router_logits, cfg, correction_bias, expert_map)
    weights, ids = select_experts_ref(router_logits, cfg, correction_bias)
    return weights, ids if expert_map is None else expert_map[ids]
