"""Live placement swaps on an EP rank: staged weights equal a fresh load of the new placement,
and an EP 2 group (gloo) that swaps placements mid-generation, all ranks at the same step,
produces the single-rank engine's greedy tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsmesh.engine.ep.placement import round_robin_placement
from dsmesh.engine.ep.rebalance import Rebalancer, changed_slots
from dsmesh.engine.ep.runtime import EPConfig, build_ep_engine, free_port, init_group
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.config import load_config
from dsmesh.engine.model.expert_location import ExpertLocation
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.eplb_svc.algorithm import rebalance_experts

pytestmark = pytest.mark.timeout(300)
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)
REDUNDANT = 2


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (1, 9, 40, 3, 77)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("rebalance") / "v3", arch="v3")


def placements(path: Path, ep_size: int) -> list[torch.Tensor]:
    """Two EPLB placements of skewed loads (hot experts differ), [L, 16 + R] each."""
    cfg = load_config(path)
    layers, experts = len(cfg.moe_layer_ids), cfg.moe.n_routed_experts
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        load = torch.rand(layers, experts, generator=g).pow(4) * 1000
        out.append(rebalance_experts(load, experts + REDUNDANT, 1, 1, ep_size)[0])
    return out


def test_changed_slots() -> None:
    old = ExpertLocation.from_physical_to_logical(torch.tensor([[0, 1, 2, 3]]), 4, 2)
    new = ExpertLocation.from_physical_to_logical(torch.tensor([[0, 3, 2, 1]]), 4, 2)
    assert [s.tolist() for s in changed_slots(old, new, 0)] == [[1]]
    assert [s.tolist() for s in changed_slots(old, new, 1)] == [[1]]
    with pytest.raises(ValueError, match="ep_size"):
        changed_slots(old, ExpertLocation.from_physical_to_logical(new.physical_to_logical, 4), 0)


@pytest.mark.parametrize("rank", [0, 1])
def test_swap_equals_a_fresh_load_and_waits_for_step(checkpoint: Path, rank: int) -> None:
    cfg = load_config(checkpoint)
    layers, experts = len(cfg.moe_layer_ids), cfg.moe.n_routed_experts
    old = round_robin_placement(layers, experts, 2, REDUNDANT)
    new_p2l = placements(checkpoint, 2)[0]
    new = ExpertLocation.from_physical_to_logical(new_p2l, experts, 2)

    def fresh(location: ExpertLocation):
        return load_model(checkpoint, expert_location=location, ep_rank=rank)

    def expert_weights(model) -> list[torch.Tensor]:
        return [
            t.detach().clone() for m in model.moe_layers() for t in (m.experts.w13, m.experts.w2)
        ]

    model = fresh(old)
    reb = Rebalancer(model, checkpoint)
    reb.submit(1, new_p2l)
    assert reb.wait_staged(timeout=60)
    assert reb.ready_version() == 1
    # staged, not applied: the old placement is still fully live
    assert model.expert_location is old
    assert all(m.location is old for m in model.moe_layers())
    for a, b in zip(expert_weights(model), expert_weights(fresh(old)), strict=True):
        assert torch.equal(a, b)
    result = reb.step()  # one rank, no process group: swaps at once
    assert result is not None and result.version == 1 and reb.applied_version == 1
    assert result.num_changed == sum(int(s.numel()) for s in changed_slots(old, new, rank))
    assert result.num_changed > 0
    assert torch.equal(model.expert_location.physical_to_logical, new_p2l)
    assert all(m.location is model.expert_location for m in model.moe_layers())
    for a, b in zip(expert_weights(model), expert_weights(fresh(new)), strict=True):
        assert torch.equal(a, b)
    reb.submit(1, new_p2l)  # known version: ignored
    assert reb.wait_staged(timeout=60) and reb.step() is None
    reb.close()


def _group_main(rank: int, port: int, path: str, plans, submit_at, results) -> None:
    init_group(EPConfig(2, REDUNDANT, master_port=port), rank, torch.device("cpu"))
    try:
        config = EngineConfig(model=path, page_size=4, max_total_tokens=4096)
        engine = build_ep_engine(config, EPConfig(2, REDUNDANT, master_port=port), rank)
        reb = Rebalancer(engine.model, path)
        mine = {}
        for i, p in enumerate(prompts()):
            if i % 2 == rank:
                mine[i] = engine.make_request(p, PARAMS, request_id=f"p{i}")
                engine.requests[f"p{i}"] = mine[i]
                engine.scheduler.add(mine[i])
        flag = torch.zeros(1, dtype=torch.int64)
        swaps, step = [], 0
        while True:
            flag.fill_(1 if engine.has_unfinished() else 0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if int(flag) == 0:
                break
            for version, at in enumerate(submit_at[rank], start=1):
                if step == at:
                    reb.submit(version, plans[version - 1])
                    assert reb.wait_staged(timeout=60)
            done = reb.step()
            if done is not None:
                swaps.append((done.version, step))
            engine.step(idle_forward=True)
            step += 1
        for i, req in mine.items():
            results[i] = req.output_ids
        results[("swaps", rank)] = swaps
        results[("p2l", rank)] = engine.model.expert_location.physical_to_logical.tolist()
        reb.close()
    finally:
        dist.destroy_process_group()


def test_ep2_swaps_mid_generation_with_identical_tokens(checkpoint: Path) -> None:
    reference = [
        r.output_ids
        for r in LLMEngine(EngineConfig(model=str(checkpoint))).generate(prompts(), PARAMS)
    ]
    plans = placements(checkpoint, 2)
    # rank 0 has v1 staged from step 2, rank 1 only from step 4: both swap at step 4;
    # v2 reaches both at step 6
    submit_at = {0: (2, 6), 1: (4, 6)}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _group_main,
            args=(free_port(), str(checkpoint), plans, submit_at, results),
            nprocs=2,
            start_method="spawn",
        )
        results = dict(results)
    assert results[("swaps", 0)] == results[("swaps", 1)] == [(1, 4), (2, 6)]
    for rank in (0, 1):
        assert results[("p2l", rank)] == plans[1].tolist()
    assert [results[i] for i in range(len(prompts()))] == reference
