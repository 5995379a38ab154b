"""EPLB placement: hand-derived small cases (same outputs as DeepSeek's eplb.py) and
properties on random skewed loads."""

from __future__ import annotations

import pytest
import torch

from dsmesh.engine.ep.placement import round_robin_placement
from dsmesh.eplb_svc.algorithm import (
    balanced_packing,
    balancedness,
    balancedness_per_layer,
    logical_load_of_physical,
    predicted_rank_load,
    rank_load_of_physical,
    rebalance_experts,
    replicate_experts,
)


def test_global_policy_by_hand() -> None:
    """One group: replicate expert 0 twice (10 -> 5 -> 3.33 per replica), then pack
    [3.33, 1, 4, 2, 3.33, 3.33] onto 2 GPUs by LPT: GPU0 = {p2, p5, p1}, GPU1 = {p0, p4, p3}."""
    phy2log, log2phy, logcnt = rebalance_experts(torch.tensor([[10, 1, 4, 2]]), 6, 1, 1, 2)
    assert phy2log.tolist() == [[2, 0, 1, 0, 0, 3]]
    assert logcnt.tolist() == [[3, 1, 1, 1]]
    # by replica rank: the original (rank 0) landed on slot 3, its copies on slots 4 and 1
    assert log2phy.tolist() == [[[3, 4, 1], [2, -1, -1], [0, -1, -1], [5, -1, -1]]]
    load = predicted_rank_load(torch.tensor([[10.0, 1, 4, 2]]), phy2log, 2)
    assert torch.allclose(load, torch.tensor([[4 + 10 / 3 + 1, 10 / 3 + 10 / 3 + 2]]).double())


