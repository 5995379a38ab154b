"""One request through a real kv-broker, prefill and decode (separate processes) is one
trace: the test's root span, every service's spans under it, no orphan, nothing left open."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest

from dsmesh.clients.pd import generate_pd
from dsmesh.runtime import telemetry
from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.v1 import decode_pb2_grpc, generation_pb2, prefill_pb2_grpc
from tests.telemetry.otlp_receiver import STATUS_ERROR, SpanRecord, orphans, roots

pytestmark = pytest.mark.timeout(120)
T = TypeVar("T")

PAGE_SIZE = 16
MAX_BATCH_TOKENS = 32
PROMPT = [(7 * i + 3) % 500 for i in range(70)]  # three prefill chunks: 32 + 32 + 6
MAX_NEW_TOKENS = 5

SERVICES = {"test-client", "prefill", "decode", "kv-broker"}
NAMED_SPANS = {
    "test.request",
    "prefill.queue",
    "prefill.chunk",
    "kv.transfer",
    "kv.commit",
    "kv.handoff",
    "decode.wait_kv",
    "decode.generate",
    "/dsmesh.v1.Prefill/Prefill",
    "/dsmesh.v1.Decode/Decode",
    "/dsmesh.v1.KVBroker/Reserve",
    "/dsmesh.v1.KVBroker/Resolve",
    "/dsmesh.v1.KVBroker/Commit",
    "/dsmesh.v1.KVBroker/Await",
}


@pytest.fixture(scope="module")
def traced_mesh(receiver, tmp_path_factory: pytest.TempPathFactory):
    cache = os.environ.get("DSMESH_CACHE_DIR") or str(tmp_path_factory.mktemp("cache"))
    logs = tmp_path_factory.mktemp("logs")
    from dsmesh.engine.model.tiny_model import default_model_dir

    default_model_dir(cache_dir=cache)  # once, before the services race for it
    env = {"DSMESH_CACHE_DIR": cache, **receiver.exporter_env()}
    broker = start_service(
        "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
    )
    common = ["--broker", broker.address, "--page-size", str(PAGE_SIZE)]
    common += ["--max-total-tokens", "4096"]
    specs = {
        "prefill": dsmesh_command("prefill", *common, "--max-batch-tokens", str(MAX_BATCH_TOKENS)),
        "decode": dsmesh_command("decode", *common),
    }
    started: list[ServiceProcess] = [broker]
    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(start_service, name, args, env, logs)
                for name, args in specs.items()
            }
            procs = {name: f.result() for name, f in futures.items()}
        started += list(procs.values())
        yield procs["prefill"], procs["decode"], logs
    finally:
        for proc in reversed(started):
            assert proc.stop() == 0, f"{proc.name} did not stop cleanly"


async def traced_request(
    mesh, rid: str, prompt: list[int], max_new_tokens: int, consume: Callable[..., Awaitable[T]]
) -> tuple[str, T]:
    """Run ``consume(stream)`` on one PD request made under a root span ``test.request``
    (leaving the stream when it returns); the trace id (hex) and what it returned."""
    prefill_proc, decode_proc, _ = mesh
    channels = [channel(prefill_proc.address), channel(decode_proc.address)]
    prefill = prefill_pb2_grpc.PrefillStub(channels[0])
    decode = decode_pb2_grpc.DecodeStub(channels[1])
    sampling = generation_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    try:
        with telemetry.tracer().start_as_current_span("test.request") as root:
            stream = generate_pd(prefill, decode, rid, prompt, sampling, 60)
            async with contextlib.aclosing(stream):
                result = await consume(stream)
        return format(root.get_span_context().trace_id, "032x"), result
    finally:
        for ch in channels:
            await ch.close()


def settled_spans(receiver, trace_id: str, names: set[str]) -> list[SpanRecord]:
    """The trace once ``names`` arrived with no orphan, plus a second for stragglers (a span
    left open would show as its children's missing parent)."""
    receiver.wait_for(
        trace_id, lambda spans: {s.name for s in spans} >= names and not orphans(spans), 15
    )
    time.sleep(1.0)
    return receiver.spans(trace_id)


def complete(spans: list[SpanRecord]) -> bool:
    return (
        {s.name for s in spans} >= NAMED_SPANS
        and {s.service for s in spans} >= SERVICES
        and not orphans(spans)
    )


def only(spans: list[SpanRecord], name: str) -> SpanRecord:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} {name} spans"
    return found[0]


