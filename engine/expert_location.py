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
        """Choose a replica for each routed (token, expert) pair.

        logical_ids [T, k] int64 -> physical ids [T, k] int64. A replica on ``rank`` wins when
        there is one; otherwise replicas are used round-robin by token index, which spreads
        a hot expert's tokens evenly over its copies and is deterministic.
        """
        counts = self.logical_replica_count[moe_layer].to(logical_ids.device)
        table = self.logical_to_physical[moe_layer].to(logical_ids.device)
        if table.shape[1] == 1:
            return table[logical_ids, 0]
        replicas = counts[logical_ids]
        token = torch.arange(logical_ids.shape[0], device=logical_ids.device)[:, None]
        choice = table[logical_ids, token.expand_as(logical_ids) % replicas]
        cand = table[logical_ids]  # [T, k, R]
        local = (cand >= 0) & (cand // self.num_local_physical == rank)
        has_local = local.any(-1)
        local_pick = cand.gather(-1, local.to(torch.int8).argmax(-1, keepdim=True)).squeeze(-1)
        return torch.where(has_local, local_pick, choice)
