"""Balancedness (mean / max per-rank routed load) of an expert placement, for the step model.

Two sources: a synthetic load (Zipf popularity over the experts in a random order per layer,
as ``python -m dsmesh.bench.eplb`` draws it) placed here in pure Python, or a recorded load
file (docs/EPLB.md) placed by dsmesh's own EPLB policy (``dsmesh.eplb_svc``; torch is
imported only then).

The pure-Python placement is EPLB's global policy: replicate the expert with the highest load
per replica until the redundant slots are used, then pack replicas heaviest first onto the
least loaded rank with a free slot. DeepSeek's hierarchical variant (groups to nodes first)
is not modelled; its balancedness is at most the global one's.
"""

from __future__ import annotations

import heapq
import random
from pathlib import Path

DEFAULT_SKEW = 0.5  # Zipf exponent of the synthetic load (docs/PLAN.md, "Expert load")


def zipf_load(layers: int, experts: int, skew: float, seed: int = 0) -> list[list[float]]:
    """``[layers][experts]`` shares of the routed tokens: Zipf(``skew``) in a random order."""
    rng = random.Random(seed)
    weights = [(k + 1) ** -skew for k in range(experts)]
    total = sum(weights)
    out = []
    for _ in range(layers):
        row = [w / total for w in weights]
        rng.shuffle(row)
        out.append(row)
    return out


def trivial_rank_load(load: list[float], ep: int, redundant: int) -> list[float]:
    """Per-rank load of the round-robin placement (dsmesh/engine/ep/placement.py): logical
    experts in order, then replicas of experts 0..R-1, dealt out in contiguous blocks."""
    experts = len(load)
    slots = [*range(experts), *range(redundant)]
    replicas = [1] * experts
    for e in range(redundant):
        replicas[e] += 1
    per_rank = len(slots) // ep
    ranks = [0.0] * ep
    for i, e in enumerate(slots):
        ranks[i // per_rank] += load[e] / replicas[e]
    return ranks


def eplb_rank_load(load: list[float], ep: int, redundant: int) -> list[float]:
    """Per-rank load of EPLB's global policy (replicate, then pack heaviest first)."""
    experts = len(load)
    replicas = [1] * experts
    heap = [(-load[e], e) for e in range(experts)]
    heapq.heapify(heap)
    for _ in range(redundant):
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-load[e] / replicas[e], e))
    items = sorted(
        (load[e] / replicas[e] for e in range(experts) for _ in range(replicas[e])), reverse=True
    )
    per_rank = (experts + redundant) // ep
    ranks = [(0.0, r) for r in range(ep)]  # a heap of (load, rank) with free slots
    free = [per_rank] * ep
    totals = [0.0] * ep
    for w in items:
        while True:
            _, r = heapq.heappop(ranks)
            if free[r]:
                break
        totals[r] += w
        free[r] -= 1
        if free[r]:
            heapq.heappush(ranks, (totals[r], r))
    return totals


def balancedness_of(rank_loads: list[list[float]]) -> float:
    """Sum over layers of the mean per-rank load over the sum of the maxima: the ideal MoE
    time over the actual one when each layer waits for its busiest rank (as
    ``dsmesh.eplb_svc.algorithm.balancedness``)."""
    peak = sum(max(r) for r in rank_loads)
    return sum(sum(r) / len(r) for r in rank_loads) / peak if peak > 0 else 1.0


def synthetic_balancedness(
    experts: int, ep: int, redundant: int, eplb: bool, skew: float = DEFAULT_SKEW, layers: int = 16
) -> float:
    """Balancedness of the trivial or the EPLB placement of a synthetic Zipf load."""
    return placement_balancedness(zipf_load(layers, experts, skew), ep, redundant, eplb)


def trace_load(path: Path) -> list[list[float]]:
    """``[layers][experts]`` logical load of a recorded load file (imports torch)."""
    from dsmesh.eplb_svc.loadfile import read_load

    return [[float(x) for x in row] for row in read_load(path).logical_load.tolist()]


def placement_balancedness(load: list[list[float]], ep: int, redundant: int, eplb: bool) -> float:
    """Balancedness of the trivial or the EPLB placement of ``load`` over ``ep`` ranks."""
    if ep <= 1:
        return 1.0
    experts = len(load[0])
    if (experts + redundant) % ep:
        raise ValueError(
            f"{experts} experts + {redundant} redundant cannot be split evenly over {ep} ranks"
        )
    place = eplb_rank_load if eplb else trivial_rank_load
    return balancedness_of([place(row, ep, redundant) for row in load])
