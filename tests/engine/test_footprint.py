"""The memory arithmetic (dsmesh/engine/footprint.py) against real models and pools: the
weights it counts are the bytes a built model holds, parameter for parameter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsmesh.engine.footprint import kv_bytes_per_token, weight_bytes
from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.build import build_model
from dsmesh.engine.model.mtp import build_mtp
from dsmesh.engine.model.tiny_model import TINY_ARCHES, tiny_config


def _held_bytes(module: torch.nn.Module) -> int:
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(
        b.numel() * b.element_size() for n, b in module.named_buffers() if "rotary" not in n
    )
    return params + buffers


@pytest.mark.parametrize("arch", TINY_ARCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_what_a_built_model_holds(arch: str, dtype: torch.dtype) -> None:
    mc = dataclasses.replace(tiny_config(arch), num_nextn_predict_layers=1)
    model = build_model(mc, dtype, torch.device("cpu"))
    assert weight_bytes(mc, dtype.itemsize).total == _held_bytes(model)
    draft = build_mtp(mc, dtype, torch.device("cpu"))
    with_mtp = weight_bytes(mc, dtype.itemsize, mtp_layers=1).total
    assert with_mtp - weight_bytes(mc, dtype.itemsize).total == _held_bytes(draft)


def test_fp8_experts_take_a_byte_a_weight_and_their_block_scales() -> None:
    mc = tiny_config("v3")
    dense = weight_bytes(mc, 2)
    fp8 = weight_bytes(mc, 2, fp8_experts=True)
    moe = mc.moe
    experts = moe.n_routed_experts * len(mc.moe_layer_ids)
    values = experts * 3 * mc.hidden_size * moe.moe_intermediate_size
    # tiny dims are below one 128 block: one scale for w13 and one for w2 per expert
    assert fp8.routed_experts == values + experts * 2 * 4
    assert dense.routed_experts == 2 * values
    assert fp8.total - fp8.routed_experts == dense.total - dense.routed_experts


def test_expert_share_counts_one_rank_of_an_ep_group() -> None:
    mc = tiny_config("v3")
    whole, half = weight_bytes(mc, 2), weight_bytes(mc, 2, expert_share=0.5)
    assert half.routed_experts * 2 == whole.routed_experts
    assert half.attention == whole.attention


@pytest.mark.parametrize("arch", TINY_ARCHES)
def test_kv_bytes_per_token_is_the_pool_s(arch: str) -> None:
    mc = tiny_config(arch)
    pool = MLAKVPool(mc.num_hidden_layers, 4, 16, mc.mla.kv_cache_dim, torch.bfloat16)
    per_token = pool.buffer.numel() * pool.buffer.element_size() // (4 * 16)
    assert kv_bytes_per_token(mc, 2) == per_token
    assert kv_bytes_per_token(mc, 2, mtp_layers=1) == per_token // mc.num_hidden_layers * (
        mc.num_hidden_layers + 1
    )
