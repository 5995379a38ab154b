"""Expert placement from measured load: DeepSeek's EPLB policy, as pure functions on tensors.

Compatible with DeepSeek's open-source EPLB (``eplb.py``): same steps, same tie-breaking, same
outputs for the same float32 load.

- **Hierarchical policy** (``num_groups % num_nodes == 0``): (1) pack expert groups onto
  nodes so every node gets the same number of groups and a balanced load; (2) inside each
  node, give the redundant slots to the experts with the highest load per replica; (3) pack
  each node's physical experts onto its GPUs, the same number per GPU, balancing load.
  Group-limited routing then keeps a token's traffic mostly inside a node.
- **Global policy** (otherwise): the same with one group and one node.

Packing is greedy longest-processing-time: items in order of decreasing weight (ties: lower
index first), each to the lightest pack that still has room (ties: lower pack index), pack
weights summed in float32. Replication gives each redundant slot to the expert with the
highest ``load / replicas`` (ties: lower expert id).

Shapes use L = MoE layers, N = logical experts, P = physical experts (replicas), G = GPUs.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split each row's items into ``num_packs`` packs of equal size, balancing their weight.

    weight: [L, n] float, n divisible by ``num_packs``.
    Returns (pack_index [L, n] int64, rank_in_pack [L, n] int64): item i of row l goes to
    pack ``pack_index[l, i]`` at position ``rank_in_pack[l, i]`` (the order it was added).
    """
    num_rows, num_items = weight.shape
    if num_packs < 1 or num_items % num_packs:
        raise ValueError(f"{num_items} items cannot be split evenly into {num_packs} packs")
    per_pack = num_items // num_packs
    if per_pack == 1:  # one item per pack: item i is pack i
        pack_index = torch.arange(num_items, dtype=torch.int64).expand(num_rows, -1).clone()
        return pack_index, torch.zeros(num_rows, num_items, dtype=torch.int64)
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    order = torch.sort(w, dim=-1, descending=True, stable=True).indices.numpy()
    values = w.numpy()
    pack_index = np.empty((num_rows, num_items), dtype=np.int64)
    rank_in_pack = np.empty((num_rows, num_items), dtype=np.int64)
    for row in range(num_rows):
        # min-heap of (pack weight, pack id) over packs with room: the lightest, lowest id wins
        heap: list[tuple[np.float32, int]] = [(np.float32(0.0), p) for p in range(num_packs)]
        filled = [0] * num_packs
        for item in order[row]:
            load, pack = heapq.heappop(heap)
            pack_index[row, item] = pack
            rank_in_pack[row, item] = filled[pack]
            filled[pack] += 1
            if filled[pack] < per_pack:
                heapq.heappush(heap, (np.float32(load + values[row, item]), pack))
    return torch.from_numpy(pack_index), torch.from_numpy(rank_in_pack)


