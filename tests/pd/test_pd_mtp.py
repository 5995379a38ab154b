"""MTP speculative decoding across the PD handoff: prefill runs the MTP layer over the prompt
(its draft KV is one more layer of the pool's pages, so it crosses the handoff with the
target's), decode drafts and verifies; greedy tokens equal the offline engine without
speculation and with it, decode's drafts are accepted, and every page comes back."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest

from dsmesh.cli.launcher import dsmesh_command, start_service
from dsmesh.clients.pd import generate_pd
from dsmesh.runtime.convert import sampling_to_proto
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.hf_checkpoints import add_mtp_layer, make_hf_v3, random_prompts
from tests.pd.conftest import free_port

pytestmark = pytest.mark.timeout(300)
LENGTHS = [1, 6, 19, 40]
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V3 with one MTP layer and a vocabulary of 4, where random drafts are often accepted
    (so multi-token steps and roll-backs happen)."""
    _, path = make_hf_v3(tmp_path_factory.mktemp("pd_mtp"), seed=7, vocab_size=4)
    add_mtp_layer(path, seed=8)
    return path


async def _run_pd(prefill_addr: str, decode_addr: str) -> tuple[list[list[int]], list]:
    sampling = sampling_to_proto(SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    async with channel(prefill_addr) as p_ch, channel(decode_addr) as d_ch:
        prefill = prefill_pb2_grpc.PrefillStub(p_ch)
        decode = decode_pb2_grpc.DecodeStub(d_ch)

        async def one(i: int, prompt: list[int]) -> tuple[list[int], tuple[int, int, int]]:
            tokens: list[int] = []
            spec = (0, 0, 0)
            async for msg in generate_pd(prefill, decode, f"mtp-{i}", prompt, sampling, 120):
                tokens += list(msg.token_ids)
                if msg.HasField("spec"):  # the request's counts so far
                    spec = (msg.spec.draft_tokens, msg.spec.accepted_tokens, msg.spec.verifications)
            return tokens, spec

        prompts = random_prompts(LENGTHS, 4, seed=2)
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        deadline = time.monotonic() + 30
        while True:  # pages come back once the handoffs settle
            d = await decode.GetLoad(prefill_pb2.LoadRequest())
            p = await prefill.GetLoad(prefill_pb2.LoadRequest())
            if d.free_pages == d.total_pages and p.free_pages == p.total_pages:
                break
            assert time.monotonic() < deadline, f"decode {d}, prefill {p}"
            await asyncio.sleep(0.2)
        return [t for t, _ in outs], [c for _, c in outs]


def test_pd_with_mtp_equals_plain_offline(checkpoint: Path, tmp_path: Path) -> None:
    env: dict[str, str] = {}
    broker = start_service(
        "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=tmp_path
    )
    started = [broker]
    try:
        spec = ["--speculative", "mtp", "--num-draft-tokens", "2"]
        common = ["--broker", broker.address, "--model", str(checkpoint), "--page-size", "4"]
        common += ["--max-total-tokens", "4096", *spec]
        prefill = start_service(
            "prefill", dsmesh_command("prefill", *common), env=env, log_dir=tmp_path
        )
        started.append(prefill)
        port = free_port()
        decode = start_service(
            "decode",
            dsmesh_command("decode", *common, "--metrics-port", str(port)),
            env=env,
            log_dir=tmp_path,
        )
        started.append(decode)
        got, spec_counts = asyncio.run(_run_pd(prefill.address, decode.address))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        for proc in reversed(started):
            proc.stop()
    offline = LLMEngine(EngineConfig(model=str(checkpoint), page_size=4, max_total_tokens=4096))
    prompts = random_prompts(LENGTHS, 4, seed=2)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    want = [r.output_ids for r in offline.generate(prompts, params)]
    assert got == want
    spec = LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            page_size=4,
            max_total_tokens=4096,
            speculative="mtp",
            num_draft_tokens=2,
        )
    )
    assert [r.output_ids for r in spec.generate(prompts, params)] == want
    stats = spec.spec_stats
    assert stats is not None and stats.num_accepted_tokens > 0
    counters = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("dsmesh_spec_") and "_total{" in line
    }
    # Decode speculates after the handoff. Its first step drafts nothing (prefill's draft
    # proposal does not cross yet; its draft KV does), so the counts differ from the
    # offline engine's by those first steps' drafts.
    drafted = counters["dsmesh_spec_draft_tokens_total"]
    assert 0 < drafted <= stats.num_draft_tokens
    assert counters["dsmesh_spec_accepted_tokens_total"] > 0
    # each stream reports its request's counts; together they are the instance's
    assert sum(c[0] for c in spec_counts) == drafted
    assert sum(c[1] for c in spec_counts) == counters["dsmesh_spec_accepted_tokens_total"]
    assert all(c[2] > 0 for c in spec_counts)
