"""The fused routing kernel picks the same experts with the same weights as the torch
reference (dsmesh.kernels.moe_routing.select_experts_ref), for every routing policy DeepSeek
uses."""

from __future__ import annotations

import pytest
import torch

from dsmesh.kernels.moe_routing import RoutingConfig, fused_select_experts, select_experts_ref
from tests.kernels.conftest import needs_cuda, needs_triton


def routing_cfg(**kw) -> RoutingConfig:
    base = dict(
        n_routed_experts=256,
        num_experts_per_tok=8,
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    base.update(kw)
    return RoutingConfig(**base)


CONFIGS = {
    "v3": routing_cfg(),
    "v3_unnormalised": routing_cfg(norm_topk_prob=False),
    "tiny_v3": routing_cfg(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2),
    "v2_lite_greedy": routing_cfg(
        n_routed_experts=64,
        num_experts_per_tok=6,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    ),
    "v2_group_limited": routing_cfg(
        n_routed_experts=160,
        num_experts_per_tok=6,
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
    ),
    "greedy_normalised": routing_cfg(
        n_routed_experts=64, num_experts_per_tok=6, topk_method="greedy", n_group=1, topk_group=1
    ),
}


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id (the reference's order within a row is unspecified)."""
    ids, order = ids.cpu().sort(dim=-1)
    return weights.cpu().gather(1, order), ids


def inputs(cfg: RoutingConfig, t: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, cfg.n_routed_experts, generator=g) * 2
    bias = torch.randn(cfg.n_routed_experts, generator=g) * 0.1
    bias = bias if cfg.topk_method == "noaux_tc" else None
    return logits.to(device), None if bias is None else bias.to(device)


@needs_triton
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_equals_reference(name: str, device: str) -> None:
    cfg = CONFIGS[name]
    logits, bias = inputs(cfg, 37, device)
    w, ids = fused_select_experts(logits, cfg, bias)
    w_ref, ids_ref = select_experts_ref(logits.cpu(), cfg, None if bias is None else bias.cpu())
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert ids.shape == (37, cfg.num_experts_per_tok)
    w, ids = by_id(w, ids)
    w_ref, ids_ref = by_id(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7)


@needs_triton
def test_ties_go_to_lower_ids(device: str) -> None:
    """Equal scores: the lower expert (and group) id wins, as torch.topk does on tie-free
    data; every row of integer logits has ties."""
    cfg = CONFIGS["v2_lite_greedy"]
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (8, 64), generator=g).float().to(device)
    w, ids = fused_select_experts(logits, cfg)
    for row in range(8):
        x = logits[row].cpu()
        best = torch.argsort(-x, stable=True)[:6]  # stable: lower id first among equals
        assert ids[row].cpu().tolist() == best.tolist()
        torch.testing.assert_close(w[row].cpu(), x.softmax(-1)[best], rtol=2e-6, atol=1e-7)


@needs_triton
def test_no_bias_and_empty(device: str) -> None:
    cfg = CONFIGS["v3"]
    logits, _ = inputs(cfg, 5, device, seed=2)
    w, ids = by_id(*fused_select_experts(logits, cfg, None))
    w_ref, ids_ref = by_id(*select_experts_ref(logits.cpu(), cfg, None))
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7)
    w, ids = fused_select_experts(logits[:0], cfg)
    assert w.shape == (0, 8) and ids.shape == (0, 8)
    with pytest.raises(ValueError, match="router_logits"):
        fused_select_experts(logits[:, :10], cfg)


@needs_triton
@pytest.mark.parametrize("name", ["v3", "v2_lite_greedy"])
def test_expert_map_gives_physical_ids(name: str, device: str) -> None:
    """With a logical -> physical map the same launch writes ``map[ids]``; the engine's
    select_experts does the same on the CPU."""
    from dsmesh.engine.model.moe_routing import select_experts

    cfg = CONFIGS[name]
    logits, bias = inputs(cfg, 21, device, seed=4)
    g = torch.Generator().manual_seed(5)
    expert_map = torch.randperm(cfg.n_routed_experts, generator=g).to(device)
    w, ids = fused_select_experts(logits, cfg, bias, expert_map)
    w_log, ids_log = fused_select_experts(logits, cfg, bias)
    assert torch.equal(ids.cpu(), expert_map.cpu()[ids_log.cpu()]) and torch.equal(w, w_log)
    cpu_bias = None if bias is None else bias.cpu()
    w_ref, ids_ref = select_experts(logits.cpu(), cfg, cpu_bias, expert_map.cpu())
    assert torch.equal(by_id(w, ids)[1], by_id(w_ref, ids_ref)[1])
    with pytest.raises(ValueError, match="expert_map"):
        fused_select_experts(logits, cfg, bias, expert_map[:3])


def test_engine_dispatch_uses_reference_without_triton() -> None:
    """Without the Triton kernels chosen, the engine's select_experts is the reference."""
    from dsmesh.engine.model.moe_routing import select_experts

    cfg = CONFIGS["v3"]
    logits, bias = inputs(cfg, 9, "cpu", seed=3)
    w, ids = select_experts(logits, cfg, bias)
    w_ref, ids_ref = select_experts_ref(logits, cfg, bias)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


@needs_cuda
@pytest.mark.parametrize("name", ["v3", "v2_lite_greedy"])
def test_large_batch_on_gpu(name: str) -> None:
    cfg = CONFIGS[name]
    logits, bias = inputs(cfg, 8192, "cuda", seed=4)
    from dsmesh.engine.model.moe_routing import select_experts

    w, ids = by_id(*select_experts(logits, cfg, bias, triton=True))  # the engine's CUDA path
    w_ref, ids_ref = by_id(*select_experts_ref(logits, cfg, bias))
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7)