def test_one_request_is_one_trace(receiver, client_tracing, traced_mesh) -> None:
    async def all_tokens(stream) -> list[int]:
        return [t async for msg in stream for t in msg.token_ids]

    trace_id, tokens = asyncio.run(
        traced_request(traced_mesh, "traced-1", PROMPT, MAX_NEW_TOKENS, all_tokens)
    )
    assert len(tokens) == MAX_NEW_TOKENS

    spans = receiver.wait_for(trace_id, complete, timeout=15)
    names = {s.name for s in spans}
    assert names >= NAMED_SPANS, f"missing {NAMED_SPANS - names}"
    assert {s.service for s in spans} >= SERVICES
    assert not orphans(spans), [(s.service, s.name) for s in orphans(spans)]
    assert [s.name for s in roots(spans)] == ["test.request"]
    root = roots(spans)[0]
    assert root.service == "test-client"
    # Every span that names the request is in this one trace.
    tagged = {s.trace_id for s in receiver.spans() if s.attributes.get("dsmesh.request_id")}
    assert tagged == {trace_id}
    for s in spans:
        assert s.start_ns <= s.end_ns, s.name

    by_id = {s.span_id: s for s in spans}

    def parent(s: SpanRecord) -> SpanRecord:
        return by_id[s.parent_id]

    # Both PD calls leave the test under its root span; each service continues from them.
    prefill_call = [s for s in spans if s.name.endswith("Prefill/Prefill")]
    decode_call = [s for s in spans if s.name.endswith("Decode/Decode")]
    for calls in (prefill_call, decode_call):
        client, server = sorted(calls, key=lambda s: s.service != "test-client")
        assert (client.service, parent(client)) == ("test-client", root)
        assert parent(server) == client and server.service != "test-client"
    prefill_server = next(s for s in prefill_call if s.service == "prefill")
    decode_server = next(s for s in decode_call if s.service == "decode")

    # Prefill: queue, then one span per forward chunk covering the prompt, one write each.
    queue = only(spans, "prefill.queue")
    chunks = sorted((s for s in spans if s.name == "prefill.chunk"), key=lambda s: s.start_ns)
    writes = [s for s in spans if s.name == "kv.transfer"]
    assert parent(queue) == prefill_server
    assert queue.end_ns <= chunks[0].start_ns
    ranges = [
        (c.attributes["dsmesh.chunk.start"], c.attributes["dsmesh.chunk.end"]) for c in chunks
    ]
    assert ranges == [(0, 32), (32, 64), (64, 70)]
    assert [c.attributes["dsmesh.chunk.tokens"] for c in chunks] == [32, 32, 6]
    assert all(parent(c) == prefill_server for c in chunks + writes)
    # A write per chunk, each after its forward: pages 0-1, 2-3, then the half-filled 4.
    writes.sort(key=lambda w: w.attributes["dsmesh.kv.tokens_done"])
    assert [w.attributes["dsmesh.kv.tokens_done"] for w in writes] == [32, 64, 70]
    assert [w.attributes["dsmesh.kv.pages"] for w in writes] == [2, 2, 1]
    assert all(w.start_ns >= c.end_ns for w, c in zip(writes, chunks, strict=True))
    assert all(w.attributes["dsmesh.kv.segments"] >= 1 for w in writes)
    commit = only(spans, "kv.commit")
    assert commit.attributes["dsmesh.kv.bytes"] == sum(
        w.attributes["dsmesh.kv.bytes"] for w in writes
    )
    assert commit.attributes["dsmesh.kv.bytes"] > 0

    # kv-broker: the handoff span hangs under decode's Reserve and ends DONE.
    handoff = only(spans, "kv.handoff")
    assert handoff.service == "kv-broker"
    assert parent(handoff).name == "/dsmesh.v1.KVBroker/Reserve"
    assert handoff.attributes["dsmesh.handoff.state"] == "DONE"
    assert handoff.attributes["dsmesh.kv.bytes"] == commit.attributes["dsmesh.kv.bytes"]

    # Decode: waits for the KV (its broker calls under that span), then generates.
    wait_kv = only(spans, "decode.wait_kv")
    generate = only(spans, "decode.generate")
    assert parent(wait_kv) == decode_server and parent(generate) == decode_server
    assert wait_kv.attributes["dsmesh.handoff.state"] == "DONE"
    reserve_client = next(s for s in spans if s.name.endswith("Reserve") and s.service == "decode")
    assert parent(reserve_client) == wait_kv
    assert wait_kv.end_ns <= generate.start_ns
    assert generate.attributes["dsmesh.completion_tokens"] == MAX_NEW_TOKENS
    assert generate.attributes["dsmesh.finish_reason"] == "length"

    assert not [s.name for s in spans if s.status == STATUS_ERROR]
    for log in traced_mesh[2].iterdir():
        text = log.read_text()
        assert "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"


