"""The mesh across four hosts (network namespaces, tests/multihost/conftest.py): it serves
the offline engine's greedy tokens over REST, gRPC and the OpenAI route, registers the
addresses peers can dial, keeps serving with delay and loss on every link, and notices a
decode host that goes dark mid-stream within docs/RELIABILITY.md's bounds, leaking no page.

The tests run in file order on one mesh; the dead host comes last and leaves the mesh
serving again. Measured times print as ``MULTIHOST <scenario> <name>=<value>`` lines (``-s``).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dsmesh.cli.launcher import dsmesh_command, start_service
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.multihost.conftest import (
    DECODE_PORT,
    EP_MASTER_PORT,
    LIVENESS_GRACE_S,
    PREFILL_PORT,
    Mesh,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

# gRPC keepalive (dsmesh/runtime/grpc_server.py): a ping after 5 s without a frame from the
# peer, answered within 3 s, else the connection is closed. A silent peer is noticed within
# about 8 s; docs/RELIABILITY.md states 15 s, the bound the issue set.
STREAM_BOUND_S = 15.0
HANDOFF_BOUND_S = 15.0
# A KV write already in flight to the dark host holds the request's pages on prefill until the
# Mooncake transfer engine gives up on it (its TCP transport: 30 s without progress).
WRITE_STALL_BOUND_S = 35.0


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


def request(ids: list[int], max_new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        input_ids=ids, sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    )


async def grpc_streams(address: str, requests: list[pb.GenerateRequest]) -> list[list[int]]:
    async with channel(address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(req: pb.GenerateRequest) -> list[int]:
            tokens: list[int] = []
            async for msg in stub.Generate(req, timeout=120):
                tokens += msg.token_ids
            return tokens

        return await asyncio.gather(*(one(r) for r in requests))


@pytest.fixture(scope="module")
def offline(mesh: Mesh) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(mesh.model_dir), max_total_tokens=1 << 15))


def greedy(offline: LLMEngine, ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [r.output_ids for r in offline.generate(ids, params)]


def assert_pages_return_to_zero(mesh: Mesh, timeout_s: float = 10) -> None:
    for service in ("prefill", "decode"):
        load = wait_until(lambda s=service: mesh.pages_free(s), timeout_s)
        assert load, f"{service} still holds pages: {mesh.load(service)}\n{mesh.log_tails()}"


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


def test_delay_and_loss_on_every_link(mesh: Mesh, offline: LLMEngine) -> None:
    """100 ms one way between any two hosts and 1% of packets lost: 64 streams all complete
    with the same tokens."""
    if (reason := mesh.net.netem_unavailable_reason()) is not None:
        pytest.skip(reason)
    ids = prompts(64, salt=2)
    mesh.net.netem(delay_ms=100, loss_percent=1)
    try:
        start = time.monotonic()
        got = asyncio.run(grpc_streams(mesh.grpc_address, [request(p, 8) for p in ids]))
        report("netem_100ms_1pct", seconds_for_64=time.monotonic() - start)
    finally:
        mesh.net.netem()
    assert got == greedy(offline, ids, 8)
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


def test_decode_host_goes_dark_while_prefill_writes(mesh: Mesh) -> None:
    """Decode's cable is pulled while prefill still writes a long prompt's KV into its pages:
    the stream fails and the handoff ends within the bounds, prefill stops writing and holds
    no page (at once, or once a write in flight gives up); with the cable back, decode frees
    the reserved pages and serves again."""
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
                WRITE_STALL_BOUND_S,
            )
            handoff_released = time.monotonic() - dark
            assert_pages_return_to_zero_on(mesh, "prefill", WRITE_STALL_BOUND_S)
            prefill_free = time.monotonic() - dark
        finally:
            decode_host.link_up()
    back = time.monotonic()
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert stream_failed <= STREAM_BOUND_S
    assert ended, mesh.handoff(req.request_id)
    assert released, mesh.handoff(req.request_id)
    assert wait_until(lambda: mesh.attached(kb.ROLE_DECODE), 40), mesh.log_tails()
    assert_pages_return_to_zero(mesh, timeout_s=20)
    decode_free = time.monotonic() - back
    body = {"input_ids": [7, 8, 9], "sampling": {"max_new_tokens": 5, "ignore_eos": True}}
    assert wait_until(lambda: post(f"{mesh.http}/v1/generate", body, 10)[0] == 200, 30, 0.5)
    report(
        "decode_host_dark_while_writing",
        stream_failed_s=stream_failed,
        handoff_ended_s=handoff_ended,
        handoff_released_s=handoff_released,
        prefill_pages_free_s=prefill_free,
        decode_pages_free_after_link_up_s=decode_free,
    )


def test_an_ep_group_spans_two_hosts(mesh: Mesh, offline: LLMEngine) -> None:
    """Decode as one expert-parallel group of two ranks on two hosts (``--ep-nnodes 2``,
    gloo, redundant experts): node 0 offers its advertised host as the rendezvous, node 1 is
    told it; each rank registers its own host's address and serves the offline tokens."""
    mesh.services.pop("decode").stop()
    assert wait_until(lambda: mesh.attached(kb.ROLE_DECODE) is None, 10)
    node0, node1 = mesh.hosts["decode"], mesh.hosts["spare"]
    group = ("--ep-size", "2", "--ep-nnodes", "2", "--num-redundant-experts", "2")
    common = (
        *("decode", "--broker", mesh.broker, "--host", "0.0.0.0", "--port", str(DECODE_PORT)),
        *("--model", str(mesh.model_dir), "--drain-timeout", "1", *group),
        *("--ep-master-port", str(EP_MASTER_PORT)),
    )
    argv = {
        "decode": node0.command(dsmesh_command(*common, "--ep-node-rank", "0")),
        "decode-ep1": node1.command(
            dsmesh_command(*common, "--ep-node-rank", "1", "--ep-master-addr", node0.address)
        ),
    }
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # each node serves only once the group is whole
        started = {
            name: pool.submit(start_service, name, args, log_dir=mesh.log_dir, timeout=120)
            for name, args in argv.items()
        }
        for name, future in started.items():
            mesh.services[name] = future.result()
    report("ep_across_hosts", group_up_s=time.monotonic() - start)

    def ranks() -> list[kb.Instance] | None:
        found = [i for i in mesh.instances() if i.role == kb.ROLE_DECODE]
        return found if len(found) == 2 else None

    listed = wait_until(ranks, 30)
    assert listed, mesh.log_tails()
    assert sorted(i.grpc_address for i in listed) == sorted(
        f"{h.address}:{DECODE_PORT}" for h in (node0, node1)
    )
    ids = prompts(8, salt=4)
    got = asyncio.run(grpc_streams(mesh.grpc_address, [request(p, 6) for p in ids]))
    assert got == greedy(offline, ids, 6)
    assert_pages_return_to_zero(mesh)
    assert wait_until(lambda: mesh.pages_free("decode-ep1"), 10)


def assert_pages_return_to_zero_on(mesh: Mesh, service: str, timeout_s: float = 10) -> None:
    assert wait_until(lambda: mesh.pages_free(service), timeout_s), mesh.load(service)