def test_hierarchical_policy_by_hand() -> None:
    """Groups (e0,e1)=7 (e2,e3)=7 (e4,e5)=6 (e6,e7)=8 onto 2 nodes: node 0 gets g3, g2 and
    node 1 g0, g1; node 0 replicates e6 twice, node 1 e0 and e3 once; then LPT onto 2 GPUs
    per node (worked out in docs/EPLB.md)."""
    weight = torch.tensor([[6, 1, 2, 5, 3, 3, 8, 0]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 12, 4, 2, 4)
    assert phy2log.tolist() == [[4, 6, 6, 5, 6, 7, 0, 3, 2, 0, 3, 1]]
    assert logcnt.tolist() == [[2, 1, 1, 2, 1, 1, 3, 1]]
    assert log2phy.tolist() == [
        [[6, 9, -1], [11, -1, -1], [8, -1, -1], [7, 10, -1]]
        + [[0, -1, -1], [3, -1, -1], [1, 4, 2], [5, -1, -1]]
    ]


def test_groups_not_divisible_by_nodes_uses_global_policy() -> None:
    weight = torch.tensor([[6, 1, 2, 5, 3, 3, 8, 0]])
    got = rebalance_experts(weight, 12, 3 * 0 + 1, 2, 4)  # 1 % 2 != 0
    want = rebalance_experts(weight, 12, 1, 1, 4)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_packing_and_replication_by_hand() -> None:
    pack, rank = balanced_packing(torch.tensor([[5.0, 1, 4, 4]]), 2)
    # 5 -> pack0; 4 (item 2) -> pack1; 4 (item 3) -> pack1 (4 < 5); 1 -> pack0
    assert pack.tolist() == [[0, 0, 1, 1]] and rank.tolist() == [[0, 1, 0, 1]]
    phy2log, replica_rank, count = replicate_experts(torch.tensor([[9.0, 4, 4]]), 6)
    # 9 -> (4.5) -> e1 at 4 vs 4.5: e0 again (3) -> e1 (4, first of the tie)
    assert phy2log.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert replica_rank.tolist() == [[0, 0, 0, 1, 2, 1]]
    assert count.tolist() == [[3, 2, 1]]


def test_bad_shapes_name_the_parameter() -> None:
    w = torch.ones(2, 8)
    with pytest.raises(ValueError, match="num_replicas"):
        rebalance_experts(w, 10, 4, 2, 4)
    with pytest.raises(ValueError, match="num_replicas"):
        rebalance_experts(w, 4, 4, 2, 4)
    with pytest.raises(ValueError, match="num_gpus"):
        rebalance_experts(w, 12, 4, 2, 3)
    with pytest.raises(ValueError, match="num_groups"):
        rebalance_experts(w, 12, 3, 3, 3)


def skewed_load(seed: int, layers: int, experts: int) -> torch.Tensor:
    """Zipf-like load with a random hot set per layer, integer token counts."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, experts + 1, dtype=torch.float64)
    alpha = 0.6 + 1.2 * torch.rand(layers, 1, generator=g, dtype=torch.float64)
    zipf = ranks.pow(-alpha)
    perm = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)])
    load = zipf.gather(1, perm) * 100_000
    return load.round().to(torch.int64)


CASES = [
    # (experts, groups, nodes, gpus, redundant)
    (16, 4, 2, 4, 0),
    (16, 4, 2, 4, 4),
    (16, 4, 4, 8, 8),  # one group per node: node loads are the group loads
    (32, 8, 2, 8, 8),
    (32, 8, 4, 8, 0),
    (64, 8, 2, 16, 16),
    (64, 8, 8, 16, 32),
    (24, 3, 2, 4, 4),  # 3 % 2 != 0: global policy
    (16, 1, 1, 4, 4),
    (20, 5, 5, 5, 5),  # one group per node and one GPU per node
    (256, 8, 4, 32, 32),  # DeepSeek-V3 shape
]


@pytest.mark.parametrize(("experts", "groups", "nodes", "gpus", "redundant"), CASES)
def test_properties_on_skewed_loads(
    experts: int, groups: int, nodes: int, gpus: int, redundant: int
) -> None:
    layers = 6
    replicas = experts + redundant
    per_gpu = replicas // gpus
    for seed in range(4):
        load = skewed_load(seed * 100 + experts, layers, experts)
        phy2log, log2phy, logcnt = rebalance_experts(load, replicas, groups, nodes, gpus)
        assert phy2log.shape == (layers, replicas) and phy2log.dtype == torch.int64
        # every logical expert has >= 1 replica, counts add up to the physical experts
        counted = torch.zeros(layers, experts, dtype=torch.int64)
        counted.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        assert torch.equal(counted, logcnt) and bool((logcnt >= 1).all())
        assert torch.equal(logcnt.sum(-1), torch.full((layers,), replicas))
        # log2phy lists exactly each expert's physical ids, padded with -1
        assert log2phy.shape == (layers, experts, int(logcnt.max()))
        for layer in range(layers):
            for e in range(experts):
                row = log2phy[layer, e].tolist()
                n = int(logcnt[layer, e])
                assert row[n:] == [-1] * (len(row) - n)
                assert sorted(row[:n]) == (phy2log[layer] == e).nonzero().flatten().tolist()
        # each GPU holds replicas / gpus physical experts (by construction of the layout),
        # and no GPU holds two replicas of one expert unless it has to (it never does here)
        on_gpu = phy2log.view(layers, gpus, per_gpu)
        assert on_gpu.shape[-1] == per_gpu
        # never worse than the trivial (round-robin) placement, under the same prediction,
        # where the policy may move load between nodes (global, or >= 2 groups per node).
        # With one group per node the node loads are the group loads, whatever the placement
        # inside the nodes (checked below), so the trivial placement can beat it.
        trivial = round_robin_placement(layers, experts, gpus, redundant).physical_to_logical
        hierarchical = groups % nodes == 0
        if not hierarchical or groups // nodes >= 2:
            before = balancedness(predicted_rank_load(load, trivial, gpus))
            after = balancedness(predicted_rank_load(load, phy2log, gpus))
            assert after >= before - 1e-12, (seed, before, after)
        # hierarchical: every group's experts (all their replicas) stay on one node
        if hierarchical:
            per_node = replicas // nodes
            node_of_phys = torch.arange(replicas) // per_node
            group_of_phys = phy2log // (experts // groups)
            for layer in range(layers):
                for grp in range(groups):
                    nodes_used = node_of_phys[group_of_phys[layer] == grp].unique()
                    assert nodes_used.numel() == 1, (layer, grp, nodes_used)
            if groups == nodes:  # node load == its group's load
                node_load = predicted_rank_load(load, phy2log, nodes)
                group_load = load.view(layers, groups, -1).sum(-1).double()
                assert torch.allclose(node_load.sort(-1).values, group_load.sort(-1).values)


def test_replication_minimises_the_largest_load_per_replica() -> None:
    """Greedy replication is optimal: moving any replica cannot lower the maximum, i.e. the
    max of load/count is <= every replicated expert's load/(count - 1)."""
    load = skewed_load(7, 8, 32).float()
    _, _, count = replicate_experts(load, 48)
    per_replica = load / count
    worst = per_replica.max(-1).values
    minus_one = torch.where(count > 1, load / (count - 1).clamp(min=1), torch.inf)
    assert bool((worst <= minus_one.min(-1).values).all())


def test_packing_fills_packs_evenly_and_balances() -> None:
    w = skewed_load(3, 5, 40).float()
    pack, rank = balanced_packing(w, 8)
    for layer in range(5):
        sizes = torch.bincount(pack[layer], minlength=8)
        assert sizes.tolist() == [5] * 8
        for p in range(8):  # ranks 0..4 inside each pack
            assert sorted(rank[layer][pack[layer] == p].tolist()) == list(range(5))
    contiguous = w.view(5, 8, 5).sum(-1)
    packed = torch.zeros(5, 8).scatter_add_(1, pack, w)
    assert bool((packed.max(-1).values <= contiguous.max(-1).values).all())


def test_balancedness_and_load_helpers() -> None:
    assert balancedness(torch.tensor([1.0, 1.0, 1.0, 1.0])) == 1.0
    assert balancedness(torch.tensor([4.0, 0.0, 0.0, 0.0])) == 0.25
    assert balancedness(torch.zeros(3, 4)) == 1.0
    # overall = sum of means / sum of maxes
    assert balancedness(torch.tensor([[2.0, 0.0], [1.0, 1.0]])) == pytest.approx(2 / 3)
    assert balancedness_per_layer(torch.tensor([[2.0, 0.0], [0.0, 0.0]])).tolist() == [0.5, 1.0]
    p2l = torch.tensor([[0, 1, 2, 0]])  # expert 0 twice
    physical = torch.tensor([[3, 5, 7, 1]])
    assert logical_load_of_physical(physical, p2l, 3).tolist() == [[4.0, 5.0, 7.0]]
    assert rank_load_of_physical(physical, 2).tolist() == [[8.0, 8.0]]
    assert predicted_rank_load(torch.tensor([[4.0, 5, 7]]), p2l, 2).tolist() == [[7.0, 9.0]]