def replicate_experts(
    weight: torch.Tensor, num_physical: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add ``num_physical - n`` replicas to n experts, minimising the largest load per replica.

    weight: [L, n] float32. Physical expert i < n is expert i itself; each further slot copies
    the expert whose load per replica is highest at that moment.
    Returns (phy2log [L, num_physical], replica_rank [L, num_physical], count [L, n]), int64:
    replica_rank is 0 for the original, then 1, 2, ... in the order replicas were added.
    """
    num_rows, num_logical = weight.shape
    if num_physical < num_logical:
        raise ValueError(f"{num_physical} physical experts cannot hold {num_logical} experts")
    rows = torch.arange(num_rows)
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(num_rows, 1)
    replica_rank = torch.zeros(num_rows, num_physical, dtype=torch.int64)
    count = torch.ones(num_rows, num_logical, dtype=torch.int64)
    for slot in range(num_logical, num_physical):
        hottest = (weight / count).argmax(dim=-1)  # first maximum on ties
        phy2log[:, slot] = hottest
        replica_rank[:, slot] = count[rows, hottest]
        count[rows, hottest] += 1
    return phy2log, replica_rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations: [L, n] -> [L, n]."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand_as(perm))
    return inv


def rebalance_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hierarchical policy. weight [L, N] float32.

    Returns (phy2log [L, P], replica_rank [L, P], count [L, N]), int64; physical expert p
    sits on GPU ``p // (P // num_gpus)``, GPUs ``[k * G/nodes, (k+1) * G/nodes)`` on node k.
    """
    num_layers, num_logical = weight.shape
    check_shape(num_logical, num_physical, num_groups, num_nodes, num_gpus)
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_gpu = num_physical // num_gpus

    # 1. groups -> nodes. "Node-major" ids (nlog) number experts node by node, so that
    # node k holds nlog ids [k * N/nodes, (k+1) * N/nodes).
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, groups]
    node_of_group, rank_in_node = balanced_packing(group_load, num_nodes)
    first_nlog = (node_of_group * groups_per_node + rank_in_node) * group_size  # [L, groups]
    log2nlog = (first_nlog.unsqueeze(-1) + torch.arange(group_size)).flatten(-2)  # [L, N]
    nlog2log = _inverse(log2nlog)

    # 2. replicas inside each node: rows are (layer, node) pairs
    node_load = weight.gather(-1, nlog2log).view(num_layers * num_nodes, logical_per_node)
    phy2nlog, replica_rank, nlog_count = replicate_experts(node_load, num_physical // num_nodes)

    # 3. a node's physical experts -> its GPUs, by load per replica
    replica_load = (node_load / nlog_count).gather(-1, phy2nlog)
    gpu, rank_on_gpu = balanced_packing(replica_load, num_gpus // num_nodes)
    slot_of_phy = gpu * physical_per_gpu + rank_on_gpu  # position within the node
    phy_of_slot = _inverse(slot_of_phy)

    slot2nlog = phy2nlog.gather(-1, phy_of_slot).view(num_layers, num_nodes, -1)
    slot2nlog = slot2nlog + (torch.arange(num_nodes) * logical_per_node).view(1, -1, 1)
    phy2log = nlog2log.gather(-1, slot2nlog.flatten(-2))
    rank = replica_rank.gather(-1, phy_of_slot).view(num_layers, -1)
    count = nlog_count.view(num_layers, -1).gather(-1, log2nlog)
    return phy2log, rank, count


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB's entry point.

    weight: [L, N] load per logical expert (any real dtype; used as float32 on the CPU).
    num_replicas: P, physical experts per layer, a multiple of ``num_gpus``, >= N.
    num_groups: expert groups of group-limited routing (N divisible by it).
    num_nodes: nodes; ``num_gpus`` must be a multiple of it.

    Returns, all int64 on the CPU:
    phy2log [L, P]: the logical expert each physical expert holds;
    log2phy [L, N, R]: each logical expert's physical ids by replica rank, padded with -1
    (R = the largest replica count);
    logcnt [L, N]: replicas per logical expert (>= 1).
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {list(weight.shape)}")
    num_layers, num_logical = weight.shape
    weight = weight.detach().to(device="cpu", dtype=torch.float32)
    if num_groups >= 1 and num_nodes >= 1 and num_groups % num_nodes == 0:
        phy2log, rank, logcnt = rebalance_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, rank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    max_replicas = int(logcnt.max())
    log2phy = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
    physical_ids = torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1)
    log2phy.scatter_(-1, phy2log * max_replicas + rank, physical_ids)
    return phy2log, log2phy.view(num_layers, num_logical, max_replicas), logcnt


def check_shape(
    num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(message)

    need(num_groups >= 1, f"num_groups must be >= 1, got {num_groups}")
    need(num_nodes >= 1, f"num_nodes must be >= 1, got {num_nodes}")
    need(num_gpus >= 1, f"num_gpus must be >= 1, got {num_gpus}")
    need(
        num_logical % num_groups == 0,
        f"{num_logical} experts cannot form {num_groups} equal groups (num_groups)",
    )
    need(
        num_groups % num_nodes == 0,
        f"{num_groups} groups cannot be split evenly over {num_nodes} nodes (num_nodes)",
    )
    need(
        num_gpus % num_nodes == 0,
        f"{num_gpus} GPUs cannot be split evenly over {num_nodes} nodes (num_gpus)",
    )
    need(
        num_physical % num_gpus == 0,
        f"{num_physical} physical experts cannot be split evenly over {num_gpus} GPUs "
        "(num_replicas)",
    )
    need(
        num_physical >= num_logical,
        f"num_replicas ({num_physical}) must be at least the number of experts ({num_logical})",
    )


# -- load prediction ---------------------------------------------------------------------


def balancedness(load_per_rank: torch.Tensor) -> float:
    """Mean over max of per-rank load: 1.0 is perfect, 1/G is everything on one rank.

    load_per_rank: [G] for one layer, or [L, G]: then sum over layers of the mean divided by
    the sum over layers of the max, i.e. ideal MoE time / actual MoE time when each layer
    waits for its busiest rank. No load at all counts as perfectly balanced (1.0).
    """
    load = load_per_rank.to(torch.float64)
    if load.dim() == 1:
        load = load.unsqueeze(0)
    peak = float(load.max(dim=-1).values.sum())
    if peak <= 0.0:
        return 1.0
    return float(load.mean(dim=-1).sum()) / peak


def balancedness_per_layer(load_per_rank: torch.Tensor) -> torch.Tensor:
    """[L, G] -> [L] float64 mean/max per layer (1.0 for a layer with no load)."""
    load = load_per_rank.to(torch.float64)
    peak = load.max(dim=-1).values
    ratio = load.mean(dim=-1) / peak.clamp(min=torch.finfo(torch.float64).tiny)
    return torch.where(peak > 0, ratio, torch.ones_like(ratio))


def predicted_rank_load(
    logical_load: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """Per-rank load of a placement when each expert's tokens split evenly over its replicas.

    logical_load [L, N], physical_to_logical [L, P] (P divisible by ``num_ranks``; physical
    expert p on rank ``p // (P / num_ranks)``) -> [L, num_ranks] float64.
    """
    p2l = physical_to_logical.to(torch.int64)
    num_layers, num_physical = p2l.shape
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical experts cannot split over {num_ranks} ranks")
    load = logical_load.to(torch.float64)
    count = torch.zeros(num_layers, load.shape[1], dtype=torch.float64)
    count.scatter_add_(1, p2l, torch.ones_like(p2l, dtype=torch.float64))
    per_replica = (load / count.clamp(min=1.0)).gather(1, p2l)  # [L, P]
    return per_replica.view(num_layers, num_ranks, -1).sum(-1)


def rank_load_of_physical(physical_load: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Measured per-rank load: physical counts [L, P] -> [L, num_ranks] float64."""
    num_layers, num_physical = physical_load.shape
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical experts cannot split over {num_ranks} ranks")
    return physical_load.to(torch.float64).view(num_layers, num_ranks, -1).sum(-1)


def logical_load_of_physical(
    physical_load: torch.Tensor, physical_to_logical: torch.Tensor, num_logical: int
) -> torch.Tensor:
    """Sum physical counts [L, P] onto their logical experts -> [L, num_logical] float64."""
    out = torch.zeros(physical_load.shape[0], num_logical, dtype=torch.float64)
    out.scatter_add_(1, physical_to_logical.to(torch.int64), physical_load.to(torch.float64))
    return out
