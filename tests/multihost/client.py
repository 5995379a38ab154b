"""What the multi-host tests do to the mesh as its clients: requests over REST and gRPC, the
offline engine's tokens to compare with, the KV pages checks, and the measured figures they
print (``MULTIHOST <scenario> <name>=<value>``, seen with ``-s``)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from dsmesh.engine.llm_engine import LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.multihost.conftest import Mesh, wait_until

# gRPC keepalive (dsmesh/runtime/grpc_server.py): a ping after 5 s without a frame from the
# peer, answered within 3 s, else the connection is closed. A silent peer is noticed within
# about 8 s; docs/RELIABILITY.md states the 15 s bound.
STREAM_BOUND_S = 15.0
HANDOFF_BOUND_S = 15.0


def report(scenario: str, **values: float) -> None:
    for name, value in values.items():
        print(f"MULTIHOST {scenario} {name}={value:.2f}")


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def prompts(n: int, salt: int = 0) -> list[list[int]]:
    lengths = (1, 5, 17, 40)
    return [[5 + (i * 31 + j * 7 + salt) % 400 for j in range(lengths[i % 4])] for i in range(n)]


def request(ids: list[int], max_new_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        input_ids=ids,
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def grpc_streams(address: str, requests: list[pb.GenerateRequest]) -> list[list[int]]:
    """Every request's tokens; raises the first stream's failure. Each call waits for the
    channel to connect (``wait_for_ready``) as a client on a lossy link retries a lost SYN;
    a status the gateway sends still fails it."""
    async with channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(req: pb.GenerateRequest) -> list[int]:
            tokens: list[int] = []
            async for msg in stub.Generate(req, timeout=120, wait_for_ready=True):
                tokens += msg.token_ids
            return tokens

        return await asyncio.gather(*(one(r) for r in requests))


def greedy(offline: LLMEngine, ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [r.output_ids for r in offline.generate(ids, params)]


def serves(mesh: Mesh, offline: LLMEngine, timeout_s: float = 30) -> bool:
    """Whether a REST request gets the offline engine's tokens within ``timeout_s``."""
    body = {"input_ids": [7, 8, 9], "sampling": {"max_new_tokens": 5, "ignore_eos": True}}
    want = greedy(offline, [[7, 8, 9]], 5)[0]

    def ok() -> bool:
        status, answer = post(f"{mesh.http}/v1/generate", body, 10)
        return status == 200 and answer["token_ids"] == want

    return bool(wait_until(ok, timeout_s, 0.5))


def assert_pages_return_to_zero_on(mesh: Mesh, service: str, timeout_s: float = 10) -> None:
    free = wait_until(lambda: mesh.pages_free(service), timeout_s)
    assert free, f"{service} still holds pages: {mesh.load(service)}\n{mesh.log_tails()}"


def assert_pages_return_to_zero(mesh: Mesh, timeout_s: float = 10) -> None:
    for service in ("prefill", "decode"):
        assert_pages_return_to_zero_on(mesh, service, timeout_s)
