"""Offline generation on an expert-parallel group (``dsmesh generate --ep-size N``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.multiprocessing as mp

from dsmesh.engine.ep.runtime import (
    EPConfig,
    build_ep_engine,
    check_dispatch,
    check_placement,
    free_port,
    init_group,
    rank_device,
    run_lockstep,
)
from dsmesh.engine.llm_engine import EngineConfig, GenerationResult
from dsmesh.engine.sampling.params import SamplingParams


def _rank_main(
    rank: int,
    config: EngineConfig,
    ep: EPConfig,
    work: list[list[tuple[int, list[int]]]],
    params: SamplingParams,
    results,
) -> None:
    import torch.distributed as dist

    init_group(ep, rank, rank_device(config, rank))
    try:
        engine = build_ep_engine(config, ep, rank)
        reqs = {}
        for index, prompt in work[rank]:
            reqs[index] = engine.make_request(prompt, params, request_id=f"p{index}")
            engine.requests[reqs[index].request_id] = reqs[index]
            engine.scheduler.add(reqs[index])
        run_lockstep(engine)
        for index, req in reqs.items():
            spec = (req.num_spec_draft_tokens, req.num_spec_accepted_tokens)
            results[index] = (req.prompt_ids, req.output_ids, req.finish_reason or "", *spec)
        assert engine.num_pages_in_use == 0
    finally:
        dist.destroy_process_group()


def generate_ep(
    config: EngineConfig,
    ep: EPConfig,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
) -> list[GenerationResult]:
    """Spread the prompts over the ranks (DP attention), run the group, gather in order."""
    ep.validate()
    check_dispatch(ep)
    _check_inputs(config, ep, prompts)
    if ep.master_port == 0:
        ep = dataclasses.replace(ep, master_port=free_port())
    work: list[list[tuple[int, list[int]]]] = [[] for _ in range(ep.ep_size)]
    for i, prompt in enumerate(prompts):
        work[i % ep.ep_size].append((i, list(prompt)))
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _rank_main,
            args=(config, ep, work, params, results),
            nprocs=ep.ep_size,
            start_method="spawn",
        )
        out = dict(results)
    return [GenerationResult(f"p{i}", *out[i]) for i in range(len(prompts))]


def _check_inputs(config: EngineConfig, ep: EPConfig, prompts: Sequence[Sequence[int]]) -> None:
    """Refuse bad input here, with the offline engine's errors, before any rank starts."""
    from dsmesh.engine.errors import check_prompt
    from dsmesh.engine.model.config import load_config
    from dsmesh.engine.options import resolve_model_dir

    check_placement(config, ep)
    cfg = load_config(resolve_model_dir(config.model))
    for ids in prompts:
        check_prompt(list(ids), cfg.vocab_size, cfg.max_position_embeddings)
