"""MTP speculative decoding in an expert-parallel group (DP attention with EP), on gloo.

The MTP layer's routed experts are spread over the ranks like the target's, so each draft
forward is a collective: in a step where any rank speculates, every rank runs the same number
of draft forwards (padding ones where it has fewer requests, or none). Greedy tokens with K = 1
and 2 equal EP size 1 without speculation (itself checked against transformers), each
request drafts and accepts exactly what it does on one rank, under uneven load, with one
and with one rank idle throughout: eagerly, and with the decode-only speculative steps on the
CUDA path's graph runners (run uncaptured on the CPU: verify and draft forwards at buckets the
ranks agree on, static all-to-all, idle and plain ranks replaying padded rows). One process
group runs every job."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import PreTrainedModel

from dsmesh.engine.ep.generate import generate_ep
from dsmesh.engine.ep.runtime import EPConfig, build_ep_engine, free_port, init_group, run_lockstep
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.config import load_config
from dsmesh.engine.model.forward_batch import ForwardBatch
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.sampling.params import SamplingParams
from tests.engine.hf_checkpoints import add_mtp_layer, make_hf_v3, random_prompts

pytestmark = pytest.mark.timeout(400)
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
# prompt 2 (rank 0) samples, prompt 1 (rank 1) asks for logprobs: both ranks choose on the host
MIXED = [
    PARAMS,
    dataclasses.replace(PARAMS, logprobs=1),
    SamplingParams(temperature=0.9, top_k=3, seed=2, max_new_tokens=12, ignore_eos=True),
    PARAMS,
    PARAMS,
]
PAGE = 4
# rank of each prompt: uneven (4 and 1), and every prompt on rank 0 (rank 1 idle throughout)
LAYOUTS = {"uneven": (0, 1, 0, 0, 0), "idle": (0, 0, 0, 0, 0)}
# (K, layout, path, variant). path: "eager", "runners" (the graph runners, uncaptured), or
# "host-chain" (the runners, the decode backend planning on the host as FlashInfer does: the
# chained drafts run after the step's sync). variant: "greedy"; "mixed" (MIXED's params);
# "plain-rank" (speculative_max_batch 2: rank 0's four requests decode plainly while rank 1
# speculates, so rank 0 pads every draft forward); "tbo" (two-batch overlap: the target's
# forwards as two micro-batches, their all-to-alls started before the other computes)
EAGER_JOBS = [
    (1, "uneven", "eager", "greedy"),
    (2, "uneven", "eager", "greedy"),
    (2, "idle", "eager", "greedy"),
    (2, "uneven", "eager", "plain-rank"),
    (2, "uneven", "eager", "tbo"),
]
RUNNER_JOBS = [
    (1, "uneven", "runners", "greedy"),
    (2, "uneven", "runners", "greedy"),
    (1, "idle", "runners", "greedy"),
    (2, "idle", "runners", "greedy"),
    (2, "uneven", "host-chain", "greedy"),
    (2, "uneven", "runners", "mixed"),
    (2, "uneven", "runners", "plain-rank"),
    (2, "idle", "runners", "tbo"),
]
JOBS = EAGER_JOBS + RUNNER_JOBS


def prompts() -> list[list[int]]:
    return random_prompts([1, 9, 40, 3, 17], 4, seed=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """V3 with one MTP layer (MoE) and a vocabulary of 4, whose drafts are
    accepted often: single and double acceptances, and rejections."""
    model, path = make_hf_v3(tmp_path_factory.mktemp("ep_mtp"), seed=3, vocab_size=4)
    add_mtp_layer(path, seed=4, std=0.2)
    return model, path


def _config(path: Path, k: int | None, max_batch: int = 64, tbo: bool = False) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        page_size=PAGE,
        max_total_tokens=4096,
        speculative=None if k is None else "mtp",
        num_draft_tokens=k or 1,
        speculative_max_batch=max_batch,
        tbo=tbo,
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
    mixed = LLMEngine(_config(path, 2)).generate(prompts(), MIXED)
    refs["mixed"] = [r.output_ids for r in mixed]
    refs[(2, "mixed")] = [(r.spec_draft_tokens, r.spec_accepted_tokens) for r in mixed]
    return refs


def _count_forwards(module: torch.nn.Module) -> Callable[[], int]:
    """How many times ``module`` has run since this call, as a function."""
    count = [0]
    module.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return lambda: count[0]


def _count_splits() -> Callable[[], int]:
    """How many forwards have run as two micro-batches (two-batch overlap) since this call
    (patches ForwardBatch.split in this rank's process)."""
    count = [0]
    split = getattr(ForwardBatch.split, "__wrapped__", ForwardBatch.split)

    def counted(batch: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
        count[0] += 1
        return split(batch)

    counted.__wrapped__ = split  # type: ignore[attr-defined]
    ForwardBatch.split = counted  # type: ignore[method-assign]
    return lambda: count[0]


def _on_runners(engine: LLMEngine, k: int, host_chain: bool) -> None:
    """The CUDA path's runners, uncaptured, for a CPU rank (which has none): rows for five
    requests of K + 1 verify rows each (two micro-batches each with ``tbo``)."""
    engine.graph_runner = CudaGraphRunner(
        engine.model, engine.kv_pool, 5 * (k + 1), 512, use_graphs=False, tbo=engine.config.tbo
    )
    if host_chain:
        engine.model.decode_backend.plans_on_host = True  # the draft shares the backend
    assert engine.speculator is not None
    engine.speculator.attach_graphs(engine.graph_runner)


def _group_main(rank: int, port: int, path: str, results) -> None:
    ep = EPConfig(2, 0, master_port=port, timeout_s=60)
    init_group(ep, rank, torch.device("cpu"))
    try:
        for job in JOBS:
            k, layout, path_kind, variant = job
            max_batch = 2 if variant == "plain-rank" else 64
            config = _config(Path(path), k, max_batch, tbo=variant == "tbo")
            engine = build_ep_engine(config, ep, rank)
            if path_kind != "eager":
                _on_runners(engine, k, path_kind == "host-chain")
            forwards = _count_forwards(engine.draft)
            per = MIXED if variant == "mixed" else [PARAMS] * len(prompts())
            mine = {}
            for i, p in enumerate(prompts()):
                if LAYOUTS[layout][i] == rank:
                    mine[i] = engine.make_request(p, per[i], request_id=f"p{i}")
                    engine.requests[f"p{i}"] = mine[i]
                    engine.scheduler.add(mine[i])
            splits = _count_splits()
            run_lockstep(engine)
            results[(job, "splits", rank)] = splits()
            for i, req in mine.items():
                results[(job, i)] = (
                    req.output_ids,
                    (req.num_spec_draft_tokens, req.num_spec_accepted_tokens),
                )
            experts = engine.draft.layers[0].mlp.experts
            results[(job, "draft_experts", rank)] = experts.w13.shape[0]
            results[(job, "draft_forwards", rank)] = forwards()
            results[(job, "pages", rank)] = engine.num_pages_in_use
            graphs = engine.speculator.graphs
            if graphs is not None:  # forwards each runner ran, and the buckets it used
                results[(job, "runners", rank)] = (
                    graphs.target.num_eager,
                    graphs.draft.num_eager,
                    sorted(graphs.target.keys_used),
                    sorted(graphs.draft.keys_used),
                )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def group_results(checkpoint) -> dict:
    """Every job of :data:`JOBS` on one EP 2 group (gloo)."""
    _, path = checkpoint
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _group_main, args=(free_port(), str(path), results), nprocs=2, start_method="spawn"
        )
        return dict(results)


def _check_job(job: tuple, results: dict, references: dict, num_experts: int) -> None:
    """Tokens and each request's draft counts as on one rank; no page held; every rank ran
    the group's draft forwards, the idle or less loaded one too."""
    k, _, _, variant = job
    got = [results[(job, i)] for i in range(len(prompts()))]
    mixed = variant == "mixed"
    assert [tokens for tokens, _ in got] == references["mixed" if mixed else "plain"], job
    counts = references[(k, "mixed") if mixed else k]
    if variant == "plain-rank":  # only rank 1's request (prompt 1) verifies drafts
        counts = [c if i == 1 else (0, 0) for i, c in enumerate(counts)]
    assert [c for _, c in got] == counts, job
    for rank in (0, 1):
        # each rank holds half the MTP layer's routed experts
        assert results[(job, "draft_experts", rank)] == num_experts // 2, job
        assert results[(job, "pages", rank)] == 0, job
    forwards = [results[(job, "draft_forwards", rank)] for rank in (0, 1)]
    assert forwards[0] == forwards[1] > 0, (job, forwards)
    splits = [results[(job, "splits", rank)] for rank in (0, 1)]
    if variant == "tbo":  # every target forward of both ranks, the idle rank's too
        assert splits[0] == splits[1] > 5, (job, splits)
    else:
        assert splits == [0, 0], (job, splits)


def test_ep_speculative_equals_single_rank_and_plain(checkpoint, references, group_results) -> None:
    num_experts = load_config(checkpoint[1]).moe.n_routed_experts
    for job in EAGER_JOBS:
        _check_job(job, group_results, references, num_experts)
        assert (job, "runners", 0) not in group_results  # no runner on the CPU


def test_ep_speculative_steps_on_the_graph_runners(checkpoint, references, group_results) -> None:
    """Decode-only speculative steps of the group on the graph runners (uncaptured): the same
    tokens and draft counts as one rank; the ranks ran the same buckets (what they capture
    together on a GPU), the idle rank too, and every draft forward but the first step's (its
    prompts: eager) on the draft runner."""
    num_experts = load_config(checkpoint[1]).moe.n_routed_experts
    for job in RUNNER_JOBS:
        k = job[0]
        _check_job(job, group_results, references, num_experts)
        runs = [group_results[(job, "runners", rank)] for rank in (0, 1)]
        (target0, draft0, target_keys0, draft_keys0), (target1, draft1, *keys1) = runs
        assert [target_keys0, draft_keys0] == keys1, job  # agreed buckets
        assert target0 == target1 >= 5 and draft0 == draft1, (job, runs)
        if job[3] == "plain-rank":  # rank 0's four rows set the bucket throughout, and its
            # last steps (rank 1's request done) speculate nowhere: no draft forwards
            assert 0 < draft0 < target0 * k, (job, runs)
        else:  # K draft forwards a step, rows padded to buckets
            assert draft0 == target0 * k and len({b for b, _ in target_keys0}) >= 2, (job, runs)
        # only the first step (prompts, on rank 0) drafted eagerly: K forwards
        forwards = group_results[(job, "draft_forwards", 0)]
        assert forwards == draft0 + k, (job, forwards, draft0)


def test_generate_ep_reports_each_prompts_draft_counts(checkpoint, references) -> None:
    """``dsmesh generate --ep-size 2 --speculative mtp``'s engine call: plain tokens, and
    each prompt's draft counts (``--json``'s ``spec_draft_tokens``) as on one rank."""
    _, path = checkpoint
    results = generate_ep(_config(path, 2), EPConfig(2), prompts(), PARAMS)
    assert [r.output_ids for r in results] == references["plain"]
    counts = [(r.spec_draft_tokens, r.spec_accepted_tokens) for r in results]
    assert counts == references[2]
