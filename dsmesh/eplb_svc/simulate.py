"""``dsmesh eplb simulate``: predicted balancedness of the trivial and EPLB placements for a
recorded load, per layer and overall, and an optional per-layer heatmap."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsmesh.engine.ep.placement import round_robin_placement
from dsmesh.eplb_svc.algorithm import (
    balancedness,
    balancedness_per_layer,
    predicted_rank_load,
    rebalance_experts,
)
from dsmesh.eplb_svc.loadfile import LoadFile


@dataclass(frozen=True)
class Simulation:
    """Per-rank load [L, G] float64 of each placement, by name (``trivial``, ``eplb`` and,
    when the file records a placement of the same size, ``recorded``)."""

    rank_load: dict[str, torch.Tensor]
    placements: dict[str, torch.Tensor]  # [L, P] int64

    def per_layer(self) -> dict[str, torch.Tensor]:
        return {name: balancedness_per_layer(load) for name, load in self.rank_load.items()}

    def overall(self) -> dict[str, float]:
        return {name: balancedness(load) for name, load in self.rank_load.items()}


def simulate(
    load: LoadFile, ep_size: int, num_redundant: int, num_nodes: int = 1, num_groups: int = 1
) -> Simulation:
    """Raises ValueError naming the flag when the shape is impossible."""
    layers, experts = load.num_moe_layers, load.num_logical
    num_physical = experts + num_redundant
    trivial = round_robin_placement(layers, experts, ep_size, num_redundant).physical_to_logical
    eplb, _, _ = rebalance_experts(load.logical_load, num_physical, num_groups, num_nodes, ep_size)
    placements = {"trivial": trivial, "eplb": eplb}
    recorded = load.physical_to_logical
    if recorded is not None and recorded.shape == trivial.shape:
        placements = {"recorded": recorded, **placements}
    rank_load = {
        name: predicted_rank_load(load.logical_load, p2l, ep_size)
        for name, p2l in placements.items()
    }
    return Simulation(rank_load, placements)


def format_table(sim: Simulation) -> str:
    names = list(sim.rank_load)
    per_layer = sim.per_layer()
    overall = sim.overall()
    header = f"{'layer':>7}" + "".join(f"{n:>10}" for n in names)
    lines = ["balancedness (mean/max per-rank load; 1.0 = perfect)", header]
    num_layers = next(iter(per_layer.values())).shape[0]
    for layer in range(num_layers):
        lines.append(f"{layer:>7}" + "".join(f"{float(per_layer[n][layer]):>10.3f}" for n in names))
    lines.append(f"{'overall':>7}" + "".join(f"{overall[n]:>10.3f}" for n in names))
    return "\n".join(lines)


def plot_heatmap(sim: Simulation, path: str) -> None:
    """Per-rank load over the mean, layer by layer, one panel per placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(sim.rank_load)
    ratios = {
        n: (load / load.mean(-1, keepdim=True).clamp(min=1e-12)).numpy()
        for n, load in sim.rank_load.items()
    }
    vmax = max(float(r.max()) for r in ratios.values())
    overall = sim.overall()
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 6), squeeze=False)
    image = None
    for ax, name in zip(axes[0], names, strict=True):
        image = ax.imshow(ratios[name], aspect="auto", cmap="magma", vmin=0, vmax=vmax)
        ax.set_title(f"{name}: balancedness {overall[name]:.3f}")
        ax.set_xlabel("EP rank")
        ax.set_ylabel("MoE layer")
    fig.colorbar(image, ax=axes[0].tolist(), label="rank load / mean")
    fig.savefig(path, dpi=100)
    plt.close(fig)
