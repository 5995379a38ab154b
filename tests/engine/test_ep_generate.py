"""Same greedy tokens at any EP size, on gloo process groups: EP 2 and 4, with and without
redundant experts, V3-style and V2-Lite-style checkpoints, two-batch overlap, and decode
through the CUDA-graph runner's forward (static all-to-all, group-agreed graph steps; run
uncaptured on the CPU), two-batch overlap included, against the single-rank engine and
transformers. One process group per EP size runs every combination, to keep it fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsmesh.engine.ep.generate import generate_ep
from dsmesh.engine.ep.runtime import EPConfig, build_ep_engine, free_port, init_group, run_lockstep
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.forward_batch import ForwardBatch
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(400)
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)
ARCHES = ("v3", "v2-lite")
_SPLIT_ROWS = ForwardBatch.split_rows


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (1, 9, 40, 3, 77)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHES}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, list[list[int]]]:
    """EP size 1, checked against transformers' greedy generate."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for arch, path in checkpoints.items():
        ours = [
            r.output_ids
            for r in LLMEngine(EngineConfig(model=str(path))).generate(prompts(), PARAMS)
        ]
        hf = AutoModelForCausalLM.from_pretrained(path).eval()
        hf.generation_config.eos_token_id = None
        for p, o in zip(prompts(), ours, strict=True):
            with torch.no_grad():
                out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)
            assert out[0, len(p) :].tolist() == o
        refs[arch] = ours
    return refs


def _count_graph_work(engine: LLMEngine) -> dict[str, int]:
    """Counters, filled as the engine runs: runner forwards split into two micro-batches,
    static (fixed-shape) dispatches, and idle graph steps of this rank."""
    counts = {"splits": 0, "static": 0, "idle": 0}

    def split(batch: ForwardBatch, n: int) -> tuple[ForwardBatch, ForwardBatch]:
        counts["splits"] += 1
        return _SPLIT_ROWS(batch, n)

    def counted(key: str, fn):
        def wrapper(*args):
            counts[key] += 1
            return fn(*args)

        return wrapper

    ForwardBatch.split_rows = split  # this rank's process only
    dispatcher = engine.model.moe_layers()[0].dispatcher  # every MoE layer's
    dispatcher._dispatch_static = counted("static", dispatcher._dispatch_static)
    engine.lockstep.idle_graph_step = counted("idle", engine.lockstep.idle_graph_step)
    return counts


