"""MTP speculative decoding in expert-parallel groups behind the real mesh: kv_broker, and
prefill and decode each an EP 2 group (``--ep-size 2 --speculative mtp``) whose ranks are mesh
members of their own. The MTP layer's experts are spread over each group's ranks, so every
draft forward is a collective; prefill's drafts cross the handoff to whichever decode rank
takes the request. For K = 1 and 2, concurrent greedy requests of different prompt and output
lengths, through all four (prefill rank, decode rank) pairs, give the offline engine's tokens
without speculation; each request drafts and accepts what it does on the offline speculating
engine; both decode ranks' metrics count those drafts; and every rank's pages come back."""

from __future__ import annotations

import asyncio
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsmesh.clients.pd import generate_pd
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.convert import sampling_to_proto
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.v1 import decode_pb2_grpc, prefill_pb2_grpc
from tests.engine.hf_checkpoints import add_mtp_layer, make_hf_v3, random_prompts
from tests.mesh import group_ranks, two_free_ports, wait_pages_free

pytestmark = pytest.mark.timeout(300)
PAGE = 4
# (prompt length, max_new_tokens). Three new tokens: prefill's first token and one draft after
# it (max_new_tokens bounds the drafts), which the decode rank's first step verifies. The
# 40-token prompt takes two prefill chunks (--max-batch-tokens 32).
SHAPES = [(1, 16), (7, 3), (13, 12), (22, 16), (40, 10), (5, 3)]
PROMPTS = random_prompts([n for n, _ in SHAPES], 4, seed=5)
PARAMS = [SamplingParams(max_new_tokens=m, ignore_eos=True) for _, m in SHAPES]

Spec = tuple[int, int, int]  # a request's (drafted, accepted, verifications)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V3 with one MTP layer (MoE, like the target's layers) and a vocabulary of 4, whose
    drafts are often accepted: multi-token steps and roll-backs."""
    _, path = make_hf_v3(tmp_path_factory.mktemp("ep_mesh_mtp"), seed=3, vocab_size=4)
    add_mtp_layer(path, seed=4, std=0.2)
    return path


def _offline(path: Path, k: int | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            page_size=PAGE,
            max_total_tokens=4096,
            speculative=None if k is None else "mtp",
            num_draft_tokens=k or 1,
        )
    )


@pytest.fixture(scope="module")
def plain(checkpoint: Path) -> list[list[int]]:
    """The offline engine's greedy tokens without speculation, on one rank."""
    return [r.output_ids for r in _offline(checkpoint, None).generate(PROMPTS, PARAMS)]


def _start_mesh(path: Path, k: int, log_dir: Path) -> tuple[list[ServiceProcess], int]:
    """kv_broker, and a prefill and a decode EP 2 group speculating with K = ``k``; the port
    base of the decode ranks' /metrics (rank r serves on base + r)."""
    broker = start_service(
        "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env={}, log_dir=log_dir
    )
    started = [broker]
    try:
        common = ["--broker", broker.address, "--model", str(path), "--ep-size", "2"]
        common += ["--page-size", str(PAGE), "--max-total-tokens", "4096"]
        common += ["--max-batch-tokens", "32"]
        common += ["--speculative", "mtp", "--num-draft-tokens", str(k)]
        metrics = two_free_ports()
        groups = {
            "prefill-ep": dsmesh_command("prefill", *common),
            "decode-ep": dsmesh_command("decode", *common, "--metrics-port", str(metrics)),
        }
        with ThreadPoolExecutor(len(groups)) as pool:
            futures = [
                pool.submit(start_service, name, args, {}, log_dir) for name, args in groups.items()
            ]
        started += [f.result() for f in futures if f.exception() is None]  # to stop on failure
        for future in futures:
            future.result()  # a group that did not start
    except BaseException:
        for proc in reversed(started):
            proc.stop()
        raise
    return started, metrics


async def _generate(
    prefill_addrs: list[str], decode_addrs: list[str], tag: str
) -> list[tuple[list[int], Spec]]:
    """All requests at once, request i through prefill rank i % 2 and decode rank
    (i // 2) % 2; each request's tokens and its last reported speculative counts."""
    chans = [channel(a) for a in prefill_addrs + decode_addrs]
    pre = [prefill_pb2_grpc.PrefillStub(c) for c in chans[:2]]
    dec = [decode_pb2_grpc.DecodeStub(c) for c in chans[2:]]

    async def one(i: int) -> tuple[list[int], Spec]:
        sampling = sampling_to_proto(PARAMS[i])
        p, d = pre[i % 2], dec[(i // 2) % 2]
        tokens: list[int] = []
        spec = (0, 0, 0)
        async for msg in generate_pd(p, d, f"{tag}-{i}", PROMPTS[i], sampling, 120):
            tokens += list(msg.token_ids)
            if msg.HasField("spec"):  # the request's counts so far
                spec = (msg.spec.draft_tokens, msg.spec.accepted_tokens, msg.spec.verifications)
        return tokens, spec

    try:
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    finally:
        for c in chans:
            await c.close()


def _spec_counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dsmesh_spec_") and "_total{" in line
    }


@pytest.mark.parametrize("k", [1, 2])
def test_ep_groups_with_mtp_equal_plain_offline(
    checkpoint: Path, plain: list[list[int]], k: int, tmp_path: Path
) -> None:
    started, metrics = _start_mesh(checkpoint, k, tmp_path)
    try:
        prefill, decode = group_ranks(started[0].address)
        assert len(prefill) == len(decode) == 2, (prefill, decode)
        outs = asyncio.run(
            _generate([i.grpc_address for i in prefill], [i.grpc_address for i in decode], f"k{k}")
        )
        pages_free = wait_pages_free(prefill + decode, within=30)
        counters = [_spec_counters(metrics + rank) for rank in (0, 1)]
    finally:
        for proc in reversed(started):
            proc.stop()
    got = [tokens for tokens, _ in outs]
    spec_counts = [spec for _, spec in outs]
    assert got == plain
    assert pages_free  # every rank of both groups: no page leaked
    # each request drafts and accepts what it does on the offline speculating engine, its
    # decode rank's first step included (prefill's drafts crossed the handoff)
    results = _offline(checkpoint, k).generate(PROMPTS, PARAMS)
    assert [r.output_ids for r in results] == plain
    assert [c[:2] for c in spec_counts] == [
        (r.spec_draft_tokens, r.spec_accepted_tokens) for r in results
    ]
    assert all(c[0] > 0 for c in spec_counts), spec_counts  # every request speculated
    assert sum(c[1] for c in spec_counts) > 0  # and drafts were accepted: multi-token steps
    for i, (_, max_new) in enumerate(SHAPES):
        if max_new == 3:  # one draft, from prefill, verified by decode's first step
            assert (spec_counts[i][0], spec_counts[i][2]) == (1, 1), spec_counts[i]
    # each decode rank counts the drafts of the requests it decoded: both ranks speculated
    for rank in (0, 1):
        mine = [c for i, c in enumerate(spec_counts) if (i // 2) % 2 == rank]
        drafted = counters[rank]["dsmesh_spec_draft_tokens_total"]
        accepted = counters[rank]["dsmesh_spec_accepted_tokens_total"]
        assert drafted == sum(c[0] for c in mine) > 0, (rank, counters)
        assert accepted == sum(c[1] for c in mine), (rank, counters)
