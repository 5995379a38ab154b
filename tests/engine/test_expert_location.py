"""Tests for dsmesh.engine.model.expert_location: reverse maps, replica choice, and the model
indirection."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.expert_location import ExpertLocation
from dsmesh.engine.model.weights import official_state_dict
from tests.engine.hf_checkpoints import (
    HFCheckpoint,
    prefill_logits,
    random_prompts,
    relative_error,
)

# 8 logical experts on 12 physical slots, 4 ranks of 3 slots. Layer 0: rank 0 holds logical
# 0, 1, 2; rank 1: 3, 4, 5; rank 2: 6, 7, 0; rank 3: 1, 2, 0. Layer 1 is a different placement.
REDUNDANT_P2L = torch.tensor(
    [
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 0],
        [7, 6, 5, 4, 3, 2, 1, 0, 7, 7, 3, 5],
    ]
)


def _redundant() -> ExpertLocation:
    return ExpertLocation.from_physical_to_logical(REDUNDANT_P2L, num_logical=8, ep_size=4)


def test_trivial_map_is_identity() -> None:
    loc = ExpertLocation.trivial(num_moe_layers=2, num_logical=8)
    assert (loc.num_physical, loc.num_logical, loc.num_local_physical) == (8, 8, 8)
    assert torch.equal(loc.physical_to_logical, torch.arange(8).repeat(2, 1))
    assert loc.logical_to_physical.shape == (2, 8, 1)
    assert torch.equal(loc.logical_to_physical[..., 0], torch.arange(8).repeat(2, 1))
    assert torch.equal(loc.logical_replica_count, torch.ones(2, 8, dtype=torch.int64))
    ids = torch.randint(0, 8, (50, 3), generator=torch.Generator().manual_seed(0))
    for layer in range(2):
        assert torch.equal(loc.to_physical(layer, ids), ids)
    assert loc.local_physical_ids(0) == range(0, 8)


def test_trivial_map_split_over_ranks() -> None:
    loc = ExpertLocation.trivial(num_moe_layers=1, num_logical=8, ep_size=4)
    assert loc.num_local_physical == 2
    assert [list(loc.local_physical_ids(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert loc.rank_of_physical(torch.arange(8)).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    ids = torch.tensor([[0, 7], [3, 4]])
    for rank in range(4):  # one replica each: every rank must route to the same slot
        assert torch.equal(loc.to_physical(0, ids, rank), ids)


def test_redundant_map_reverse_maps() -> None:
    loc = _redundant()
    assert (loc.num_physical, loc.num_logical, loc.num_local_physical) == (12, 8, 3)
    assert loc.logical_replica_count.tolist() == [
        [3, 2, 2, 1, 1, 1, 1, 1],
        [1, 1, 1, 2, 1, 2, 1, 3],
    ]
    assert loc.logical_to_physical.shape == (2, 8, 3)
    assert loc.logical_to_physical[0].tolist() == [
        [0, 8, 11],
        [1, 9, -1],
        [2, 10, -1],
        [3, -1, -1],
        [4, -1, -1],
        [5, -1, -1],
        [6, -1, -1],
        [7, -1, -1],
    ]
    assert loc.logical_to_physical[1].tolist() == [
        [7, -1, -1],
        [6, -1, -1],
        [5, -1, -1],
        [4, 10, -1],
        [3, -1, -1],
        [2, 11, -1],
        [1, -1, -1],
        [0, 8, 9],
    ]
    # every listed replica really holds its logical expert
    for layer in range(2):
        for logical in range(8):
            for phys in loc.logical_to_physical[layer, logical].tolist():
                if phys >= 0:
                    assert int(loc.physical_to_logical[layer, phys]) == logical
    assert loc.rank_of_physical(torch.tensor([0, 2, 3, 8, 11])).tolist() == [0, 0, 1, 2, 3]


def test_to_physical_prefers_a_local_replica() -> None:
    loc = _redundant()
    ids = torch.tensor([[0, 1], [2, 3], [0, 7]])
    # rank 3 holds slots 9, 10, 11 = logical 1, 2, 0; logical 3 and 7 exist only elsewhere
    assert loc.to_physical(0, ids, rank=3).tolist() == [[11, 9], [10, 3], [11, 7]]
    # rank 2 holds slots 6, 7, 8 = logical 6, 7, 0; logical 2 is remote (slots 2 and 10), so
    # token 1 takes replica 1 % 2
    assert loc.to_physical(0, ids, rank=2)[:, 0].tolist() == [8, 10, 8]
    assert loc.to_physical(0, ids, rank=2)[2, 1].item() == 7
    # rank 0 holds the first replica of logical 0, 1, 2
    assert loc.to_physical(0, ids, rank=0).tolist() == [[0, 1], [2, 3], [0, 7]]
    # layer 1: rank 2 holds slots 6, 7, 8 = logical 1, 0, 7
    assert loc.to_physical(1, torch.tensor([[7, 0, 1]]), rank=2).tolist() == [[8, 7, 6]]


def test_to_physical_spreads_remote_tokens_over_replicas() -> None:
    loc = _redundant()
    num_tokens = 300
    # rank 1 holds logical 3, 4, 5 only: logical 0 (3 replicas) and 1 (2 replicas) are remote
    ids = torch.tensor([[0, 1]]).repeat(num_tokens, 1)
    phys = loc.to_physical(0, ids, rank=1)
    assert phys[:6, 0].tolist() == [0, 8, 11, 0, 8, 11]
    assert phys[:4, 1].tolist() == [1, 9, 1, 9]
    assert torch.bincount(phys[:, 0], minlength=12)[[0, 8, 11]].tolist() == [100, 100, 100]
    assert torch.bincount(phys[:, 1], minlength=12)[[1, 9]].tolist() == [150, 150]
    # whatever the choice, it is a replica of the requested expert
    mixed = torch.randint(0, 8, (64, 4), generator=torch.Generator().manual_seed(1))
    for rank in range(4):
        for layer in range(2):
            chosen = loc.to_physical(layer, mixed, rank)
            assert torch.equal(loc.physical_to_logical[layer][chosen], mixed)


def test_logical_expert_without_replica_raises() -> None:
    p2l = torch.tensor([[0, 1, 2, 3, 4, 0, 6, 7]])  # logical 5 missing
    with pytest.raises(ValueError, match="logical expert 5 of MoE layer 0 has no replica"):
        ExpertLocation.from_physical_to_logical(p2l, num_logical=8)
    p2l = torch.tensor([list(range(8)), [0, 1, 2, 3, 4, 5, 6, 6]])  # layer 1 lacks 7
    with pytest.raises(ValueError, match="logical expert 7 of MoE layer 1"):
        ExpertLocation.from_physical_to_logical(p2l, num_logical=8)


def test_uneven_split_raises() -> None:
    with pytest.raises(ValueError, match="cannot be split evenly"):
        ExpertLocation.from_physical_to_logical(torch.arange(10)[None] % 8, 8, ep_size=4)


# --------------------------------------------------------------------------------------------
# the model routes through the placement
# --------------------------------------------------------------------------------------------

# One rank, 12 slots for 8 logical experts; slots 0..7 are NOT a permutation, so in layer 1
# logical experts 2, 7, 4 live only in slots 8, 9, 10 (layer 2: logical 3 only in slot 8) and
# the others sit in shuffled slots.
MODEL_P2L = torch.tensor(
    [
        [3, 0, 3, 1, 5, 0, 6, 3, 2, 7, 4, 1],
        [6, 6, 5, 7, 0, 4, 2, 1, 3, 6, 0, 7],
    ]
)


def test_model_with_redundant_experts_matches_trivial(v3_ckpt: HFCheckpoint) -> None:
    loc = ExpertLocation.from_physical_to_logical(MODEL_P2L, num_logical=8)
    trivial = load_model(v3_ckpt.path)
    redundant = load_model(v3_ckpt.path, expert_location=loc)
    assert redundant.expert_location is loc

    # every physical slot holds its logical expert's weights
    tensors = load_file(str(v3_ckpt.path / "model.safetensors"))
    inter = redundant.config.moe.moe_intermediate_size
    for moe_idx, layer in enumerate(redundant.config.moe_layer_ids):
        experts = redundant.model.layers[layer].mlp.experts
        assert experts.w13.shape[0] == experts.w2.shape[0] == 12
        for slot, logical in enumerate(MODEL_P2L[moe_idx].tolist()):
            base = f"model.layers.{layer}.mlp.experts.{logical}"
            assert torch.equal(experts.w13[slot, :inter], tensors[f"{base}.gate_proj.weight"])
            assert torch.equal(experts.w13[slot, inter:], tensors[f"{base}.up_proj.weight"])
            assert torch.equal(experts.w2[slot], tensors[f"{base}.down_proj.weight"])

    # routing goes through non-identity physical ids that map back to the same logical ones
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    for a, b in zip(trivial.moe_layers(), redundant.moe_layers(), strict=True):
        with torch.no_grad():
            w_logical, logical = a.route(x)
            w_physical, physical = b.route(x)
        assert torch.equal(w_logical, w_physical)
        assert torch.equal(MODEL_P2L[a.moe_layer_idx][physical], logical)
        assert bool((physical != logical).any())

    prompts = random_prompts([1, 2, 17, 64, 100], 256, seed=0)
    for mode in ("naive", "absorbed"):
        ours = torch.cat(prefill_logits(redundant, prompts, mode))
        ref = torch.cat(prefill_logits(trivial, prompts, mode))
        assert relative_error(ours, ref) <= 1e-5

    with pytest.raises(ValueError, match="trivial"):
        official_state_dict(redundant)
