"""Faults on a real supervised mesh (docs/RELIABILITY.md, "Faults"): a client cancelling, a
duplicate request id, and SIGKILLed prefill, decode and kv_broker processes. Every request
in flight on a killed process moves on (the gateway migrates it) and completes, no KV page
leaks, and the mesh serves again without restarting the survivors.

Measured figures are printed (``pytest -s``) as ``RELIABILITY <scenario> <name>=<value>``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc
from tests.mesh import pid_alive, wait_until
from tests.reliability.fault_harness import (
    Mesh,
    Outcome,
    long_prompt,
    start_mesh,
    wait_mesh_idle,
)

FAIL_BOUND_S = 30.0  # the default --handoff-timeout: no request may take longer to fail


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with start_mesh(tmp_path_factory) as m:
        yield m


def report(scenario: str, **figures: float) -> None:
    for name, value in figures.items():
        print(f"RELIABILITY {scenario} {name}={value:.2f}")


def _states(mesh: Mesh, ids: list[str]) -> dict[str, int]:
    out = {}
    for rid in ids:
        status = mesh.handoff(rid)
        out[rid] = status.state if status is not None else 0
    return out


# ---- 4. client cancels a gRPC stream ----------------------------------------------------------


def test_grpc_cancel_mid_stream_frees_both_sides_within_a_second(mesh: Mesh) -> None:
    wait_mesh_idle(mesh, 60)
    svc = mesh.services()
    addresses = [(svc[n][0], n.split("-")[0]) for n in ("prefill-0", "decode-0", "decode-1")]

    # while decoding: the handoff is DONE, decode stops its request
    streaming = Outcome(mesh, "cancel-decoding", long_prompt(16), 3000)
    assert streaming.first_token.wait(30), streaming.details
    cancel_at = time.monotonic()
    streaming.call.cancel()
    assert streaming.wait(5) and streaming.code == grpc.StatusCode.CANCELLED
    assert wait_until(lambda: all(mesh.pages_idle(a, r) for a, r in addresses), 1.0, 0.02)
    decoding_freed = time.monotonic() - cancel_at

    # while prefill writes the KV: both sides stop, the handoff ends ABORTED
    prefilling = Outcome(mesh, "cancel-prefilling", long_prompt(3000, salt=1), 8)
    assert wait_until(
        lambda: (
            _states(mesh, ["cancel-prefilling"])["cancel-prefilling"] == kb.HANDOFF_TRANSFERRING
        ),
        30,
        0.01,
    )
    cancel_at = time.monotonic()
    prefilling.call.cancel()
    assert prefilling.wait(5) and prefilling.code == grpc.StatusCode.CANCELLED
    assert wait_until(lambda: all(mesh.pages_idle(a, r) for a, r in addresses), 1.0, 0.02), [
        mesh.load(a, r) for a, r in addresses
    ]
    prefilling_freed = time.monotonic() - cancel_at
    status = mesh.handoff("cancel-prefilling")
    assert status is not None and status.state == kb.HANDOFF_ABORTED, status
    assert status.prefill_released
    report(
        "grpc_cancel",
        decoding_pages_freed_s=decoding_freed,
        prefilling_pages_freed_s=prefilling_freed,
    )


# ---- 7. the same request id twice --------------------------------------------------------------


def test_a_request_id_is_never_decoded_twice(mesh: Mesh) -> None:
    wait_mesh_idle(mesh, 60)
    generated = "dsmesh_generated_tokens_total"
    before = mesh.metric(generated)

    # concurrently, over gRPC: one runs, the other is refused at once
    first = Outcome(mesh, "dup-1", long_prompt(2000, salt=2), 16)
    second = Outcome(mesh, "dup-1", long_prompt(2000, salt=2), 16)
    assert first.wait(60) and second.wait(60)
    codes = sorted([first.code, second.code], key=lambda c: c.value[0])
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.ALREADY_EXISTS], (
        first.code,
        first.details,
        second.code,
        second.details,
    )
    assert first.tokens + second.tokens == 16

    # concurrently, over REST: 200 and 409
    body = {"request_id": "dup-2", "input_ids": long_prompt(2000, salt=3)}
    body["sampling"] = {"max_new_tokens": 16, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: mesh.rest(body), range(2)))
    assert sorted(a[0] for a in answers) == [200, 409], answers

    # again once it finished: refused, both protocols
    again = Outcome(mesh, "dup-1", long_prompt(16), 4)
    assert again.wait(30) and again.code == grpc.StatusCode.ALREADY_EXISTS, again.details
    status, answer, _ = mesh.rest({**body, "input_ids": long_prompt(16)})
    assert status == 409 and answer["error"]["status"] == "ALREADY_EXISTS", answer

    # one decode per id: 16 tokens each, one DONE handoff each
    assert mesh.metric(generated) - before == 32
    for rid in ("dup-1", "dup-2"):
        handoff = mesh.handoff(rid)
        assert handoff is not None and handoff.state == kb.HANDOFF_DONE, handoff

    # kv_broker itself refuses a second reservation of the id
    decode_id = next(iter(mesh.instances(kb.ROLE_DECODE).values()))
    reserve = kb.ReserveRequest(
        request_id="dup-1",
        decode_instance_id=decode_id,
        layout=kb.KVLayout(dtype="float32", page_size=16, kv_dim=8, num_layers=1),
        pool=kb.RemotePool(transfer_session="x:1", base_ptr=0, num_pages=4, page_bytes=64),
        page_ids=[0],
        num_tokens=1,
    )
    with grpc.insecure_channel(mesh.broker) as ch:
        try:
            kb_grpc.KVBrokerStub(ch).Reserve(reserve, timeout=5)
            raise AssertionError("kv_broker reserved dup-1 twice")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.ALREADY_EXISTS, exc
    wait_mesh_idle(mesh, 30)


# ---- 1. prefill SIGKILLed while writing KV ------------------------------------------------------


def test_prefill_killed_mid_transfer(mesh: Mesh) -> None:
    wait_mesh_idle(mesh, 60)
    svc = mesh.services()
    prefill_pid = svc["prefill-0"][1]
    decodes = {n: svc[n] for n in ("decode-0", "decode-1")}
    ids = [f"pkill-{i}" for i in range(4)]
    calls = [Outcome(mesh, rid, long_prompt(3000, salt=10 + i), 8) for i, rid in enumerate(ids)]
    body = {"request_id": "pkill-rest", "input_ids": long_prompt(3000, salt=19)}
    body["sampling"] = {"max_new_tokens": 8, "ignore_eos": True}
    pool = ThreadPoolExecutor(1)
    rest = pool.submit(mesh.rest, body)
    pool.shutdown(wait=False)
    assert wait_until(lambda: kb.HANDOFF_TRANSFERRING in _states(mesh, ids).values(), 30, 0.01), (
        _states(mesh, ids)
    )
    killed_at = time.monotonic()
    os.kill(prefill_pid, signal.SIGKILL)

    # every request moves on: it waits for the restarted prefill and completes
    for call in calls:
        assert call.wait(FAIL_BOUND_S + 30), f"{call.request_id} hangs"
        assert (call.code, call.tokens) == (grpc.StatusCode.OK, 8), (call.code, call.details)
    worst = max(c.ended_at for c in calls) - killed_at
    status, answer, _ = rest.result(FAIL_BOUND_S)
    assert status == 200 and len(answer["token_ids"]) == 8, answer

    # decode frees every reserved page; the broker ended the first attempts' handoffs FAILED
    assert wait_until(lambda: all(mesh.pages_idle(a, "decode") for a, _ in decodes.values()), 30)
    freed = time.monotonic() - killed_at
    moved = [c for c in calls if mesh.handoff(c.request_id).state == kb.HANDOFF_FAILED]
    assert moved, "the kill came too late: every request had finished"
    for call in moved:
        assert mesh.handoff(call.request_id).prefill_released
    assert mesh.metric("dsmesh_requests_migrated_total") >= len(moved)

    # the supervisor restarts prefill; new requests succeed; decode kept running
    mesh.up.wait_for(r"prefill-0 restarted at \S+ \(pid \d+\), healthy", 60)
    assert mesh.generate_ok(timeout=60)
    recovered = time.monotonic() - killed_at
    assert mesh.services()["prefill-0"][1] != prefill_pid
    for name, (_, pid) in decodes.items():
        assert pid_alive(pid) and mesh.restarts(name) == 0
    wait_mesh_idle(mesh, 30)
    report(
        "prefill_kill",
        moved=len(moved),
        completed=len(calls),
        worst_done_s=worst,
        decode_pages_freed_s=freed,
        first_success_s=recovered,
    )


# ---- 2. decode SIGKILLed while streaming --------------------------------------------------------


def test_decode_killed_mid_stream(mesh: Mesh) -> None:
    wait_mesh_idle(mesh, 60)
    svc = mesh.services()
    prefill_addr, prefill_pid = svc["prefill-0"]
    victim_addr, victim_pid = svc["decode-0"]
    survivor_addr, survivor_pid = svc["decode-1"]
    victim_id = mesh.instances(kb.ROLE_DECODE)[victim_addr]
    prefill_restarts = mesh.restarts("prefill-0")
    # streaming requests on both decodes, and long prompts still being written
    calls = [Outcome(mesh, f"dkill-s{i}", long_prompt(16, salt=20 + i), 3000) for i in range(4)]
    calls += [Outcome(mesh, f"dkill-p{i}", long_prompt(3000, salt=30 + i), 8) for i in range(3)]
    ids = [c.request_id for c in calls]

    def victim_busy() -> bool:
        on_victim = [
            c
            for c in calls[:4]
            if (mesh.handoff(c.request_id) or kb.HandoffStatus()).decode_instance_id == victim_id
        ]
        return bool(on_victim) and all(c.first_token.is_set() for c in on_victim)

    assert wait_until(victim_busy, 30, 0.02), _states(mesh, ids)
    owners = {rid: (mesh.handoff(rid) or kb.HandoffStatus()).decode_instance_id for rid in ids}
    at_kill = {c.request_id: c.tokens for c in calls}
    killed_at = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)

    # in flight on the victim at the kill; a short one may already have finished
    # (ended_at is set once its stream ended, before the kill)
    on_victim = [
        c for c in calls if owners[c.request_id] == victim_id and not 0 < c.ended_at < killed_at
    ]
    for call in calls:  # the survivor's requests are not under test: make room at prefill
        if call not in on_victim:
            call.call.cancel()
    # a request routed now goes to the surviving decode
    assert mesh.generate_ok(timeout=10)
    rerouted = time.monotonic() - killed_at

    # the victim's streams go on elsewhere (they ask for 3000 tokens: cancelled once they
    # streamed more after the kill); its prompts still being written complete
    assert on_victim
    streams = [c for c in on_victim if c in calls[:4]]
    for call in streams:
        assert wait_until(lambda c=call: c.tokens >= at_kill[c.request_id] + 8, FAIL_BOUND_S), (
            call.request_id,
            call.code,
            call.details,
        )
        assert call.code is None, (call.code, call.details)  # still streaming
        call.call.cancel()
    for call in on_victim:
        assert call.wait(FAIL_BOUND_S), f"{call.request_id} hangs"
        if call not in streams:
            assert (call.code, call.tokens) == (grpc.StatusCode.OK, 8), (call.code, call.details)
    worst = max(c.ended_at for c in on_victim) - killed_at
    # prefill stopped writing to the dead decode and freed its pages
    assert wait_until(lambda: mesh.pages_idle(prefill_addr, "prefill"), 30)
    prefill_freed = time.monotonic() - killed_at
    for call in on_victim:
        status = mesh.handoff(call.request_id)
        assert status is not None and status.state != kb.HANDOFF_TRANSFERRING, status
        # released by prefill, or by kv_broker once it declares the decode gone (the handoff
        # may have ended ABORTED first: the gateway cancels prefill as soon as decode fails)
        assert wait_until(lambda rid=call.request_id: mesh.handoff(rid).prefill_released, 10), (
            mesh.handoff(call.request_id)
        )
    assert wait_until(lambda: mesh.pages_idle(survivor_addr, "decode"), 10)

    mesh.up.wait_for(r"decode-0 restarted at \S+ \(pid \d+\), healthy", 60)
    assert pid_alive(prefill_pid) and mesh.restarts("prefill-0") == prefill_restarts
    assert pid_alive(survivor_pid) and mesh.restarts("decode-1") == 0
    wait_mesh_idle(mesh, 30)
    report(
        "decode_kill",
        moved=len(on_victim),
        worst_done_s=worst,
        first_rerouted_success_s=rerouted,
        prefill_pages_freed_s=prefill_freed,
    )


# ---- 3. kv_broker SIGKILLed and restarted --------------------------------------------------------


def test_broker_restart(mesh: Mesh) -> None:
    wait_mesh_idle(mesh, 60)
    svc = mesh.services()
    broker_pid = svc["kv-broker"][1]
    instances = {n: svc[n] for n in ("prefill-0", "decode-0", "decode-1")}
    before = {role: mesh.instances(role) for role in (kb.ROLE_PREFILL, kb.ROLE_DECODE)}
    ids = [f"bkill-{i}" for i in range(3)]
    calls = [Outcome(mesh, rid, long_prompt(3000, salt=40 + i), 8) for i, rid in enumerate(ids)]
    assert wait_until(lambda: kb.HANDOFF_TRANSFERRING in _states(mesh, ids).values(), 30, 0.01)
    killed_at = time.monotonic()
    os.kill(broker_pid, signal.SIGKILL)

    # every request moves on: it waits for the restarted broker and completes
    for call in calls:
        assert call.wait(FAIL_BOUND_S + 30), f"{call.request_id} hangs"
        assert (call.code, call.tokens) == (grpc.StatusCode.OK, 8), (call.code, call.details)
    worst = max(c.ended_at for c in calls) - killed_at

    mesh.up.wait_for(rf"kv-broker restarted at {mesh.broker} \(pid \d+\), healthy", 30)
    assert wait_until(lambda: {r: mesh.instances(r) for r in before} == before, 30), (
        "instances did not re-attach with the same ids"
    )
    reattached = time.monotonic() - killed_at
    assert mesh.generate_ok(timeout=30)
    recovered = time.monotonic() - killed_at
    for name, (_, pid) in instances.items():
        assert pid_alive(pid) and mesh.services()[name][1] == pid, name
    wait_mesh_idle(mesh, 30)
    freed = time.monotonic() - killed_at
    report(
        "broker_kill",
        completed=len(calls),
        worst_done_s=worst,
        reattached_s=reattached,
        first_success_s=recovered,
        pages_freed_s=freed,
    )