RPC_SPANS = {"/dsmesh.v1.Prefill/Prefill", "/dsmesh.v1.Decode/Decode"}


def test_client_leaving_mid_stream_keeps_the_trace_whole(receiver, client_tracing, traced_mesh):
    async def first_message(stream) -> None:
        async for _ in stream:
            return

    prompt = [(13 * i + 1) % 500 for i in range(40)]  # not PROMPT: no prefix-cache hit there
    trace_id, _ = asyncio.run(
        traced_request(traced_mesh, "traced-left", prompt, 200, first_message)
    )
    spans = settled_spans(receiver, trace_id, RPC_SPANS | {"test.request", "decode.generate"})
    assert not orphans(spans), [(s.service, s.name) for s in orphans(spans)]
    assert [s.name for s in roots(spans)] == ["test.request"]
    assert sum(s.name in RPC_SPANS for s in spans) == 4  # client and server, each call
    generate = only(spans, "decode.generate")
    assert generate.status == STATUS_ERROR
    assert generate.attributes["dsmesh.completion_tokens"] < 200


def test_request_cancelled_during_prefill_keeps_the_trace_whole(
    receiver, client_tracing, traced_mesh
):
    rid = "traced-cut"
    num_chunks = 60
    long_prompt = [(11 * i + 5) % 500 for i in range(num_chunks * MAX_BATCH_TOKENS)]

    def chunk_spans() -> list[SpanRecord]:
        spans = receiver.spans()
        return [
            s
            for s in spans
            if s.name == "prefill.chunk" and s.attributes["dsmesh.request_id"] == rid
        ]

    async def cancel_mid_prefill(stream) -> None:
        first = asyncio.ensure_future(anext(stream))  # starts both calls
        deadline = time.monotonic() + 20
        while not chunk_spans() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not first.done(), "decode answered before prefill ran"
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first

    trace_id, _ = asyncio.run(
        traced_request(traced_mesh, rid, long_prompt, 200, cancel_mid_prefill)
    )
    spans = settled_spans(receiver, trace_id, RPC_SPANS | {"test.request", "kv.handoff"})
    assert not orphans(spans), [(s.service, s.name) for s in orphans(spans)]
    assert [s.name for s in roots(spans)] == ["test.request"]
    handoff = only(spans, "kv.handoff")
    assert handoff.attributes["dsmesh.handoff.state"] in ("ABORTED", "FAILED")
    assert handoff.status == STATUS_ERROR
    assert 0 < len(chunk_spans()) < num_chunks, "cancelled mid-prefill"
    assert "decode.generate" not in {s.name for s in spans}
