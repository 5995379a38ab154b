"""The gateway in front of unified instances only (no prefill, no decode): healthy, serves
gRPC, REST (aggregate and SSE) and OpenAI with the offline engine's greedy tokens, aborts, and
refuses at once a request no instance could hold."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import grpc
import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.reliability.soak_harness import (
    grpc_generate,
    openai_completion,
    rest_generate,
    run,
    wait_idle,
)

pytestmark = pytest.mark.timeout(180)
CLIENT_TIMEOUT_S = 120.0
NEW_TOKENS = 20


def prompt(length: int, salt: int) -> list[int]:
    return [7 + (i * 11 + salt * 5) % 500 for i in range(length)]


PROMPTS = [prompt(n, n) for n in (3, 30, 90, 130)]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu"))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    return [r.output_ids for r in results]


def test_healthy_with_only_a_unified_instance(small_mesh) -> None:
    with urllib.request.urlopen(f"{small_mesh.url}/health", timeout=10) as resp:
        assert resp.status == 200
        assert json.loads(resp.read()) == {"status": "ok"}


def test_grpc_rest_and_openai_through_a_unified_instance(small_mesh, expected) -> None:
    async def main():
        async with (
            grpc.aio.insecure_channel(small_mesh.grpc_address) as ch,
            aiohttp.ClientSession() as session,
        ):
            stub = generation_pb2_grpc.GenerationStub(ch)
            sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
            grpc_runs = [
                grpc_generate(stub, pb.GenerateRequest(input_ids=p, sampling=sampling), 120)
                for p in PROMPTS
            ]
            rest_runs = [
                rest_generate(
                    session,
                    small_mesh.url,
                    {
                        "input_ids": p,
                        "sampling": {"temperature": 0, "max_new_tokens": NEW_TOKENS},
                        "stream": stream,
                    },
                    CLIENT_TIMEOUT_S,
                )
                for p in PROMPTS
                for stream in (False, True)
            ]
            openai = openai_completion(
                session,
                small_mesh.url,
                {"model": small_mesh.model_name, "prompt": PROMPTS[1], "max_tokens": 4},
                CLIENT_TIMEOUT_S,
            )
            return await asyncio.gather(*grpc_runs, *rest_runs, openai)

    outcomes = run(main())
    grpc_out, rest_out, openai_out = outcomes[:4], outcomes[4:12], outcomes[12]
    for i, out in enumerate(grpc_out):
        assert (out.status, out.token_ids) == ("OK", expected[i]), out
    for i, out in enumerate(rest_out):
        assert (out.status, out.token_ids) == (200, expected[i // 2]), out
        assert out.finish_reason in ("length", "stop")
    assert openai_out.status == 200 and openai_out.finish_reason == "length", openai_out
    assert wait_idle(small_mesh.url)["dsmesh_kv_pages_used"] == 0


def test_abort_through_the_gateway(small_mesh) -> None:
    async def main():
        async with grpc.aio.insecure_channel(small_mesh.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            sampling = pb.SamplingParams(temperature=0.0, max_new_tokens=900, ignore_eos=True)
            call = stub.Generate(
                pb.GenerateRequest(
                    request_id="gw-abort", input_ids=prompt(20, 1), sampling=sampling
                ),
                timeout=CLIENT_TIMEOUT_S,
            )
            messages = [await anext(call.__aiter__())]
            aborted = await stub.Abort(pb.AbortRequest(request_id="gw-abort"), timeout=10)
            messages += [m async for m in call]
            return aborted, messages

    aborted, messages = run(main())
    assert aborted.aborted
    assert messages[-1].finish_reason == "abort"
    assert wait_idle(small_mesh.url)["dsmesh_kv_pages_used"] == 0


def test_a_request_no_instance_could_hold_is_refused_at_once(small_mesh) -> None:
    # 100 + 3000 tokens: the only instance's pool holds 2048
    async def main():
        async with (
            grpc.aio.insecure_channel(small_mesh.grpc_address) as ch,
            aiohttp.ClientSession() as session,
        ):
            stub = generation_pb2_grpc.GenerationStub(ch)
            req = pb.GenerateRequest(
                input_ids=prompt(100, 2), sampling=pb.SamplingParams(max_new_tokens=3000)
            )
            body = {"input_ids": prompt(100, 2), "sampling": {"max_new_tokens": 3000}}
            openai = {"model": small_mesh.model_name, "prompt": prompt(100, 2), "max_tokens": 3000}
            return await asyncio.gather(
                grpc_generate(stub, req, CLIENT_TIMEOUT_S),
                rest_generate(session, small_mesh.url, body, CLIENT_TIMEOUT_S),
                openai_completion(session, small_mesh.url, openai, CLIENT_TIMEOUT_S),
            )

    by_grpc, by_rest, by_openai = run(main())
    assert by_grpc.status == "INVALID_ARGUMENT"
    assert by_grpc.error.startswith("sampling.max_new_tokens: "), by_grpc.error
    assert "largest instance holds 2048" in by_grpc.error
    assert by_rest.status == 400 and by_rest.error.startswith("sampling.max_new_tokens: ")
    assert by_openai.status == 400 and by_openai.error.startswith("max_tokens: ")
