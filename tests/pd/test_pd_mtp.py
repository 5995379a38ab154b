"""MTP speculative decoding across the PD handoff: prefill runs the MTP layer over the prompt
(its draft KV is one more layer of the pool's pages, so it crosses the handoff with the
target's) and drafts K tokens after the first one, which cross with the first token through
kv_broker; decode's first step verifies them. For K = 1 and 2, greedy tokens equal the
offline engine's without speculation (and transformers'), each request drafts and accepts
exactly what it does on the offline speculating engine, a short generation verifies drafts
on decode's first step, and every page comes back."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from dsmesh.clients.pd import generate_pd
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.convert import sampling_to_proto
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import dsmesh_command, start_service
from dsmesh.v1 import (
    decode_pb2_grpc,
    kv_broker_pb2,
    kv_broker_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.engine.hf_checkpoints import add_mtp_layer, make_hf_v3, random_prompts
from tests.pd.conftest import free_port

pytestmark = pytest.mark.timeout(300)
MAX_NEW = 24
PROMPTS = random_prompts([1, 6, 19, 40], 4, seed=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """V3 with one MTP layer and a vocabulary of 4, whose drafts are often accepted (so
    multi-token steps and roll-backs happen)."""
    model, path = make_hf_v3(tmp_path_factory.mktemp("pd_mtp"), seed=3, vocab_size=4)
    add_mtp_layer(path, seed=4, std=0.2)
    return model, path


Spec = tuple[int, int, int]  # a request's (drafted, accepted, verifications)


async def _run_pd(
    prefill_addr: str, decode_addr: str, max_new: int, tag: str
) -> tuple[list[list[int]], list[Spec]]:
    sampling = sampling_to_proto(SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    async with channel(prefill_addr) as p_ch, channel(decode_addr) as d_ch:
        prefill = prefill_pb2_grpc.PrefillStub(p_ch)
        decode = decode_pb2_grpc.DecodeStub(d_ch)

        async def one(i: int, prompt: list[int]) -> tuple[list[int], Spec]:
            tokens: list[int] = []
            spec = (0, 0, 0)
            async for msg in generate_pd(prefill, decode, f"{tag}-{i}", prompt, sampling, 120):
                tokens += list(msg.token_ids)
                if msg.HasField("spec"):  # the request's counts so far
                    spec = (msg.spec.draft_tokens, msg.spec.accepted_tokens, msg.spec.verifications)
            return tokens, spec

        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        deadline = time.monotonic() + 30
        while True:  # pages come back once the handoffs settle
            d = await decode.GetLoad(prefill_pb2.LoadRequest())
            p = await prefill.GetLoad(prefill_pb2.LoadRequest())
            if d.free_pages == d.total_pages and p.free_pages == p.total_pages:
                break
            assert time.monotonic() < deadline, f"decode {d}, prefill {p}"
            await asyncio.sleep(0.2)
        return [t for t, _ in outs], [c for _, c in outs]


def _mesh(checkpoint: Path, k: int, log_dir: Path) -> tuple[list, int]:
    """kv_broker, a prefill and a decode instance speculating with K = ``k``; the decode
    instance's metrics port."""
    env: dict[str, str] = {}
    broker = start_service(
        "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=log_dir
    )
    started = [broker]
    try:
        spec = ["--speculative", "mtp", "--num-draft-tokens", str(k)]
        common = ["--broker", broker.address, "--model", str(checkpoint), "--page-size", "4"]
        common += ["--max-total-tokens", "4096", *spec]
        started.append(
            start_service("prefill", dsmesh_command("prefill", *common), env=env, log_dir=log_dir)
        )
        port = free_port()
        decode = dsmesh_command("decode", *common, "--metrics-port", str(port))
        started.append(start_service("decode", decode, env=env, log_dir=log_dir))
    except BaseException:
        for proc in reversed(started):
            proc.stop()
        raise
    return started, port


async def _wait_attached(broker_address: str, within: float = 60.0) -> None:
    """Until kv_broker lists a prefill and a decode instance: a service prints its port
    before its Attach stream is up, and a Reserve before that is refused."""
    deadline = time.monotonic() + within
    async with channel(broker_address) as ch:
        broker = kv_broker_pb2_grpc.KVBrokerStub(ch)
        while True:
            listing = await broker.ListInstances(kv_broker_pb2.ListInstancesRequest())
            roles = {i.role for i in listing.instances}
            if {kv_broker_pb2.ROLE_PREFILL, kv_broker_pb2.ROLE_DECODE} <= roles:
                return
            assert time.monotonic() < deadline, f"attached: {listing}"
            await asyncio.sleep(0.1)


def _offline(checkpoint: Path, k: int | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            page_size=4,
            max_total_tokens=4096,
            speculative=None if k is None else "mtp",
            num_draft_tokens=k or 1,
        )
    )


@pytest.mark.parametrize("k", [1, 2])
def test_pd_with_mtp_equals_plain_offline_and_verifies_drafts_at_once(
    checkpoint: tuple[PreTrainedModel, Path], k: int, tmp_path: Path
) -> None:
    hf, path = checkpoint
    started, port = _mesh(path, k, tmp_path)
    try:
        asyncio.run(_wait_attached(started[0].address))
        got, spec_counts = asyncio.run(
            _run_pd(started[1].address, started[2].address, MAX_NEW, "a")
        )
        # Three tokens: prefill's first token and one draft after it (max_new_tokens bounds
        # the drafts), which decode's first step verifies: one draft, one verification.
        short, short_counts = asyncio.run(_run_pd(started[1].address, started[2].address, 3, "b"))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        for proc in reversed(started):
            proc.stop()
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    want = [r.output_ids for r in _offline(path, None).generate(PROMPTS, params)]
    assert got == want
    hf.generation_config.eos_token_id = None
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
        assert out[0, len(prompt) :].tolist() == tokens
    offline = _offline(path, k)
    results = offline.generate(PROMPTS, params)
    assert [r.output_ids for r in results] == want
    # decode drafts and accepts for each request exactly what the offline engine does, its
    # first step included (prefill's drafts crossed the handoff)
    assert [c[:2] for c in spec_counts] == [
        (r.spec_draft_tokens, r.spec_accepted_tokens) for r in results
    ]
    assert sum(c[1] for c in spec_counts) > 0
    assert short == [w[:3] for w in want]
    assert [(c[0], c[2]) for c in short_counts] == [(1, 1)] * len(PROMPTS)
    counters = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("dsmesh_spec_") and "_total{" in line
    }
    # each stream reports its request's counts; together they are the instance's
    all_counts = spec_counts + short_counts
    assert counters["dsmesh_spec_draft_tokens_total"] == sum(c[0] for c in all_counts)
    assert counters["dsmesh_spec_accepted_tokens_total"] == sum(c[1] for c in all_counts)