def _group_main(rank: int, ep_size: int, port: int, jobs, results) -> None:
    """Every (arch, redundant) job on one group: DP attention over the prompts. A job with
    ``chunk`` prefills at most that many tokens a step, so a rank with short prompts is done
    (idle) while another still decodes."""
    ep0 = EPConfig(ep_size, 0, master_port=port)
    init_group(ep0, rank, torch.device("cpu"))
    try:
        for arch, path, redundant, tbo, graphs, chunk in jobs:
            ep = EPConfig(ep_size, redundant, master_port=port)
            config = EngineConfig(
                model=path,
                page_size=4,
                max_total_tokens=4096,
                tbo=tbo,
                max_batch_tokens=chunk or EngineConfig.max_batch_tokens,
            )
            engine = build_ep_engine(config, ep, rank)
            if graphs:  # the CUDA path's runner, without capture (CPU)
                engine.graph_runner = CudaGraphRunner(
                    engine.model, engine.kv_pool, 8, 512, use_graphs=False, tbo=tbo
                )
                counts = _count_graph_work(engine)
            mine = {}
            for i, p in enumerate(prompts()):
                if i % ep_size == rank:
                    mine[i] = engine.make_request(p, PARAMS, request_id=f"p{i}")
                    engine.requests[f"p{i}"] = mine[i]
                    engine.scheduler.add(mine[i])
            run_lockstep(engine)
            experts = engine.model.moe_layers()[0].experts
            expert_bytes = sum(t.numel() * t.element_size() for t in (experts.w13, experts.w2))
            for i, req in mine.items():
                results[(arch, redundant, tbo, graphs, i)] = req.output_ids
            results[(arch, redundant, tbo, graphs, "bytes", rank)] = expert_bytes
            if graphs:
                counts["runs"] = engine.graph_runner.num_eager
                counts["ahead"] = engine.num_launched_ahead
                counts["moe_layers"] = len(engine.model.moe_layers())
                results[(arch, redundant, tbo, graphs, "runs", rank)] = counts
            assert engine.num_pages_in_use == 0
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ep_size", [2, 4])
def test_ep_generate_equals_single_rank_and_transformers(
    checkpoints, references, ep_size: int
) -> None:
    jobs = [
        (arch, str(checkpoints[arch]), r, tbo, False, None)
        for arch in ARCHES
        for r in (0, ep_size)
        for tbo in (False, True)
    ]
    jobs += [("v3", str(checkpoints["v3"]), r, False, True, None) for r in (0, ep_size)]
    if ep_size == 2:  # TBO in the runner; rank 0 prefills 118 tokens 32 a step, rank 1 12
        jobs += [
            (arch, str(checkpoints[arch]), r, True, True, 32) for arch in ARCHES for r in (0, 2)
        ]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _group_main,
            args=(ep_size, free_port(), jobs, results),
            nprocs=ep_size,
            start_method="spawn",
        )
        results = dict(results)
    for arch, _, redundant, tbo, graphs, chunk in jobs:
        got = [results[(arch, redundant, tbo, graphs, i)] for i in range(len(prompts()))]
        assert got == references[arch], (arch, ep_size, redundant, tbo, graphs)
        if graphs:  # every rank ran its decode steps through the runner, idle ones too
            counts = [results[(arch, redundant, tbo, graphs, "runs", r)] for r in range(ep_size)]
            assert min(c["runs"] for c in counts) >= 9, counts
            for c in counts:  # each runner forward dispatched statically, per micro-batch
                assert c["static"] == c["moe_layers"] * (c["runs"] + c["splits"]), c
                assert (c["splits"] >= 5) if tbo else (c["splits"] == 0), c
            # the ranks agree on each bucket, so they split the same forwards, and launch
            # steps ahead together (host votes while the previous step runs)
            assert len({c["splits"] for c in counts}) == 1, counts
            assert len({c["ahead"] for c in counts}) == 1, counts
            if not chunk:  # every rank decodes its 10 tokens at once: 9 steps, most ahead
                assert counts[0]["ahead"] >= 5, counts
            if chunk:  # rank 1 is done while rank 0 decodes: it pads the agreed graph steps
                assert counts[1]["idle"] >= 2 and counts[0]["idle"] == 0, counts
        # each rank holds (16 + R) / N of the 16 logical experts' weights
        full = LLMEngine(EngineConfig(model=str(checkpoints[arch]))).model.moe_layers()[0]
        total = sum(t.numel() * t.element_size() for t in (full.experts.w13, full.experts.w2))
        n_logical = full.experts.w13.shape[0]
        for rank in range(ep_size):
            per_rank = results[(arch, redundant, tbo, graphs, "bytes", rank)]
            assert per_rank == total * (n_logical + redundant) // ep_size // n_logical


def test_cli_ep_generate(checkpoints, references) -> None:
    args = [
        sys.executable,
        "-m",
        "dsmesh",
        "generate",
        "--model",
        str(checkpoints["v3"]),
        "--ep-size",
        "2",
        "--num-redundant-experts",
        "2",
        "--max-new-tokens",
        "10",
        "--ignore-eos",
        "--json",
    ]
    for p in prompts():
        args += ["--input-ids", ",".join(map(str, p))]
    out = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    got = [json.loads(line)["output_ids"] for line in out.stdout.splitlines()]
    assert got == references["v3"]


def test_ep_bad_input_is_refused_before_ranks_start(checkpoints) -> None:
    from dsmesh.engine.errors import InvalidRequestError

    config = EngineConfig(model=str(checkpoints["v3"]))
    with pytest.raises(InvalidRequestError, match="input_ids"):
        generate_ep(config, EPConfig(2), [[1, 10**6]], PARAMS)
    with pytest.raises(ValueError, match="split evenly"):
        generate_ep(config, EPConfig(4, 1), [[1, 2]], PARAMS)
