"""Where each routed expert lives: the physical -> logical expert map of an EP group.

A *logical* expert is an expert of the checkpoint (``n_routed_experts`` per MoE layer). A
*physical* expert is a slot holding a copy of one logical expert's weights; an EP group of
``ep_size`` ranks has ``num_physical = n_routed_experts + num_redundant`` of them per layer,
``num_physical // ep_size`` on each rank, rank ``r`` holding physical ids
``[r * per_rank, (r + 1) * per_rank)``. Hot experts may have several replicas.

With one rank and no redundancy the map is the identity; expert parallelism and EPLB only
change the map, never the model code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLocation:
    """Placement of one EP group, for all MoE layers.

    physical_to_logical: [num_moe_layers, num_physical] int64.
    logical_to_physical: [num_moe_layers, num_logical, max_replicas] int64, padded with -1.
    logical_replica_count: [num_moe_layers, num_logical] int64, >= 1 everywhere.
    """

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    logical_replica_count: torch.Tensor
    ep_size: int = 1

    @classmethod
    def trivial(cls, num_moe_layers: int, num_logical: int, ep_size: int = 1) -> ExpertLocation:
        """Identity placement: physical expert i holds logical expert i."""
        p2l = torch.arange(num_logical, device="cpu").repeat(num_moe_layers, 1)
        return cls.from_physical_to_logical(p2l, num_logical, ep_size)

    @classmethod
    def from_physical_to_logical(
        cls, physical_to_logical: torch.Tensor, num_logical: int, ep_size: int = 1
    ) -> ExpertLocation:
        """Derive the reverse maps; every logical expert must have at least one replica."""
        p2l = physical_to_logical.to(device="cpu", dtype=torch.int64)
        num_layers, num_physical = p2l.shape
        if num_physical % ep_size:
            raise ValueError(
                f"{num_physical} physical experts cannot be split evenly over {ep_size} ranks"
            )
        counts = torch.zeros(num_layers, num_logical, dtype=torch.int64, device="cpu")
        counts.scatter_add_(1, p2l, torch.ones_like(p2l))
        if bool((counts == 0).any()):
            layer, expert = (counts == 0).nonzero()[0].tolist()
            raise ValueError(f"logical expert {expert} of MoE layer {layer} has no replica")
        max_rep = int(counts.max())
        l2p = torch.full((num_layers, num_logical, max_rep), -1, dtype=torch.int64, device="cpu")
        for layer in range(num_layers):
            fill = [0] * num_logical
            for phys, logical in enumerate(p2l[layer].tolist()):
                l2p[layer, logical, fill[logical]] = phys
                fill[logical] += 1
        return cls(p2l, l2p, counts, ep_size)

    @property
    def num_physical(self) -> int:
        return int(self.physical_to_logical.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logical_to_physical.shape[1])

    @property
    def num_local_physical(self) -> int:
        return self.num_physical // self.ep_size

    def local_physical_ids(self, rank: int) -> range:
        n = self.num_local_physical
        return range(rank * n, (rank + 1) * n)

    def rank_of_physical(self, physical: torch.Tensor) -> torch.Tensor:
        return physical // self.num_local_physical

    def to_physical(self, moe_layer: int, logical_ids: torch.Tensor, rank: int = 0) -> torch.Tensor:
        """Choose a replica for each routed (token, expert) pair (:func:`choose_replicas`).

        logical_ids [T, k] int64 -> physical ids [T, k] int64."""
        counts = self.logical_replica_count[moe_layer].to(logical_ids.device)
        table = self.logical_to_physical[moe_layer].to(logical_ids.device)
        return choose_replicas(table, counts, logical_ids, rank, self.num_local_physical)


def choose_replicas(
    table: torch.Tensor,
    counts: torch.Tensor,
    logical_ids: torch.Tensor,
    rank: int,
    num_local: int,
) -> torch.Tensor:
    """Physical replica of each routed pair: table [E, R] physical ids (padded with -1),
    counts [E] replicas per expert, logical_ids [T, k] -> [T, k] int64.

    A replica on ``rank`` (ranks hold ``num_local`` physical experts each) wins when there is
    one; otherwise replicas are used round-robin by token index, which spreads a hot
    expert's tokens evenly over its copies and is deterministic. Device ops only (no host
    sync), so a captured forward can run it."""
    if table.shape[1] == 1:
        return table[logical_ids, 0]
    replicas = counts[logical_ids]
    token = torch.arange(logical_ids.shape[0], device=logical_ids.device)[:, None]
    choice = table[logical_ids, token.expand_as(logical_ids) % replicas]
    cand = table[logical_ids]  # [T, k, R]
    local = (cand >= 0) & (cand // num_local == rank)
    has_local = local.any(-1)
    local_pick = cand.gather(-1, local.to(torch.int8).argmax(-1, keepdim=True)).squeeze(-1)
    return torch.where(has_local, local_pick, choice)


class DeviceExpertMap:
    """One MoE layer's logical -> physical table, resident on the device and updated in place
    by :meth:`update` (an EPLB swap), so that CUDA graphs captured before a swap read the new
    placement. Its width is the most replicas any placement of the group can give an expert
    (``num_physical - num_logical + 1``), so every placement fits the same buffers.

    table [E, width] int64 (padded with -1); counts [E] int64; first [E] int64, the table's
    first column (the whole map when no expert can have a second replica)."""

    def __init__(self, location: ExpertLocation, moe_layer: int, device: torch.device) -> None:
        width = location.num_physical - location.num_logical + 1
        e = location.num_logical
        self.moe_layer = moe_layer
        self.table = torch.full((e, width), -1, dtype=torch.int64, device=device)
        self.counts = torch.ones(e, dtype=torch.int64, device=device)
        self.first = torch.zeros(e, dtype=torch.int64, device=device)
        self.update(location)

    @property
    def single(self) -> bool:
        """Whether every expert has exactly one replica in every placement of this group."""
        return self.table.shape[1] == 1

    def update(self, location: ExpertLocation) -> None:
        """Copy ``location``'s map of this layer into the device buffers (between forwards)."""
        src = location.logical_to_physical[self.moe_layer]
        if src.shape[0] != self.table.shape[0] or src.shape[1] > self.table.shape[1]:
            raise ValueError(
                f"placement table {tuple(src.shape)} does not fit {tuple(self.table.shape)}"
            )
        padded = torch.full(self.table.shape, -1, dtype=torch.int64)
        padded[:, : src.shape[1]] = src
        self.table.copy_(padded)
        self.counts.copy_(location.logical_replica_count[self.moe_layer])
        self.first.copy_(padded[:, 0])

    def to_physical(self, logical_ids: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
        return choose_replicas(self.table, self.counts, logical_ids, rank, num_local)
