"""The mesh across four hosts (network namespaces, tests/multihost/conftest.py): it serves
the offline engine's greedy tokens over REST, gRPC and the OpenAI route, registers the
addresses peers can dial, keeps one trace per request across the hosts, keeps serving with
delay and loss on every link, and notices a decode host that goes dark (mid-stream, and while
prefill writes into it) and a kv_broker host that is cut off, within docs/RELIABILITY.md's
bounds, leaking no page.

The tests run in file order on one mesh; each fault leaves the mesh serving again. Measured
times print as ``MULTIHOST <scenario> <name>=<value>`` lines (``-s``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dsmesh.engine.llm_engine import LLMEngine
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from tests.multihost.client import (
    HANDOFF_BOUND_S,
    STREAM_BOUND_S,
    assert_pages_return_to_zero,
    assert_pages_return_to_zero_on,
    greedy,
    grpc_streams,
    post,
    prompts,
    report,
    request,
    serves,
)
from tests.multihost.conftest import (
    DECODE_PORT,
    LIVENESS_GRACE_S,
    PREFILL_PORT,
    Mesh,
    wait_until,
)
from tests.telemetry.otlp_receiver import SpanRecord, orphans, roots

pytestmark = pytest.mark.timeout(300)
# decode frees a failed handoff's pages without kv_broker's word after this (its default)
RELEASE_QUARANTINE_S = 10.0
DECODING_TOKENS = 600  # 5-10 ms each: a stream still decoding when kv_broker's cable goes


def test_services_advertise_their_own_hosts(mesh: Mesh) -> None:
    """Bound to 0.0.0.0 with no --advertise-host, each advertises its namespace's address
    (its default route's), and kv_broker lists addresses on the other hosts."""
    for name, proc in mesh.services.items():
        assert proc.host == mesh.hosts[name].address, (name, proc.address)
    listed = {i.role: i for i in mesh.instances()}
    for role, name, port in (
        (kb.ROLE_PREFILL, "prefill", PREFILL_PORT),
        (kb.ROLE_DECODE, "decode", DECODE_PORT),
    ):
        address = mesh.hosts[name].address
        assert listed[role].grpc_address == f"{address}:{port}"
        assert listed[role].transfer_session.startswith(f"{address}:")  # Mooncake, TCP


def test_rest_grpc_and_openai_serve_offline_greedy_tokens(mesh: Mesh, offline: LLMEngine) -> None:
    rest_ids = prompts(8)
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda ids: post(
                    f"{mesh.http}/v1/generate",
                    {"input_ids": ids, "sampling": {"max_new_tokens": 6, "ignore_eos": True}},
                ),
                rest_ids,
            )
        )
    assert [status for status, _ in answers] == [200] * 8, answers
    assert [body["token_ids"] for _, body in answers] == greedy(offline, rest_ids, 6)

    grpc_ids = prompts(4, salt=1)
    got = asyncio.run(grpc_streams(mesh.grpc_address, [request(p, 9) for p in grpc_ids]))
    assert got == greedy(offline, grpc_ids, 9)

    tok = Tokenizer.from_dir(mesh.model_dir)
    status, body = post(
        f"{mesh.http}/v1/completions",
        {
            "model": mesh.model_dir.name,
            "prompt": "The quick brown fox",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    ref = greedy(offline, [tok.encode("The quick brown fox")], 8)[0]
    assert body["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    assert_pages_return_to_zero(mesh)


def test_one_request_is_one_trace_across_hosts(mesh: Mesh) -> None:
    """A REST request crosses four hosts and is one trace in the OTLP receiver: rooted at the
    gateway, spans from every service, no orphan; each server span of a call between the
    services names its caller's host (``net.peer.ip``), so the context crossed hosts."""
    rid = "traced-across-hosts"
    body = {"request_id": rid, "input_ids": [4, 5, 6], "sampling": {"max_new_tokens": 4}}
    assert post(f"{mesh.http}/v1/generate", body)[0] == 200

    def root_trace_id() -> str | None:
        found = [
            s.trace_id
            for s in mesh.receiver.spans()
            if s.name == "gateway.request" and s.attributes.get("dsmesh.request_id") == rid
        ]
        return found[0] if found else None

    trace_id = wait_until(root_trace_id, 15)
    assert trace_id, "no gateway.request span arrived"
    address = {name: host.address for name, host in mesh.hosts.items()}
    # (service, server span) -> the host that called it
    calls = {
        ("prefill", "/dsmesh.v1.Prefill/Prefill"): address["gateway"],
        ("decode", "/dsmesh.v1.Decode/Decode"): address["gateway"],
        ("kv-broker", "/dsmesh.v1.KVBroker/Reserve"): address["decode"],
        ("kv-broker", "/dsmesh.v1.KVBroker/Await"): address["decode"],
        ("kv-broker", "/dsmesh.v1.KVBroker/Resolve"): address["prefill"],
        ("kv-broker", "/dsmesh.v1.KVBroker/Commit"): address["prefill"],
    }

    def complete(spans: list[SpanRecord]) -> bool:
        names = {(s.service, s.name) for s in spans}
        return names >= set(calls) and "decode.generate" in {s.name for s in spans}

    spans = mesh.receiver.wait_for(trace_id, complete, 15)
    assert {s.service for s in spans} >= {"gateway", "prefill", "decode", "kv-broker"}
    assert not orphans(spans), [(s.service, s.name) for s in orphans(spans)]
    assert [(r.service, r.name) for r in roots(spans)] == [("gateway", "gateway.request")]
    callers = {
        (s.service, s.name): s.attributes.get("net.peer.ip")
        for s in spans
        if (s.service, s.name) in calls
    }
    assert callers == calls
    tagged = {
        s.trace_id for s in mesh.receiver.spans() if s.attributes.get("dsmesh.request_id") == rid
    }
    assert tagged == {trace_id}


def test_delay_and_loss_on_every_link(mesh: Mesh, offline: LLMEngine) -> None:
    """100 ms one way between any two hosts (the client's included) and 1% of packets lost,
    by ``tc netem`` or, without sch_netem, by the user-space TUN forwarder
    (tests/multihost/netns.py): 64 streams all complete with the no-fault tokens, none
    fails, and every KV page comes back."""
    ids = prompts(64, salt=2)
    with mesh.net.impair(delay_ms=100, loss_percent=1, seed=24) as how:
        start = time.monotonic()
        got = asyncio.run(grpc_streams(mesh.grpc_address, [request(p, 8) for p in ids]))
        seconds = time.monotonic() - start
    print(f"MULTIHOST delay_100ms_loss_1pct impaired_by={how!r}")
    report("delay_100ms_loss_1pct", seconds_for_64=seconds)
    assert got == greedy(offline, ids, 8)  # grpc_streams raises on any failed stream
    assert_pages_return_to_zero(mesh)


def test_decode_host_goes_dark_mid_stream(mesh: Mesh, offline: LLMEngine) -> None:
    """Decode's cable is pulled while it streams: the stream fails with UNAVAILABLE once
    keepalive notices, kv_broker declares decode lost, prefill holds no page. With the cable
    back, decode re-attaches, holds no page, and the mesh serves again."""
    decode_host = mesh.hosts["decode"]
    with grpc.insecure_channel(mesh.grpc_address) as ch:
        stream = generation_pb2_grpc.GenerationStub(ch).Generate(
            request(prompts(1, salt=3)[0], 3000), timeout=120
        )
        first = next(stream)
        assert first.token_ids
        decode_host.link_down()
        dark = time.monotonic()

        try:
            with pytest.raises(grpc.RpcError) as failed:
                for _ in stream:
                    pass
            stream_failed = time.monotonic() - dark
            lost = wait_until(lambda: mesh.attached(kb.ROLE_DECODE) is None, HANDOFF_BOUND_S + 5)
            decode_lost = time.monotonic() - dark
            assert_pages_return_to_zero_on(mesh, "prefill")
        finally:
            decode_host.link_up()
    back = time.monotonic()

    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert stream_failed <= STREAM_BOUND_S
    assert lost, "kv_broker still lists the dark decode"
    assert decode_lost <= HANDOFF_BOUND_S + LIVENESS_GRACE_S

    assert wait_until(lambda: mesh.attached(kb.ROLE_DECODE), 40), mesh.log_tails()
    reattached = time.monotonic() - back
    assert_pages_return_to_zero(mesh)
    body = {"input_ids": [7, 8, 9], "sampling": {"max_new_tokens": 5, "ignore_eos": True}}
    served = wait_until(lambda: post(f"{mesh.http}/v1/generate", body, 10)[0] == 200, 30, 0.5)
    serving = time.monotonic() - back
    assert served, mesh.log_tails()
    assert (
        post(f"{mesh.http}/v1/generate", body)[1]["token_ids"] == greedy(offline, [[7, 8, 9]], 5)[0]
    )
    report(
        "decode_host_dark",
        stream_failed_s=stream_failed,
        decode_lost_s=decode_lost,
        reattached_after_link_up_s=reattached,
        serving_after_link_up_s=serving,
    )


def test_decode_host_goes_dark_while_prefill_writes(mesh: Mesh, offline: LLMEngine) -> None:
    """Decode's cable is pulled while prefill still writes a long prompt's KV into its pages:
    the stream fails and the handoff ends within the bounds, prefill stops writing and holds
    no page, at once or, with a write in flight to the dark host, once the transfer engine
    gave it up (dsmesh/runtime/transfer/stall.py: 5 s without an acknowledgement, then 6 s
    to let its queued segments fail): the 15 s bound. With the cable back, decode frees the
    reserved pages and serves again."""
    decode_host = mesh.hosts["decode"]
    prompt = [5 + (i * 7) % 500 for i in range(3000)]  # about 100 chunks of 32
    req = pb.GenerateRequest(
        request_id="dark-while-writing",
        input_ids=prompt,
        sampling=pb.SamplingParams(max_new_tokens=4, ignore_eos=True),
    )
    with grpc.insecure_channel(mesh.grpc_address) as ch:
        stream = generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120)
        writing = wait_until(
            lambda: (
                (h := mesh.handoff(req.request_id)) is not None
                and h.state == kb.HANDOFF_TRANSFERRING
                and h.bytes_written > 0
            ),
            30,
            0.02,
        )
        assert writing, mesh.handoff(req.request_id)
        decode_host.link_down()
        dark = time.monotonic()
        try:
            with pytest.raises(grpc.RpcError) as failed:
                for _ in stream:
                    pass
            stream_failed = time.monotonic() - dark
            ended = wait_until(
                lambda: (
                    (h := mesh.handoff(req.request_id)) is not None
                    and h.state in (kb.HANDOFF_FAILED, kb.HANDOFF_ABORTED)
                ),
                HANDOFF_BOUND_S,
            )
            handoff_ended = time.monotonic() - dark
            released = wait_until(
                lambda: (h := mesh.handoff(req.request_id)) is not None and h.prefill_released,
                HANDOFF_BOUND_S,
            )
            handoff_released = time.monotonic() - dark
            assert_pages_return_to_zero_on(mesh, "prefill", HANDOFF_BOUND_S)
            prefill_free = time.monotonic() - dark
        finally:
            decode_host.link_up()
    back = time.monotonic()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert stream_failed <= STREAM_BOUND_S
    assert ended, mesh.handoff(req.request_id)
    assert released, mesh.handoff(req.request_id)  # prefill stopped writing, within 15 s
    assert wait_until(lambda: mesh.attached(kb.ROLE_DECODE), 40), mesh.log_tails()
    assert_pages_return_to_zero(mesh, timeout_s=20)
    decode_free = time.monotonic() - back
    assert serves(mesh, offline), mesh.log_tails()
    prefill_log = mesh.services["prefill"].log_path
    assert prefill_log is not None
    # the lane logs a write that failed: one was in flight to the dark host (else none was)
    in_flight = f"KV transfer for {req.request_id} failed" in prefill_log.read_text()
    report(
        "decode_host_dark_while_writing",
        write_in_flight_failed=float(in_flight),
        stream_failed_s=stream_failed,
        handoff_ended_s=handoff_ended,
        handoff_released_s=handoff_released,
        prefill_pages_free_s=prefill_free,
        decode_pages_free_after_link_up_s=decode_free,
    )


def test_kv_broker_host_is_partitioned_and_returns(mesh: Mesh, offline: LLMEngine) -> None:
    """kv_broker's cable is pulled while one request is still prefilling (a long prompt being
    written) and another decodes: the prefilling one fails with UNAVAILABLE naming the lost
    broker within the bound, prefill stops writing and frees at once, decode frees the pages
    it reserved after its quarantine (no broker to confirm prefill stopped); the decoding
    one needs no broker and completes with the offline tokens. With the cable back, prefill
    and decode re-attach, the handoff is FAILED in kv_broker's record, and the mesh serves."""
    broker_host = mesh.hosts["kv-broker"]
    outcomes: dict[str, tuple[str, str, float]] = {}  # name -> (code, details or tokens, when)
    decoding_ids = prompts(1, salt=5)[0]
    want = greedy(offline, [decoding_ids], DECODING_TOKENS)[0]  # before the clock starts
    started = threading.Event()

    def run(name: str, req: pb.GenerateRequest) -> None:
        tokens: list[int] = []
        try:
            with grpc.insecure_channel(mesh.grpc_address) as ch:
                for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120):
                    tokens += msg.token_ids
                    started.set()
            outcomes[name] = ("OK", str(tokens), time.monotonic())
        except grpc.RpcError as exc:
            outcomes[name] = (exc.code().name, exc.details() or "", time.monotonic())

    decoding = threading.Thread(
        target=run, args=("decoding", request(decoding_ids, DECODING_TOKENS))
    )
    decoding.start()
    assert started.wait(30), mesh.log_tails()
    long_prompt = [5 + (i * 11) % 500 for i in range(3000)]
    prefilling = threading.Thread(
        target=run, args=("prefilling", request(long_prompt, 4, "broker-dark-while-writing"))
    )
    prefilling.start()
    rid = "broker-dark-while-writing"
    assert wait_until(
        lambda: (h := mesh.handoff(rid)) is not None and h.bytes_written > 0, 30, 0.02
    ), mesh.handoff(rid)
    assert "decoding" not in outcomes, "the decoding request ended before the cable went"
    broker_host.link_down()
    dark = time.monotonic()
    try:
        prefilling.join(STREAM_BOUND_S + 5)
        assert "prefilling" in outcomes, "the prefilling request still runs"
        assert_pages_return_to_zero_on(mesh, "prefill", HANDOFF_BOUND_S)
        prefill_free = time.monotonic() - dark
        assert_pages_return_to_zero_on(mesh, "decode", RELEASE_QUARANTINE_S + HANDOFF_BOUND_S)
        decode_free = time.monotonic() - dark
        decoding.join(60)
    finally:
        broker_host.link_up()
    back = time.monotonic()

    code, details, when = outcomes["prefilling"]
    # "kv_broker stream lost ...; the KV handoff cannot complete", or the Commit that failed
    assert code == "UNAVAILABLE", details
    assert "kv_broker" in details or "handoff could not be committed" in details, details
    stream_failed = when - dark
    assert stream_failed <= STREAM_BOUND_S
    assert outcomes["decoding"][0] == "OK", outcomes["decoding"]
    assert outcomes["decoding"][1] == str(want)

    def both_attached() -> bool:
        roles = {i.role for i in mesh.instances()}
        return {kb.ROLE_PREFILL, kb.ROLE_DECODE} <= roles

    assert wait_until(both_attached, 40), mesh.log_tails()
    reattached = time.monotonic() - back
    status = mesh.handoff(rid)
    assert status is not None and status.state == kb.HANDOFF_FAILED, status
    assert serves(mesh, offline), mesh.log_tails()
    serving = time.monotonic() - back
    assert_pages_return_to_zero(mesh)
    report(
        "kv_broker_host_partitioned",
        stream_failed_s=stream_failed,
        prefill_pages_free_s=prefill_free,
        decode_pages_free_s=decode_free,
        reattached_after_link_up_s=reattached,
        serving_after_link_up_s=serving,
    )
