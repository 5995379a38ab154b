"""Static expert placements for an EP group (EPLB computes better ones from load)."""

from __future__ import annotations

import torch

from dsmesh.engine.model.expert_location import ExpertLocation


def round_robin_placement(
    num_moe_layers: int, num_logical: int, ep_size: int, num_redundant: int = 0
) -> ExpertLocation:
    """Physical experts = logical + ``num_redundant`` (divisible by ``ep_size``): logical
    experts in order, then replicas of experts 0..R-1, dealt out in contiguous blocks.

    ``physical_to_logical`` is the same for every layer: [num_moe_layers, num_physical].
    """
    num_physical = num_logical + num_redundant
    if num_physical % ep_size:
        raise ValueError(
            f"{num_logical} experts + {num_redundant} redundant = {num_physical} physical "
            f"experts cannot be split evenly over {ep_size} ranks"
        )
    if num_redundant > num_logical:
        raise ValueError("at most one redundant replica per logical expert")
    row = torch.cat([torch.arange(num_logical), torch.arange(num_redundant)])
    return ExpertLocation.from_physical_to_logical(
        row.repeat(num_moe_layers, 1), num_logical, ep_size
    )
