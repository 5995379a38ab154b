"""Overload: bursts well past each admission limit of a mesh with small limits, started service
by service and shared with the fuzz tests (``soak_harness.limited_mesh``):

- gateway ``--max-inflight 8 --max-queued 16``, 80 concurrent requests over every protocol;
- decode ``--max-total-tokens 2048`` (128 pages of 16), prompts of 63 pages each;
- prefill ``--max-queued-tokens 1024``, 700-token prompts at once.

The gateway queues what the instances have no room for, so decode and prefill are never sent
more than they can take; requests beyond the gateway's queue get 429 with Retry-After (REST,
OpenAI) or RESOURCE_EXHAUSTED (gRPC), promptly. None hangs, none gets a 5xx; RSS stays
bounded; afterwards the mesh serves again and every KV page is back.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import aiohttp
import grpc
import pytest
from openai.types.shared import ErrorObject

from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.gateway.openai_conformance import conform
from tests.reliability.soak_harness import (
    LIMITED_MAX_INFLIGHT,
    LIMITED_MAX_QUEUED,
    Outcome,
    grpc_generate,
    limited_mesh,
    openai_completion,
    rest_generate,
    rss_all,
    run,
    scrape,
    wait_idle,
)

pytestmark = pytest.mark.timeout(240)

MAX_INFLIGHT = LIMITED_MAX_INFLIGHT  # 8
MAX_QUEUED = LIMITED_MAX_QUEUED  # 16
CLIENT_TIMEOUT_S = 60.0  # a hang fails the request instead of blocking the test
REJECT_WITHIN_S = 5.0  # a refusal is an admission decision: no queueing, no compute
# RSS growth allowed per service across one burst (peak while it runs, and after it). The
# services hold every buffer for a batch of this size after warm-up; measured growth is a few
# MiB (docs/RELIABILITY.md). A per-request leak or an unbounded queue would show well above.
RSS_BURST_LIMIT_MB = 64.0

OK = (200, "OK")
REFUSED = (429, "RESOURCE_EXHAUSTED")


class RssSampler:
    """Peak RSS of every service while a burst runs (sampled every 50 ms)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = rss_all(pids)
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for name, value in rss_all(self.pids).items():
                self.peak[name] = max(self.peak[name], value)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = rss_all(self.pids)

    def report(self, label: str) -> str:
        return "\n".join(
            f"overload[{label}]: RSS {n:10s} {self.start[n]:7.1f} -> peak {self.peak[n]:7.1f} "
            f"-> {self.end[n]:7.1f} MiB"
            for n in sorted(self.start)
        )

    def assert_bounded(self) -> None:
        grown = {
            n: round(max(self.peak[n], self.end[n]) - self.start[n], 1)
            for n in self.start
            if max(self.peak[n], self.end[n]) - self.start[n] > RSS_BURST_LIMIT_MB
        }
        assert not grown, f"RSS grew by more than {RSS_BURST_LIMIT_MB} MiB: {grown}"


@pytest.fixture(scope="module")
def overload_mesh(request, tmp_path_factory):
    for mesh in limited_mesh(request, tmp_path_factory):
        # warm-up: one request of each shape the bursts use, so buffers exist before RSS is read
        # (the 700-token prompts go through prefill one after another, as in the burst)
        long_prompts = [("grpc" if n % 2 else "rest", 700, 1) for n in range(MAX_INFLIGHT)]
        run(burst(mesh, [("grpc", 8, 8), ("rest", 16, 8), *long_prompts]))
        wait_idle(mesh.url)
        yield mesh


def prompt(length: int, salt: int) -> list[int]:
    return [5 + (i * 7 + salt * 31) % 500 for i in range(length)]


