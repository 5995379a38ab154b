"""EPLB: balancedness before/after on a synthetic skewed load, and the swap time on CPU.

    python -m dsmesh.bench.eplb [--layers 58] [--experts 256] [--alpha 1.0] [--repeats 5]

Load: per MoE layer, Zipf(alpha) popularity over the experts in a random order (a different
hot set per layer), scaled to 8 routed experts x 64k tokens. For each EP size (8, 32, 72;
8 GPUs per node; 8 expert groups as in DeepSeek-V3) and redundancy (0, 32), the predicted
balancedness (mean/max per-rank load, tokens split evenly over replicas) of the trivial
(round-robin) placement and of EPLB's, and the time rebalance_experts takes.

Swap: the tiny default model (16 experts, 3 MoE layers) as rank 0 of EP 2 with 2 redundant
experts; placements alternate between two EPLB placements; staging (background, from the
checkpoint's safetensors) and the blocking swap are timed, median of ``--repeats``, with
``--threads`` torch threads (1 by default: on a small shared machine, waking an OpenMP pool
for microsecond copies costs milliseconds).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsmesh.engine.ep.placement import round_robin_placement
from dsmesh.engine.ep.rebalance import Rebalancer, changed_slots
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.expert_location import ExpertLocation
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.eplb_svc.algorithm import balancedness, predicted_rank_load, rebalance_experts


def zipf_load(layers: int, experts: int, alpha: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, experts + 1, dtype=torch.float64).pow(-alpha)
    popularity = popularity / popularity.sum()
    perms = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)])
    return (popularity[perms] * 8 * 65536).round()


def balance_table(layers: int, experts: int, alpha: float) -> None:
    load = zipf_load(layers, experts, alpha)
    print(f"load: {layers} layers x {experts} experts, Zipf alpha={alpha}")
    print("| EP | nodes | redundant | policy | trivial | EPLB | rebalance_experts (s) |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    groups = 8
    for ep in (8, 32, 72):
        nodes = max(1, ep // 8)
        for redundant in (0, 32):
            physical = experts + redundant
            if physical % ep:
                continue
            trivial = round_robin_placement(layers, experts, ep, redundant).physical_to_logical
            start = time.perf_counter()
            p2l, _, _ = rebalance_experts(load, physical, groups, nodes, ep)
            seconds = time.perf_counter() - start
            before = balancedness(predicted_rank_load(load, trivial, ep))
            after = balancedness(predicted_rank_load(load, p2l, ep))
            policy = "hierarchical" if groups % nodes == 0 else "global"
            print(
                f"| {ep} | {nodes} | {redundant} | {policy} | {before:.3f} | {after:.3f} "
                f"| {seconds:.2f} |"
            )


def swap_times(repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "tiny")
        model = load_model(path, expert_location=round_robin_placement(3, 16, 2, 2), ep_rank=0)
        plans = [rebalance_experts(zipf_load(3, 16, 1.2, seed), 18, 1, 1, 2)[0] for seed in (1, 2)]
        reb = Rebalancer(model, path)
        stage_s, swap_s, changed = [], [], []
        for i in range(repeats):
            plan = plans[i % 2]
            new = ExpertLocation.from_physical_to_logical(plan, 16, 2)
            changed.append(
                sum(int(s.numel()) for s in changed_slots(model.expert_location, new, 0))
            )
            start = time.perf_counter()
            reb.submit(i + 1, plan)
            reb.wait_staged()
            stage_s.append(time.perf_counter() - start)
            result = reb.step()
            assert result is not None and result.version == i + 1
            swap_s.append(result.seconds)
        reb.close()
    w = model.moe_layers()[0].experts
    per_expert = (w.w13[0].numel() + w.w2[0].numel()) * w.w13.element_size()
    print(
        f"tiny model, rank 0 of EP 2 (9 slots x 3 MoE layers, {per_expert} B per expert): "
        f"median {statistics.median(changed)} slots change; staging (background) "
        f"{statistics.median(stage_s) * 1e3:.2f} ms, swap (blocking) "
        f"{statistics.median(swap_s) * 1e3:.3f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    balance_table(args.layers, args.experts, args.alpha)
    swap_times(args.repeats)


if __name__ == "__main__":
    main()
