"""The KVBroker service over a real loopback grpc.aio server."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dsmesh.v1 import generation_pb2 as gen_pb
from dsmesh.v1 import kv_broker_pb2 as pb
from tests.kv_broker.conftest import (
    LAYOUT,
    POOL,
    TEST_CONFIG,
    WAIT_S,
    Broker,
    reserve_request,
    running_broker,
)
from tests.mesh import free_port

S = pb.HandoffState


async def rpc_error(awaitable) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(awaitable, WAIT_S)
    return info.value


def resolve_request(
    rid: str = "r1", prefill: str = "p1", wait_ms: int = 0, layout: pb.KVLayout = LAYOUT
) -> pb.ResolveRequest:
    return pb.ResolveRequest(
        request_id=rid, prefill_instance_id=prefill, layout=layout, wait_ms=wait_ms
    )


@pytest.mark.asyncio
async def test_happy_path_reserve_then_resolve(broker: Broker) -> None:
    decode, prefill = await broker.decode("d1"), await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    resolved = await broker.stub.Resolve(resolve_request("r1"))
    assert resolved.decode_instance_id == "d1"
    assert list(resolved.page_ids) == [3, 5, 7] and resolved.num_tokens == 10
    assert resolved.pool == POOL

    status = await broker.stub.Progress(
        pb.ProgressRequest(request_id="r1", tokens_written=8, bytes_written=3072)
    )
    assert status.state == S.HANDOFF_TRANSFERRING and status.bytes_written == 3072

    waiting = asyncio.ensure_future(
        broker.stub.Await(pb.AwaitRequest(request_id="r1", wait_ms=3000))
    )
    await asyncio.sleep(0.05)
    assert not waiting.done()  # Await blocks until the handoff is terminal
    done = await broker.stub.Commit(
        pb.CommitRequest(request_id="r1", first_token_id=42, bytes_written=4608)
    )
    assert done.state == S.HANDOFF_DONE and done.first_token_id == 42
    awaited = await asyncio.wait_for(waiting, WAIT_S)
    assert awaited.state == S.HANDOFF_DONE and awaited.first_token_id == 42
    assert awaited.decode_instance_id == "d1" and awaited.prefill_instance_id == "p1"
    assert awaited.bytes_written == 4608

    assert await decode.states(3) == [
        ("r1", S.HANDOFF_RESERVED),
        ("r1", S.HANDOFF_TRANSFERRING),
        ("r1", S.HANDOFF_DONE),
    ]
    assert await prefill.states(2) == [("r1", S.HANDOFF_TRANSFERRING), ("r1", S.HANDOFF_DONE)]
    decode.assert_no_event()
    got = await broker.stub.Get(pb.HandoffRequest(request_id="r1"))
    assert got == awaited


@pytest.mark.asyncio
async def test_resolve_waits_for_a_later_reservation(broker: Broker) -> None:
    decode, prefill = await broker.decode("d1"), await broker.prefill("p1")
    resolving = asyncio.ensure_future(broker.stub.Resolve(resolve_request("r1", wait_ms=3000)))
    await asyncio.sleep(0.05)
    assert not resolving.done()
    await broker.stub.Reserve(reserve_request("r1"))
    resolved = await asyncio.wait_for(resolving, WAIT_S)
    assert list(resolved.page_ids) == [3, 5, 7]
    await broker.stub.Commit(pb.CommitRequest(request_id="r1", first_token_id=7))
    assert await decode.states(3) == [
        ("r1", S.HANDOFF_RESERVED),
        ("r1", S.HANDOFF_TRANSFERRING),
        ("r1", S.HANDOFF_DONE),
    ]
    assert (await prefill.next_event()).state == S.HANDOFF_TRANSFERRING
    final = await broker.stub.Await(pb.AwaitRequest(request_id="r1", wait_ms=0))
    assert final.state == S.HANDOFF_DONE and final.first_token_id == 7


@pytest.mark.asyncio
async def test_the_first_tokens_logprobs_travel_to_decode_unread(broker: Broker) -> None:
    await broker.decode("d1")
    await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    await broker.stub.Resolve(resolve_request("r1"))
    logprobs = gen_pb.TokenLogprobs(
        token_id=7, logprob=-0.0, top=[gen_pb.TokenLogprob(token_id=7, logprob=-0.0)]
    )
    commit = pb.CommitRequest(request_id="r1", first_token_id=7, first_token_logprobs=logprobs)
    done = await broker.stub.Commit(commit)
    final = await broker.stub.Await(pb.AwaitRequest(request_id="r1", wait_ms=0))
    for status in (done, final):  # present even when every field is a default value
        assert status.HasField("first_token_logprobs")
        assert status.first_token_logprobs == logprobs
    await broker.stub.Reserve(reserve_request("r2"))
    await broker.stub.Resolve(resolve_request("r2"))
    plain = await broker.stub.Commit(pb.CommitRequest(request_id="r2", first_token_id=1))
    assert not plain.HasField("first_token_logprobs")


@pytest.mark.asyncio
async def test_prefills_draft_tokens_travel_to_decode_unread(broker: Broker) -> None:
    """Speculative decoding: the tokens prefill drafted after the first one reach decode
    with it, in order; a commit without drafts carries none."""
    await broker.decode("d1")
    await broker.prefill("p1")
    for rid, drafts in (("r1", [3, 0, 3]), ("r2", [])):
        await broker.stub.Reserve(reserve_request(rid))
        await broker.stub.Resolve(resolve_request(rid))
        commit = pb.CommitRequest(request_id=rid, first_token_id=7, draft_token_ids=drafts)
        done = await broker.stub.Commit(commit)
        final = await broker.stub.Await(pb.AwaitRequest(request_id=rid, wait_ms=0))
        for status in (done, final):
            assert list(status.draft_token_ids) == drafts
    # a negative draft token is refused, naming the field
    await broker.stub.Reserve(reserve_request("r3"))
    await broker.stub.Resolve(resolve_request("r3"))
    bad = pb.CommitRequest(request_id="r3", first_token_id=1, draft_token_ids=[2, -1])
    err = await rpc_error(broker.stub.Commit(bad))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_token_ids" in err.details()


@pytest.mark.asyncio
async def test_resolve_gives_up_after_wait_ms(broker: Broker) -> None:
    await broker.prefill("p1")
    loop = asyncio.get_running_loop()
    start = loop.time()
    err = await rpc_error(broker.stub.Resolve(resolve_request("r1", wait_ms=150)))
    assert 0.14 <= loop.time() - start < 1.0
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == "no reservation for request 'r1' (waited 150 ms)"


@pytest.mark.asyncio
async def test_await_returns_current_state_after_wait_ms(broker: Broker) -> None:
    await broker.decode("d1")
    await broker.stub.Reserve(reserve_request("r1"))
    status = await broker.stub.Await(pb.AwaitRequest(request_id="r1", wait_ms=100))
    assert status.state == S.HANDOFF_RESERVED
    err = await rpc_error(broker.stub.Await(pb.AwaitRequest(request_id="zz", wait_ms=100)))
    assert err.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.asyncio
async def test_layout_mismatch_is_refused_and_decode_sees_failed(broker: Broker) -> None:
    decode, prefill = await broker.decode("d1"), await broker.prefill("p1")
    decode_layout = pb.KVLayout(dtype="bfloat16", page_size=1, kv_dim=96, num_layers=2)
    await broker.stub.Reserve(
        reserve_request("r1", layout=decode_layout, page_ids=list(range(10)), num_tokens=10)
    )
    prefill_layout = pb.KVLayout(dtype="float32", page_size=16, kv_dim=96, num_layers=2)
    err = await rpc_error(broker.stub.Resolve(resolve_request("r1", layout=prefill_layout)))
    message = (
        "KV layout mismatch: dtype prefill=float32 decode=bfloat16; page_size prefill=16 decode=1"
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == message
    assert (await decode.next_event()).state == S.HANDOFF_RESERVED
    failed = await decode.next_event()
    assert (failed.state, failed.message) == (S.HANDOFF_FAILED, message)
    assert (await prefill.next_event()).state == S.HANDOFF_FAILED
    status = await broker.stub.Get(pb.HandoffRequest(request_id="r1"))
    assert status.state == S.HANDOFF_FAILED and status.prefill_instance_id == "p1"


@pytest.mark.asyncio
async def test_abort_before_reservation_refuses_late_reserve_and_resolve(broker: Broker) -> None:
    await broker.decode("d1")
    await broker.prefill("p1")
    status = await broker.stub.Abort(pb.HandoffRequest(request_id="r1"))
    assert status.state == S.HANDOFF_ABORTED and status.message == "request was aborted"
    err = await rpc_error(broker.stub.Reserve(reserve_request("r1")))
    assert err.code() == grpc.StatusCode.ABORTED and err.details() == "request 'r1' was aborted"
    err = await rpc_error(broker.stub.Resolve(resolve_request("r1", wait_ms=2000)))
    assert err.code() == grpc.StatusCode.ABORTED


@pytest.mark.asyncio
async def test_abort_of_a_waiting_resolve_wakes_it(broker: Broker) -> None:
    await broker.prefill("p1")
    resolving = asyncio.ensure_future(broker.stub.Resolve(resolve_request("r1", wait_ms=3000)))
    await asyncio.sleep(0.05)
    await broker.stub.Abort(pb.HandoffRequest(request_id="r1"))
    err = await rpc_error(resolving)
    assert err.code() == grpc.StatusCode.ABORTED


@pytest.mark.asyncio
async def test_abort_while_reserved(broker: Broker) -> None:
    decode = await broker.decode("d1")
    await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    awaiting = asyncio.ensure_future(
        broker.stub.Await(pb.AwaitRequest(request_id="r1", wait_ms=3000))
    )
    await broker.stub.Abort(pb.HandoffRequest(request_id="r1"))
    assert (await asyncio.wait_for(awaiting, WAIT_S)).state == S.HANDOFF_ABORTED
    assert await decode.states(2) == [("r1", S.HANDOFF_RESERVED), ("r1", S.HANDOFF_ABORTED)]
    err = await rpc_error(broker.stub.Resolve(resolve_request("r1")))
    assert err.code() == grpc.StatusCode.ABORTED
    assert "handoff is ABORTED" in err.details()


@pytest.mark.asyncio
async def test_abort_while_transferring_stops_the_writer(broker: Broker) -> None:
    decode, prefill = await broker.decode("d1"), await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    await broker.stub.Resolve(resolve_request("r1"))
    await broker.stub.Abort(pb.HandoffRequest(request_id="r1"))
    progress = await broker.stub.Progress(
        pb.ProgressRequest(request_id="r1", tokens_written=4, bytes_written=10)
    )
    assert progress.state == S.HANDOFF_ABORTED
    err = await rpc_error(broker.stub.Commit(pb.CommitRequest(request_id="r1", first_token_id=1)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "handoff is ABORTED" in err.details()
    assert (await decode.states(3))[-1] == ("r1", S.HANDOFF_ABORTED)
    assert await prefill.states(2) == [("r1", S.HANDOFF_TRANSFERRING), ("r1", S.HANDOFF_ABORTED)]
    again = await broker.stub.Abort(pb.HandoffRequest(request_id="r1"))
    assert again.state == S.HANDOFF_ABORTED
    await asyncio.sleep(0.05)
    prefill.assert_no_event()  # an idempotent abort changes nothing and tells nobody


@pytest.mark.asyncio
async def test_decode_learns_when_prefill_released_its_pages(broker: Broker) -> None:
    decode, prefill = await broker.decode("d1"), await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    await broker.stub.Resolve(resolve_request("r1"))
    aborted = await broker.stub.Abort(pb.HandoffRequest(request_id="r1"))
    assert aborted.state == S.HANDOFF_ABORTED and not aborted.prefill_released
    events = [await decode.next_event() for _ in range(3)]
    assert events[-1].state == S.HANDOFF_ABORTED and not events[-1].prefill_released
    released = await broker.stub.Release(pb.HandoffRequest(request_id="r1"))
    assert released.state == S.HANDOFF_ABORTED and released.prefill_released
    event = await decode.next_event()
    assert (event.request_id, event.state, event.prefill_released) == (
        "r1",
        S.HANDOFF_ABORTED,
        True,
    )
    assert (await broker.stub.Get(pb.HandoffRequest(request_id="r1"))).prefill_released
    await broker.stub.Release(pb.HandoffRequest(request_id="r1"))  # idempotent, silent
    await asyncio.sleep(0.05)
    decode.assert_no_event()
    assert len([await prefill.next_event() for _ in range(3)]) == 3
    err = await rpc_error(broker.stub.Release(pb.HandoffRequest(request_id="zz")))
    assert err.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.asyncio
async def test_fail_reaches_the_other_side(broker: Broker) -> None:
    decode = await broker.decode("d1")
    await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    await broker.stub.Resolve(resolve_request("r1"))
    status = await broker.stub.Fail(pb.FailRequest(request_id="r1", reason="transfer error"))
    assert status.state == S.HANDOFF_FAILED
    failed = (await decode.states(3))[-1]
    assert failed == ("r1", S.HANDOFF_FAILED)


@pytest.mark.asyncio
async def test_the_cause_travels_in_statuses_and_events(broker: Broker) -> None:
    decode, prefill = await broker.decode("d1"), await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    await broker.stub.Resolve(resolve_request("r1"))
    fail = pb.FailRequest(request_id="r1", reason="KV transfer failed: boom")
    fail.cause = pb.CAUSE_TRANSFER_FAILED
    status = await broker.stub.Fail(fail)
    assert (status.state, status.cause, status.message) == (
        S.HANDOFF_FAILED,
        pb.CAUSE_TRANSFER_FAILED,
        "KV transfer failed: boom",
    )
    for side in (decode, prefill):
        events = [await side.next_event() for _ in range(3 if side is decode else 2)]
        assert (events[-1].state, events[-1].cause) == (S.HANDOFF_FAILED, pb.CAUSE_TRANSFER_FAILED)
    got = await broker.stub.Get(pb.HandoffRequest(request_id="r1"))
    assert got.cause == pb.CAUSE_TRANSFER_FAILED
    # a layout mismatch is told as such, through Await too
    await broker.stub.Reserve(reserve_request("r2"))
    mismatched = resolve_request("r2")
    mismatched.layout.page_size = 8
    err = await rpc_error(broker.stub.Resolve(mismatched))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    status = await broker.stub.Await(pb.AwaitRequest(request_id="r2"))
    assert (status.state, status.cause) == (S.HANDOFF_FAILED, pb.CAUSE_LAYOUT_MISMATCH)
    # an abort says the client went away
    await broker.stub.Reserve(reserve_request("r3"))
    aborted = await broker.stub.Abort(pb.HandoffRequest(request_id="r3"))
    assert (aborted.state, aborted.cause) == (S.HANDOFF_ABORTED, pb.CAUSE_CLIENT_ABORTED)


@pytest.mark.asyncio
async def test_fail_with_an_unknown_cause_is_invalid(broker: Broker) -> None:
    await broker.decode("d1")
    await broker.stub.Reserve(reserve_request("r1"))
    err = await rpc_error(broker.stub.Fail(pb.FailRequest(request_id="r1", reason="x", cause=99)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cause 99" in err.details()
    assert (await broker.stub.Get(pb.HandoffRequest(request_id="r1"))).state == S.HANDOFF_RESERVED


@pytest.mark.asyncio
async def test_timeout_notifies_both_sides(broker: Broker) -> None:
    decode, prefill = await broker.decode("d1"), await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1", timeout_ms=300))
    await broker.stub.Resolve(resolve_request("r1"))
    assert await decode.states(2) == [("r1", S.HANDOFF_RESERVED), ("r1", S.HANDOFF_TRANSFERRING)]
    assert (await prefill.next_event()).state == S.HANDOFF_TRANSFERRING
    for side in (decode, prefill):
        event = await side.next_event(timeout=1.0)
        assert event.state == S.HANDOFF_TIMED_OUT
        assert event.message == "handoff timed out after 0.3 s in TRANSFERRING"
    err = await rpc_error(broker.stub.Commit(pb.CommitRequest(request_id="r1", first_token_id=1)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "handoff is TIMED_OUT" in err.details()
    status = await broker.stub.Await(pb.AwaitRequest(request_id="r1"))
    assert status.state == S.HANDOFF_TIMED_OUT


@pytest.mark.asyncio
async def test_lost_prefill_fails_its_handoffs_after_the_grace(broker: Broker) -> None:
    decode, prefill = await broker.decode("d1"), await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    await broker.stub.Reserve(reserve_request("r2", page_ids=[9, 10, 11]))
    await broker.stub.Resolve(resolve_request("r1"))
    assert len(await decode.states(3)) == 3
    await prefill.close()  # the process died: its stream is gone
    loop = asyncio.get_running_loop()
    start = loop.time()
    event = await decode.next_event(timeout=2.0)
    assert loop.time() - start >= TEST_CONFIG.liveness_grace_s - 0.05
    assert (event.request_id, event.state) == ("r1", S.HANDOFF_FAILED)
    assert event.message == "prefill instance p1 is gone"
    assert event.prefill_released  # a gone prefill writes no more
    r2 = await broker.stub.Get(pb.HandoffRequest(request_id="r2"))
    assert r2.state == S.HANDOFF_RESERVED  # not resolved by p1: unaffected
    listed = await broker.stub.ListInstances(pb.ListInstancesRequest())
    assert [i.instance_id for i in listed.instances] == ["d1"]


@pytest.mark.asyncio
async def test_lost_decode_fails_its_reservations(broker: Broker) -> None:
    decode = await broker.decode("d1")
    await broker.stub.Reserve(reserve_request("r1"))
    await decode.close()
    status = await broker.stub.Await(pb.AwaitRequest(request_id="r1", wait_ms=2000))
    assert status.state == S.HANDOFF_FAILED and status.message == "decode instance d1 is gone"


@pytest.mark.asyncio
async def test_reattach_within_grace_keeps_handoffs_and_replays_events(broker: Broker) -> None:
    await broker.decode("d1")
    prefill = await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1"))
    await broker.stub.Resolve(resolve_request("r1"))
    assert (await prefill.next_event()).state == S.HANDOFF_TRANSFERRING
    await prefill.close()
    await broker.stub.Abort(pb.HandoffRequest(request_id="r1"))  # while p1 is away
    back = await broker.prefill("p1")
    event = await back.next_event()
    assert (event.request_id, event.state) == ("r1", S.HANDOFF_ABORTED)
    await broker.stub.Reserve(reserve_request("r2"))
    await broker.stub.Resolve(resolve_request("r2"))
    await asyncio.sleep(TEST_CONFIG.liveness_grace_s * 2)
    status = await broker.stub.Get(pb.HandoffRequest(request_id="r2"))
    assert status.state == S.HANDOFF_TRANSFERRING  # the re-attach cancelled the loss


@pytest.mark.asyncio
async def test_reattach_replaces_the_old_stream(broker: Broker) -> None:
    first = await broker.decode("d1")
    second = await broker.decode("d1")
    assert await first.ended() == grpc.StatusCode.OK
    await broker.stub.Reserve(reserve_request("r1"))
    assert (await second.next_event()).state == S.HANDOFF_RESERVED
    listed = await broker.stub.ListInstances(pb.ListInstancesRequest())
    assert len(listed.instances) == 1
    assert listed.instances[0].instance_id == "d1"
    assert listed.instances[0].role == pb.ROLE_DECODE
    assert listed.instances[0].transfer_session == "127.0.0.1:2"
    await asyncio.sleep(TEST_CONFIG.liveness_grace_s * 2)
    status = await broker.stub.Get(pb.HandoffRequest(request_id="r1"))
    assert status.state == S.HANDOFF_RESERVED  # the replaced stream did not count as a loss


@pytest.mark.asyncio
async def test_idle_stream_gets_heartbeats(broker: Broker) -> None:
    decode = await broker.decode("d1")
    loop = asyncio.get_running_loop()
    start = loop.time()
    for _ in range(2):
        decode.heartbeat.clear()
        await asyncio.wait_for(decode.heartbeat.wait(), WAIT_S)
    assert loop.time() - start >= TEST_CONFIG.heartbeat_interval_s * 1.5
    decode.assert_no_event()


@pytest.mark.asyncio
async def test_duplicate_request_id_is_already_exists(broker: Broker) -> None:
    await broker.decode("d1")
    await broker.stub.Reserve(reserve_request("r1"))
    err = await rpc_error(broker.stub.Reserve(reserve_request("r1", page_ids=[1, 2, 3])))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'r1'" in err.details()


@pytest.mark.asyncio
async def test_reserve_and_resolve_need_attached_instances(broker: Broker) -> None:
    err = await rpc_error(broker.stub.Reserve(reserve_request("r1", decode="d9")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "decode instance d9 is not attached"
    await broker.prefill("p1")
    err = await rpc_error(broker.stub.Reserve(reserve_request("r1", decode="p1")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "instance p1 is attached as prefill, not decode"
    err = await rpc_error(broker.stub.Resolve(resolve_request("r1", prefill="p9")))
    assert err.details() == "prefill instance p9 is not attached"


NO_LAYOUT = pb.ReserveRequest(
    request_id="r1", decode_instance_id="d1", pool=POOL, page_ids=[1], num_tokens=1
)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("method", "message", "field"),
    [
        ("Reserve", reserve_request(""), "request_id"),
        ("Reserve", reserve_request("r1", decode=""), "decode_instance_id"),
        ("Reserve", NO_LAYOUT, "layout is required"),
        ("Reserve", reserve_request(pool=None), "pool is required"),
        (
            "Reserve",
            reserve_request(layout=pb.KVLayout(dtype="f", kv_dim=1, num_layers=1)),
            "layout.page_size",
        ),
        ("Reserve", reserve_request(page_ids=[]), "page_ids"),
        ("Reserve", reserve_request(page_ids=[1, -1, 2]), "page_ids[1]"),
        ("Reserve", reserve_request(page_ids=[1, 2, 64]), "page_ids[2]"),
        ("Reserve", reserve_request(num_tokens=0), "num_tokens"),
        ("Reserve", reserve_request(num_tokens=13), "num_tokens=13"),
        ("Reserve", reserve_request(timeout_ms=-1), "timeout_ms"),
        ("Resolve", resolve_request(""), "request_id"),
        ("Resolve", resolve_request(prefill=""), "prefill_instance_id"),
        ("Resolve", resolve_request(wait_ms=-5), "wait_ms"),
        ("Resolve", pb.ResolveRequest(request_id="r1", prefill_instance_id="p1"), "layout"),
        ("Progress", pb.ProgressRequest(request_id=""), "request_id"),
        ("Commit", pb.CommitRequest(request_id="r1", first_token_id=-1), "first_token_id"),
        ("Fail", pb.FailRequest(), "request_id"),
        ("Abort", pb.HandoffRequest(), "request_id"),
        ("Get", pb.HandoffRequest(), "request_id"),
        ("Release", pb.HandoffRequest(), "request_id"),
        ("Await", pb.AwaitRequest(), "request_id"),
        ("Await", pb.AwaitRequest(request_id="r1", wait_ms=-1), "wait_ms"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    broker: Broker, method: str, message, field: str
) -> None:
    await broker.decode("d1")
    await broker.prefill("p1")
    err = await rpc_error(getattr(broker.stub, method)(message))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details()
    # the server is still fine
    await broker.stub.Reserve(reserve_request("ok"))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("instance", "field"),
    [
        (None, "instance is required"),
        (pb.Instance(role=pb.ROLE_DECODE), "instance.instance_id"),
        (pb.Instance(instance_id="x"), "instance.role"),
    ],
)
async def test_bad_attach_is_invalid_argument(broker: Broker, instance, field: str) -> None:
    call = broker.stub.Attach(pb.AttachRequest(instance=instance))
    err = await rpc_error(call.read())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()


@pytest.mark.asyncio
async def test_health_and_reflection(broker: Broker) -> None:
    health = health_pb2_grpc.HealthStub(broker.channel)
    for service in ("", "dsmesh.v1.KVBroker"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(broker.channel)
    call = refl.ServerReflectionInfo(timeout=WAIT_S)
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    names = {s.name for s in reply.list_services_response.service}
    assert "dsmesh.v1.KVBroker" in names and "grpc.health.v1.Health" in names


@pytest.mark.asyncio
async def test_stop_answers_waiting_calls_and_serve_returns_promptly() -> None:
    async with running_broker(dataclasses.replace(TEST_CONFIG, drain_timeout_s=0.0)) as b:
        decode = await b.decode("d1")
        await b.prefill("p1")
        await b.stub.Reserve(reserve_request("r1"))
        awaiting = asyncio.ensure_future(
            b.stub.Await(pb.AwaitRequest(request_id="r1", wait_ms=3000))
        )
        resolving = asyncio.ensure_future(b.stub.Resolve(resolve_request("r2", wait_ms=3000)))
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        start = loop.time()
        b.stop.set()
        assert await decode.ended() == grpc.StatusCode.OK
        assert (await asyncio.wait_for(awaiting, WAIT_S)).state == S.HANDOFF_RESERVED
        err = await rpc_error(resolving)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.wait_for(b.task, WAIT_S)
        assert loop.time() - start < 1.0  # well within the 2 s grace: nothing was left hanging


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("dsmesh_kv_"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.mark.asyncio
async def test_prometheus_metrics() -> None:
    port = free_port()
    async with running_broker(dataclasses.replace(TEST_CONFIG, metrics_port=port)) as b:
        await b.decode("d1")
        await b.prefill("p1")
        await b.stub.Reserve(reserve_request("r1"))
        await b.stub.Reserve(reserve_request("r2"))
        await b.stub.Resolve(resolve_request("r1"))
        await b.stub.Commit(pb.CommitRequest(request_id="r1", first_token_id=1))
        await b.stub.Abort(pb.HandoffRequest(request_id="r3"))
        await b.stub.Release(pb.HandoffRequest(request_id="r1"))  # no state entry
        m = await asyncio.to_thread(scrape, port)
    assert m['dsmesh_kv_handoffs_total{state="reserved"}'] == 2
    assert m['dsmesh_kv_handoffs_total{state="transferring"}'] == 1
    assert m['dsmesh_kv_handoffs_total{state="done"}'] == 1
    assert m['dsmesh_kv_handoffs_total{state="aborted"}'] == 1
    assert m['dsmesh_kv_handoffs_total{state="failed"}'] == 0
    assert m["dsmesh_kv_handoffs_active"] == 1
    assert m['dsmesh_kv_instances_attached{role="decode"}'] == 1
    assert m['dsmesh_kv_instances_attached{role="prefill"}'] == 1


@pytest.mark.asyncio
async def test_prefills_estimate_keeps_the_handoff_alive(broker: Broker) -> None:
    """A 0.3 s handoff whose prefill expects 0.4 s more lives past 0.3 s; a negative
    estimate is refused naming the field."""
    decode = await broker.decode("d1")
    await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1", timeout_ms=300))
    request = resolve_request("r1")
    request.expected_ms = 400
    await broker.stub.Resolve(request)
    await asyncio.sleep(0.5)
    status = await broker.stub.Get(pb.HandoffRequest(request_id="r1"))
    assert status.state == S.HANDOFF_TRANSFERRING
    err = await rpc_error(
        broker.stub.Progress(pb.ProgressRequest(request_id="r1", tokens_written=1, expected_ms=-1))
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected_ms" in err.details()
    assert await decode.states(3) == [
        ("r1", S.HANDOFF_RESERVED),
        ("r1", S.HANDOFF_TRANSFERRING),
        ("r1", S.HANDOFF_TIMED_OUT),  # 0.3 + 2 x 0.4 s after the resolve
    ]
    status = await broker.stub.Get(pb.HandoffRequest(request_id="r1"))
    assert status.message == (
        "handoff timed out after 1.1 s in TRANSFERRING (prefill expected to commit within 0.4 s)"
    )


@pytest.mark.asyncio
async def test_unified_instances_are_listed_but_take_no_handoff() -> None:
    """A unified instance attaches for discovery and liveness only."""
    port = free_port()
    async with running_broker(dataclasses.replace(TEST_CONFIG, metrics_port=port)) as b:
        await b.attach("u1", pb.ROLE_UNIFIED)
        listed = await b.stub.ListInstances(pb.ListInstancesRequest())
        m = await asyncio.to_thread(scrape, port)
        err = await rpc_error(b.stub.Reserve(reserve_request("r1", decode="u1")))
    assert [(i.instance_id, i.role) for i in listed.instances] == [("u1", pb.ROLE_UNIFIED)]
    assert listed.instances[0].grpc_address == "127.0.0.1:1"
    assert m['dsmesh_kv_instances_attached{role="unified"}'] == 1
    assert m['dsmesh_kv_instances_attached{role="decode"}'] == 0
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "attached as unified, not decode" in err.details()
