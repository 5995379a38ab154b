"""The gateway's admission queue against a real mesh (gateway --max-inflight 4 --max-queued 6,
one unified instance): a burst within the bound queues and completes with nothing refused;
beyond it requests are refused at once with 429 / RESOURCE_EXHAUSTED; a queued request whose
client goes away, or that is aborted, leaves the queue; every page is back afterwards."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest

from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.reliability.soak_harness import (
    Outcome,
    grpc_generate,
    openai_completion,
    rest_generate,
    run,
    scrape,
    wait_idle,
)
from tests.unified.conftest import QUEUE_MAX_INFLIGHT, QUEUE_MAX_QUEUED

pytestmark = pytest.mark.timeout(240)
CLIENT_TIMEOUT_S = 120.0  # a hang fails the request instead of blocking the test
NEW_TOKENS = 16


def prompt(length: int, salt: int) -> list[int]:
    return [9 + (i * 17 + salt * 3) % 500 for i in range(length)]


def grpc_request(n: int, length: int, new: int, rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        input_ids=prompt(length, n),
        sampling=pb.SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True),
    )


async def one(kind: str, stub, session, mesh, n: int, length: int, new: int) -> Outcome:
    if kind == "grpc":
        return await grpc_generate(stub, grpc_request(n, length, new), CLIENT_TIMEOUT_S)
    if kind in ("rest", "rest-sse"):
        body = {
            "input_ids": prompt(length, n),
            "sampling": {"max_new_tokens": new, "ignore_eos": True},
            "stream": kind == "rest-sse",
        }
        return await rest_generate(session, mesh.url, body, CLIENT_TIMEOUT_S)
    body = {
        "model": mesh.model_name,
        "prompt": prompt(length, n),
        "max_tokens": new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": kind == "openai-sse",
    }
    return await openai_completion(session, mesh.url, body, CLIENT_TIMEOUT_S)


async def gauge(mesh, name: str) -> float:
    return (await asyncio.to_thread(scrape, mesh.url)).get(name, -1.0)


async def until_gauge(mesh, name: str, value: float, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (got := await gauge(mesh, name)) != value and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return got


def test_a_burst_within_the_bound_queues_and_completes(queue_mesh) -> None:
    kinds = ("grpc", "rest", "rest-sse", "openai", "openai-sse")
    burst = QUEUE_MAX_INFLIGHT + QUEUE_MAX_QUEUED  # 10: 4 dispatched at once, 6 wait

    async def main() -> list[Outcome]:
        async with (
            grpc.aio.insecure_channel(queue_mesh.grpc_address) as ch,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
        ):
            stub = generation_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(
                *(
                    one(
                        kinds[n % len(kinds)], stub, session, queue_mesh, n, 40 + 15 * n, NEW_TOKENS
                    )
                    for n in range(burst)
                )
            )

    outcomes = run(main())
    assert all(o.status in ("OK", 200) for o in outcomes), outcomes
    assert all(o.finish_reason == "length" for o in outcomes), outcomes
    assert [len(o.token_ids) for o in outcomes if o.protocol in ("grpc", "rest", "rest-sse")] == [
        NEW_TOKENS
    ] * 6
    after = wait_idle(queue_mesh.url)
    assert after["dsmesh_kv_pages_used"] == 0
    assert after["dsmesh_requests_queued"] == 0


def test_beyond_the_bound_refused_at_once_and_queued_clients_may_leave(queue_mesh) -> None:
    """Four long requests hold every dispatch slot, six more wait; then: three more are
    refused, one waiting request is aborted and one's client goes away (both leave the
    queue), and once the long ones are cancelled the four others complete."""

    async def main():
        async with (
            grpc.aio.insecure_channel(queue_mesh.grpc_address) as ch,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
        ):
            stub = generation_pb2_grpc.GenerationStub(ch)
            holders = [
                stub.Generate(grpc_request(n, 16, 3000, f"hold-{n}"), timeout=CLIENT_TIMEOUT_S)
                for n in range(QUEUE_MAX_INFLIGHT)
            ]
            for call in holders:  # each streams: all four dispatched
                await anext(call.__aiter__())
            aborted_call = stub.Generate(grpc_request(10, 20, 8, "queued-abort"), timeout=120)
            aborted_task = asyncio.ensure_future(_collect(aborted_call))
            leaver = asyncio.ensure_future(one("rest-sse", stub, session, queue_mesh, 11, 20, 8))
            kinds = ("grpc", "rest", "rest-sse", "openai")
            waiters = [
                asyncio.ensure_future(one(k, stub, session, queue_mesh, 12 + i, 20, NEW_TOKENS))
                for i, k in enumerate(kinds)
            ]
            queued_full = await until_gauge(queue_mesh, "dsmesh_requests_queued", QUEUE_MAX_QUEUED)
            refused = await asyncio.gather(
                *(one(k, stub, session, queue_mesh, 20 + i, 20, 8) for i, k in enumerate(kinds))
            )
            abort = await stub.Abort(pb.AbortRequest(request_id="queued-abort"), timeout=10)
            aborted = await aborted_task
            leaver.cancel()  # the HTTP client goes away while its request waits
            queued_left = await until_gauge(queue_mesh, "dsmesh_requests_queued", 4)
            still_running = await gauge(queue_mesh, "dsmesh_requests_running")
            for call in holders:
                call.cancel()
            served = await asyncio.gather(*waiters)
            return queued_full, refused, abort, aborted, queued_left, still_running, served

    queued_full, refused, abort, aborted, queued_left, still_running, served = run(main())
    assert queued_full == QUEUE_MAX_QUEUED
    message = f"the gateway queue is full ({QUEUE_MAX_QUEUED} requests waiting); retry later"
    for o in refused:
        assert o.status in (429, "RESOURCE_EXHAUSTED"), o
        assert message in o.error, o
        if o.protocol != "grpc":
            assert o.retry_after is not None and int(o.retry_after) >= 1, o
    assert abort.aborted
    assert [m.finish_reason for m in aborted] == ["abort"]
    assert queued_left == 4  # the aborted and the departed one left the queue
    assert still_running == QUEUE_MAX_INFLIGHT  # only the long ones were dispatched
    assert all(o.status in ("OK", 200) and o.finish_reason == "length" for o in served), served
    after = wait_idle(queue_mesh.url)
    assert after["dsmesh_kv_pages_used"] == 0
    assert after["dsmesh_requests_queued"] == 0
    assert after["dsmesh_requests_waiting"] == 0


async def _collect(call) -> list[pb.GenerateResponse]:
    return [m async for m in call]