async def one(kind, stub, session, url, model, n, length, new) -> Outcome:
    ids = prompt(length, n)
    try:
        if kind == "grpc":
            req = pb.GenerateRequest(
                input_ids=ids, sampling=pb.SamplingParams(max_new_tokens=new, ignore_eos=True)
            )
            return await grpc_generate(stub, req, CLIENT_TIMEOUT_S)
        if kind in ("rest", "rest-sse"):
            body = {
                "input_ids": ids,
                "sampling": {"max_new_tokens": new, "ignore_eos": True},
                "stream": kind == "rest-sse",
            }
            return await rest_generate(session, url, body, CLIENT_TIMEOUT_S)
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": new,
            "temperature": 0,
            "ignore_eos": True,
            "stream": kind == "openai-sse",
        }
        return await openai_completion(session, url, body, CLIENT_TIMEOUT_S)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(kind, "CLIENT_ERROR", error=repr(exc))


async def burst(mesh, shapes: list[tuple[str, int, int]]) -> list[Outcome]:
    """Send every (protocol, prompt tokens, max new tokens) at once; outcomes in order."""
    async with (
        grpc.aio.insecure_channel(mesh.grpc_address) as channel,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(
            *(
                one(kind, stub, session, mesh.url, mesh.model_name, n, length, new)
                for n, (kind, length, new) in enumerate(shapes)
            )
        )


def check_burst(outcomes: list[Outcome], label: str) -> tuple[list[Outcome], list[Outcome]]:
    """Every request either finished or was refused promptly with a retry hint."""
    served = [o for o in outcomes if o.status in OK]
    refused = [o for o in outcomes if o.status in REFUSED]
    other = [o for o in outcomes if o.status not in OK + REFUSED]
    assert not other, f"{label}: neither served nor refused: {other[:5]}"
    assert all(o.finish_reason == "length" for o in served), served
    for o in refused:
        assert o.seconds < REJECT_WITHIN_S, f"{label}: refusal took {o.seconds:.1f}s: {o}"
        if o.protocol != "grpc":
            assert o.retry_after is not None and int(o.retry_after) >= 1, o
        if o.protocol.startswith("openai"):  # OpenAI's 429, as the SDK's models declare it
            error = conform(ErrorObject, json.loads(o.error_body)["error"])
            assert error.code == "rate_limit_exceeded" and error.message, o
    slowest = max((o.seconds for o in refused), default=0.0)
    print(
        f"\noverload[{label}]: {len(outcomes)} sent, {len(served)} served, {len(refused)} "
        f"refused (slowest refusal {slowest * 1000:.0f} ms); "
        f"by protocol {dict(Counter((o.protocol, o.status) for o in outcomes))}"
    )
    return served, refused


def check_recovered(mesh) -> None:
    """Pages back to 0, and a request of every protocol succeeds."""
    after = wait_idle(mesh.url)
    assert after["dsmesh_kv_pages_used"] == 0, after
    outcomes = run(
        burst(mesh, [(k, 12, 4) for k in ("grpc", "rest", "rest-sse", "openai", "openai-sse")])
    )
    assert all(o.status in OK and o.finish_reason == "length" for o in outcomes), outcomes
    assert all(mesh.alive().values()), mesh.alive()


def test_overload_gateway_queue_bound(overload_mesh) -> None:
    # 10x what the gateway takes (8 dispatched + 16 queued); 48 per protocol, so every
    # protocol is refused even though gRPC calls reach the gateway before HTTP ones
    kinds = ("grpc", "rest", "rest-sse", "openai", "openai-sse")
    bound = MAX_INFLIGHT + MAX_QUEUED
    shapes = [(kinds[n % len(kinds)], 8, 48) for n in range(10 * bound)]
    with RssSampler(overload_mesh.pids) as rss:
        begin = time.monotonic()
        outcomes = run(burst(overload_mesh, shapes))
        elapsed = time.monotonic() - begin
    served, refused = check_burst(outcomes, "gateway-queue")
    print(f"overload[gateway-queue]: burst over in {elapsed:.1f}s\n{rss.report('gateway-queue')}")
    # all arrive within a second and a served request takes longer: 8 run, 16 wait and run
    # after them, the rest are refused (slack for requests finishing before the last arrive)
    assert bound <= len(served) <= 2 * bound, len(served)
    message = f"the gateway queue is full ({MAX_QUEUED} requests waiting); retry later"
    assert all(message in o.error for o in refused), refused[:3]
    assert {o.protocol for o in refused} == set(kinds)
    rss.assert_bounded()
    check_recovered(overload_mesh)


def test_overload_decode_kv_pool_full_waits_at_the_gateway(overload_mesh) -> None:
    # A request is charged its prompt's pages and one more (it grows on demand): 1000-token
    # prompts take 63 + 1 pages, so the 128-page pool holds two; the gateway sends decode no
    # more and queues the rest (under both gateway bounds), until their clients give up
    shapes = [("grpc" if n % 2 else "rest", 1000, 16) for n in range(MAX_INFLIGHT)]

    async def run_and_watch() -> tuple[list[Outcome], float]:
        task = asyncio.ensure_future(_bounded_burst(overload_mesh, shapes, stop_after_s=3.0))
        peak = 0.0
        while not task.done():  # the gateway's queue while the burst runs
            peak = max(peak, await asyncio.to_thread(_queued, overload_mesh.url))
            await asyncio.sleep(0.05)
        return await task, peak

    run(burst(overload_mesh, [("rest", 1000, 1)]))  # the first long prefill sizes its buffers
    with RssSampler(overload_mesh.pids) as rss:
        outcomes, peak_queued = run(run_and_watch())
    refused = [o for o in outcomes if o.status in REFUSED]
    given_up = [o for o in outcomes if o.status in ("CLIENT_CANCELLED", "CLIENT_CLOSED")]
    served = [o for o in outcomes if o.status in OK and o.finish_reason == "length"]
    print(
        f"\noverload[decode-pool]: {len(outcomes)} sent, {len(served)} served, "
        f"{len(given_up)} given up by the client after 3 s, {len(refused)} refused; "
        f"peak queued at the gateway {peak_queued:.0f}\n{rss.report('decode-pool')}"
    )
    assert not refused, refused
    assert len(served) + len(given_up) == len(outcomes), outcomes
    # at most two are dispatched at a time (the decode pool; prefill's 1024-token queue
    # takes one such prompt at a time), so at least six wait at the gateway at once
    assert MAX_INFLIGHT - 2 <= peak_queued <= MAX_INFLIGHT - 1, peak_queued
    rss.assert_bounded()
    check_recovered(overload_mesh)  # the given-up requests left the queue and freed their pages


def _queued(url: str) -> float:
    return scrape(url).get("dsmesh_requests_queued", -1.0)


async def _bounded_burst(mesh, shapes, stop_after_s: float) -> list[Outcome]:
    """Like :func:`burst`, but requests still streaming after ``stop_after_s`` are given up
    by the client (gRPC cancel, HTTP connection closed)."""
    async with (
        grpc.aio.insecure_channel(mesh.grpc_address) as channel,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def run_one(n: int, kind: str, length: int, new: int) -> Outcome:
            start = time.monotonic()
            task = asyncio.ensure_future(
                one(kind, stub, session, mesh.url, mesh.model_name, n, length, new)
            )
            done, _ = await asyncio.wait({task}, timeout=stop_after_s)
            if done:
                return task.result()
            task.cancel()  # closes the gRPC call / the HTTP connection
            out = Outcome(kind, "CLIENT_CANCELLED" if kind == "grpc" else "CLIENT_CLOSED")
            out.seconds = time.monotonic() - start
            return out

        return await asyncio.gather(*(run_one(n, *s) for n, s in enumerate(shapes)))


def test_overload_prefill_queue_bound_waits_at_the_gateway(overload_mesh) -> None:
    # 700-token prompts: the prefill queue (1024 tokens, reported in its load) takes one at a
    # time, so the gateway holds the others until the one before has its first token; decode
    # (128 pages, 44 per request) holds two
    shapes = [("grpc" if n % 2 else "rest-sse", 700, 1) for n in range(MAX_INFLIGHT)]
    with RssSampler(overload_mesh.pids) as rss:
        outcomes = run(burst(overload_mesh, shapes))
    served, refused = check_burst(outcomes, "prefill-queue")
    print(rss.report("prefill-queue"))
    assert len(served) == len(shapes) and not refused, refused  # prefill never refused one
    rss.assert_bounded()
    check_recovered(overload_mesh)
