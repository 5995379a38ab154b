"""MTP speculative decoding in an expert-parallel group (DP attention with EP), on gloo.

The MTP layer's routed experts are spread over the ranks like the target's, so each draft
forward is a collective: in a step where any rank speculates, every rank runs the same number
of draft forwards (empty ones where it has fewer requests, or none). Greedy tokens with K = 1
and 2 equal EP size 1 without speculation (itself checked against transformers), each
request drafts and accepts exactly what it does on one rank, under uneven load, with one
and with one rank idle throughout."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import PreTrainedModel

from engine.config import load_config
from engine.ep.generate import generate_ep
from engine.ep.runtime import EPConfig, build_ep_engine, free_port, init_group, run_lockstep
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.hf_checkpoints import add_mtp_layer, make_hf_v3, random_prompts

pytestmark = pytest.mark.timeout(400)
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
PAGE = 4
# rank of each prompt: uneven (4 and 1), and every prompt on rank 0 (rank 1 idle throughout)
LAYOUTS = {"uneven": (0, 1, 0, 0, 0), "idle": (0, 0, 0, 0, 0)}
JOBS = [(1, "uneven"), (2, "uneven"), (2, "idle")]  # (K, layout)


def prompts() -> list[list[int]]:
    return random_prompts([1, 9, 40, 3, 17], 4, seed=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """V3 with one MTP layer (MoE) and a vocabulary of 4, whose drafts are
    accepted often: single and double acceptances, and rejections."""
    model, path = make_hf_v3(tmp_path_factory.mktemp("ep_mtp"), seed=3, vocab_size=4)
    add_mtp_layer(path, seed=4, std=0.2)
    return model, path


def _config(path: Path, k: int | None) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        page_size=PAGE,
        max_total_tokens=4096,
        speculative=None if k is None else "mtp",
        num_draft_tokens=k or 1,
    )


@pytest.fixture(scope="module")
def references(checkpoint) -> dict:
    """EP size 1: plain greedy tokens (equal to transformers'), and each request's
    (drafted, accepted) counts with K = 1 and 2."""
    hf, path = checkpoint
    plain = [r.output_ids for r in LLMEngine(_config(path, None)).generate(prompts(), PARAMS)]
    hf.generation_config.eos_token_id = None
    for p, o in zip(prompts(), plain, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)
        assert out[0, len(p) :].tolist() == o
    refs: dict = {"plain": plain}
    for k in (1, 2):
        results = LLMEngine(_config(path, k)).generate(prompts(), PARAMS)
        assert [r.output_ids for r in results] == plain
        refs[k] = [(r.spec_draft_tokens, r.spec_accepted_tokens) for r in results]
    assert sum(a for _, a in refs[2]) > 0  # drafts are accepted: multi-token steps
    return refs


def _count_forwards(module: torch.nn.Module) -> Callable[[], int]:
    """How many times ``module`` has run since this call, as a function."""
    count = [0]
    module.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return lambda: count[0]


def _group_main(rank: int, port: int, path: str, results) -> None:
    ep = EPConfig(2, 0, master_port=port, timeout_s=60)
    init_group(ep, rank, torch.device("cpu"))
    try:
        for k, layout in JOBS:
            engine = build_ep_engine(_config(Path(path), k), ep, rank)
            forwards = _count_forwards(engine.draft)
            mine = {}
            for i, p in enumerate(prompts()):
                if LAYOUTS[layout][i] == rank:
                    mine[i] = engine.make_request(p, PARAMS, request_id=f"p{i}")
                    engine.requests[f"p{i}"] = mine[i]
                    engine.scheduler.add(mine[i])
            run_lockstep(engine)
            key = (k, layout)
            for i, req in mine.items():
                results[(key, i)] = (
                    req.output_ids,
                    (req.num_spec_draft_tokens, req.num_spec_accepted_tokens),
                )
            experts = engine.draft.layers[0].mlp.experts
            results[(key, "draft_experts", rank)] = experts.w13.shape[0]
            results[(key, "draft_forwards", rank)] = forwards()
            results[(key, "pages", rank)] = engine.num_pages_in_use
    finally:
        dist.destroy_process_group()


def test_ep_speculative_equals_single_rank_and_plain(checkpoint, references) -> None:
    _, path = checkpoint
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _group_main, args=(free_port(), str(path), results), nprocs=2, start_method="spawn"
        )
        results = dict(results)
    num_experts = load_config(path).moe.n_routed_experts
    for key in JOBS:
        k = key[0]
        got = [results[(key, i)] for i in range(len(prompts()))]
        assert [tokens for tokens, _ in got] == references["plain"], key
        assert [counts for _, counts in got] == references[k], key
        for rank in (0, 1):
            # each rank holds half the MTP layer's routed experts
            assert results[(key, "draft_experts", rank)] == num_experts // 2, key
            assert results[(key, "pages", rank)] == 0, key
        # every rank ran the group's draft forwards, the idle or less loaded one too
        forwards = [results[(key, "draft_forwards", rank)] for rank in (0, 1)]
        assert forwards[0] == forwards[1] > 0, (key, forwards)


def test_generate_ep_reports_each_prompts_draft_counts(checkpoint, references) -> None:
    """``dsmesh generate --ep-size 2 --speculative mtp``'s engine call: plain tokens, and
    each prompt's draft counts (``--json``'s ``spec_draft_tokens``) as on one rank."""
    _, path = checkpoint
    results = generate_ep(_config(path, 2), EPConfig(2), prompts(), PARAMS)
    assert [r.output_ids for r in results] == references["plain"]
    counts = [(r.spec_draft_tokens, r.spec_accepted_tokens) for r in results]
    assert counts == references[2]
