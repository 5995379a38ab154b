"""Decode's handoff as plain Python (dsmesh/decode_svc/handoff.py): every way a Decode call goes,
the
status it answers, and when its pages may be reused. No gRPC, no processes, an explicit clock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsmesh.decode_svc.handoff import (
    ROOM_POLL_S,
    DecodeHandoff,
    DecodeHandoffs,
    HandoffEnd,
    Phase,
    Release,
    broker_unreachable,
)
from dsmesh.instance.failures import CallFailed, Code
from dsmesh.v1 import kv_broker_pb2 as kb

WAIT_S = 2.0  # --reserve-wait
QUARANTINE_S = 5.0  # --release-quarantine

LAYOUT_MISMATCH = "KV layout mismatch: page_size prefill=16 decode=1"


def table() -> DecodeHandoffs:
    return DecodeHandoffs(WAIT_S, QUARANTINE_S)


def waiting(handoffs: DecodeHandoffs, rid: str = "r1", now: float = 0.0) -> DecodeHandoff:
    """A call registered with kv_broker, waiting for prefill's commit."""
    h = handoffs.open(rid, now)
    assert handoffs.first_in_line(h)
    h.reserved()
    handoffs.leave_line(h)
    h.registered()
    return h


def failure(fn, *args) -> CallFailed:
    with pytest.raises(CallFailed) as info:
        fn(*args)
    return info.value


def test_success_from_reservation_to_last_token() -> None:
    handoffs = table()
    h = handoffs.open("r1", now=10.0)
    assert h.phase is Phase.RESERVING and handoffs.num_in_line == 1 and "r1" in handoffs
    h.reserved()
    handoffs.leave_line(h)
    assert h.phase is Phase.REGISTERING and handoffs.num_in_line == 0
    h.registered()
    assert handoffs.num_waiting == 1
    done = HandoffEnd(kb.HANDOFF_DONE, first_token_id=42, prefill_instance_id="p1")
    assert h.ended(done) == 42
    assert h.phase is Phase.DECODING and handoffs.num_waiting == 0
    h.finished()
    assert h.call_ended(cancelled=False) is Release.NONE  # the engine freed the pages
    handoffs.close(h)
    assert "r1" not in handoffs


def test_an_id_is_taken_until_its_pages_are_back() -> None:
    handoffs = table()
    h = handoffs.open("r1", now=0.0)
    err = failure(handoffs.open, "r1", 1.0)
    assert (err.code, err.message) == (Code.ALREADY_EXISTS, "request r1 is already active")
    assert h.call_ended(cancelled=True) is Release.NOW
    assert "r1" in handoffs  # still taken while the pages are freed
    handoffs.close(h)
    assert handoffs.open("r1", now=2.0).request_id == "r1"


def test_the_line_for_pages_keeps_arrival_order_and_gives_up_after_the_wait() -> None:
    handoffs = table()
    first, second = handoffs.open("a", now=0.0), handoffs.open("b", now=0.5)
    assert handoffs.first_in_line(first) and not handoffs.first_in_line(second)
    assert handoffs.num_in_line == 2
    # the first finds no room: it polls, up to its own deadline
    assert handoffs.wait_for_room(first, "need 16 KV pages, 9 available", 0.0) == ROOM_POLL_S
    assert handoffs.wait_for_room(first, "need 16 KV pages, 9 available", 1.99) == pytest.approx(
        0.01
    )
    err = failure(handoffs.wait_for_room, first, "need 16 KV pages, 9 available", 2.0)
    assert err.code is Code.RESOURCE_EXHAUSTED
    assert err.message == "decode is full: need 16 KV pages, 9 available (waited 2 s)"
    assert first.call_ended(cancelled=False) is Release.NONE  # it took no page
    handoffs.close(first)
    assert handoffs.first_in_line(second)
    # behind others, a request waits for them, not for pages
    third = handoffs.open("c", now=1.0)
    err = failure(handoffs.wait_for_room, third, None, 3.0)
    assert err.message == (
        "decode is full: requests before it are still waiting for room (waited 2 s)"
    )


def test_cancelled_while_reserving_frees_what_the_engine_may_still_take() -> None:
    handoffs = table()
    h = handoffs.open("r1", now=0.0)
    assert h.call_ended(cancelled=True) is Release.NOW
    assert h.phase is Phase.ENDED and h.call_ended(cancelled=True) is Release.NOW


def test_a_request_the_engine_is_reserving_for_waits_for_its_answer_past_the_deadline() -> None:
    """The line's reservation is one engine command; a request in it that gave up at its
    deadline ended without freeing what the command then granted it (a leak CI caught)."""
    handoffs = table()
    h = handoffs.open("r1", now=0.0)
    h.reserving()
    assert handoffs.wait_for_room(h, None, now=WAIT_S + 1.0) == ROOM_POLL_S
    h.reserve_answered()  # the command stopped before it: no room
    err = failure(handoffs.wait_for_room, h, "need 16 KV pages, 9 available", WAIT_S + 1.0)
    assert err.code is Code.RESOURCE_EXHAUSTED


def test_a_request_the_engine_was_asked_to_reserve_for_frees_however_its_call_ends() -> None:
    handoffs = table()
    asked, never = handoffs.open("a", now=0.0), handoffs.open("b", now=0.0)
    asked.reserving()
    asked.reserve_answered()
    # gave up (RESOURCE_EXHAUSTED), not cancelled: the engine may still hold its pages
    assert asked.call_ended(cancelled=False) is Release.NOW
    assert never.call_ended(cancelled=False) is Release.NONE  # no command ever took any


@pytest.mark.parametrize("code", ["ALREADY_EXISTS", "INVALID_ARGUMENT"])
def test_broker_refusal_that_certainly_registered_nothing_frees_at_once(code: str) -> None:
    handoffs = table()
    h = handoffs.open("r1", now=0.0)
    h.reserved()
    err = h.refused(code, "request 'r1' already has a handoff (DONE)")
    assert err.code is Code[code]
    assert err.message == (
        "kv_broker refused the reservation: request 'r1' already has a handoff (DONE)"
    )
    # the handoff of that id may be a live duplicate's: ours to free, not to abort
    assert h.call_ended(cancelled=False) is Release.NOW


@pytest.mark.parametrize(
    ("code", "answered"),
    [
        ("ABORTED", Code.CANCELLED),  # aborted before the reservation
        ("UNAVAILABLE", Code.UNAVAILABLE),
        ("DEADLINE_EXCEEDED", Code.UNAVAILABLE),
        ("FAILED_PRECONDITION", Code.UNAVAILABLE),  # e.g. decode not attached
    ],
)
def test_broker_refusal_that_may_have_registered_aborts_first(code: str, answered: Code) -> None:
    h = table().open("r1", now=0.0)
    h.reserved()
    err = h.refused(code, "details")
    assert (err.code, err.message) == (answered, "kv_broker refused the reservation: details")
    assert h.call_ended(cancelled=False) is Release.ABORT_FIRST
    # the abort's answer decides: no prefill resolved it, so free at once
    unresolved = HandoffEnd(kb.HANDOFF_ABORTED, kb.CAUSE_CLIENT_ABORTED, prefill_released=True)
    assert h.after_abort(unresolved) is Release.NOW
    assert h.after_abort(None) is Release.NOW  # no answer, but the call was not cancelled
    resolved = HandoffEnd(kb.HANDOFF_ABORTED, kb.CAUSE_CLIENT_ABORTED, prefill_instance_id="p1")
    assert h.after_abort(resolved) is Release.AFTER_PREFILL


@pytest.mark.parametrize(
    ("end", "code", "message", "release"),
    [
        (
            HandoffEnd(
                kb.HANDOFF_FAILED,
                kb.CAUSE_LAYOUT_MISMATCH,
                LAYOUT_MISMATCH,
                prefill_instance_id="p1",
                prefill_released=True,
            ),
            Code.FAILED_PRECONDITION,
            f"KV handoff HANDOFF_FAILED: {LAYOUT_MISMATCH}",
            Release.NOW,
        ),
        (
            HandoffEnd(
                kb.HANDOFF_FAILED,
                kb.CAUSE_PREFILL_LOST,
                "prefill instance p1 is gone",
                prefill_instance_id="p1",
                prefill_released=True,
            ),
            Code.UNAVAILABLE,
            "KV handoff HANDOFF_FAILED: prefill instance p1 is gone",
            Release.NOW,
        ),
        (
            HandoffEnd(
                kb.HANDOFF_FAILED,
                kb.CAUSE_TRANSFER_FAILED,
                "KV transfer failed: peer gone",
                prefill_instance_id="p1",
            ),
            Code.UNAVAILABLE,
            "KV handoff HANDOFF_FAILED: KV transfer failed: peer gone",
            Release.AFTER_PREFILL,  # its other writes may still be landing
        ),
        (
            HandoffEnd(
                kb.HANDOFF_FAILED,
                kb.CAUSE_PREFILL_UNREACHABLE,
                "prefill unreachable: connection refused",
            ),
            Code.UNAVAILABLE,
            "KV handoff HANDOFF_FAILED: prefill unreachable: connection refused",
            Release.NOW,  # no prefill ever resolved it
        ),
        (
            HandoffEnd(
                kb.HANDOFF_TIMED_OUT,
                kb.CAUSE_TIMED_OUT,
                "handoff timed out after 30 s in RESERVED",
                prefill_released=True,
            ),
            Code.DEADLINE_EXCEEDED,
            "KV handoff HANDOFF_TIMED_OUT: handoff timed out after 30 s in RESERVED",
            Release.NOW,
        ),
        (
            HandoffEnd(
                kb.HANDOFF_ABORTED,
                kb.CAUSE_CLIENT_ABORTED,
                "request was aborted",
                prefill_instance_id="p1",
            ),
            Code.CANCELLED,
            "KV handoff HANDOFF_ABORTED: request was aborted",
            Release.AFTER_PREFILL,
        ),
        (
            HandoffEnd(kb.HANDOFF_FAILED, kb.CAUSE_UNSPECIFIED, ""),
            Code.UNAVAILABLE,
            "KV handoff HANDOFF_FAILED",
            Release.NOW,
        ),
    ],
    ids=[
        "layout-mismatch",
        "prefill-lost",
        "transfer-failed",
        "prefill-unreachable",
        "timed-out",
        "aborted",
        "no-cause",
    ],
)
def test_a_failed_handoff_answers_by_its_cause(
    end: HandoffEnd, code: Code, message: str, release: Release
) -> None:
    handoffs = table()
    h = waiting(handoffs)
    err = failure(h.ended, end)
    assert (err.code, err.message) == (code, message)
    assert h.phase is Phase.ENDED and handoffs.num_waiting == 0
    assert h.call_ended(cancelled=False) is release


def test_a_cause_decides_over_a_message_that_looks_like_another() -> None:
    h = waiting(table())
    end = HandoffEnd(kb.HANDOFF_FAILED, kb.CAUSE_TRANSFER_FAILED, "not a layout mismatch at all")
    assert failure(h.ended, end).code is Code.UNAVAILABLE


def test_broker_unreachable_while_waiting_waits_out_the_quarantine() -> None:
    h = waiting(table())
    end = broker_unreachable("UNAVAILABLE")
    err = failure(h.ended, end)
    assert (err.code, err.message) == (
        Code.UNAVAILABLE,
        "KV handoff HANDOFF_FAILED: kv_broker unreachable: UNAVAILABLE",
    )
    assert h.call_ended(cancelled=False) is Release.AFTER_PREFILL
    # no answer from the broker proves anything: the pages wait the whole quarantine
    assert h.keep_waiting(100.0, released=False)
    assert h.keep_waiting(104.9, released=False)
    assert not h.keep_waiting(105.0, released=False)


def test_release_wait_ends_when_prefill_released() -> None:
    h = waiting(table())
    failure(h.ended, HandoffEnd(kb.HANDOFF_FAILED, kb.CAUSE_TRANSFER_FAILED, "x", 0, 0, "p1"))
    assert h.keep_waiting(0.0, released=False)
    assert not h.keep_waiting(0.2, released=True)


@pytest.mark.parametrize("phase", ["registering", "waiting"])
def test_client_cancel_mid_handoff_aborts_and_keeps_pages_while_prefill_may_write(
    phase: str,
) -> None:
    h = table().open("r1", now=0.0)
    h.reserved()
    if phase == "waiting":
        h.registered()
    assert h.call_ended(cancelled=True) is Release.ABORT_FIRST
    # kv_broker unreachable: prefill may be writing, so the whole quarantine
    assert h.after_abort(None) is Release.QUARANTINE
    # the abort landed before any prefill resolved it: nothing can write
    assert (
        h.after_abort(
            HandoffEnd(kb.HANDOFF_ABORTED, kb.CAUSE_CLIENT_ABORTED, prefill_released=True)
        )
        is Release.NOW
    )
    # prefill resolved it and still writes: wait for its Release
    writing = HandoffEnd(kb.HANDOFF_ABORTED, kb.CAUSE_CLIENT_ABORTED, prefill_instance_id="p1")
    assert h.after_abort(writing) is Release.AFTER_PREFILL
    released = HandoffEnd(
        kb.HANDOFF_ABORTED, kb.CAUSE_CLIENT_ABORTED, prefill_instance_id="p1", prefill_released=True
    )
    assert h.after_abort(released) is Release.NOW
    # it committed just before the abort: DONE, prefill's writes have all landed
    done = HandoffEnd(kb.HANDOFF_DONE, first_token_id=1, prefill_instance_id="p1")
    assert h.after_abort(done) is Release.NOW


def test_an_error_mid_handoff_is_not_a_cancel() -> None:
    h = waiting(table())
    assert h.call_ended(cancelled=False) is Release.ABORT_FIRST
    assert h.after_abort(None) is Release.NOW  # the abort was not answered; nothing resolved
    writing = HandoffEnd(kb.HANDOFF_ABORTED, kb.CAUSE_CLIENT_ABORTED, prefill_instance_id="p1")
    assert h.after_abort(writing) is Release.AFTER_PREFILL


def test_client_cancel_while_decoding_frees_at_once() -> None:
    handoffs = table()
    h = waiting(handoffs)
    h.ended(HandoffEnd(kb.HANDOFF_DONE, first_token_id=7, prefill_instance_id="p1"))
    assert h.call_ended(cancelled=True) is Release.NOW  # DONE: prefill's writes all landed
    assert "r1" in handoffs


def test_steps_out_of_order_are_refused() -> None:
    h = table().open("r1", now=0.0)
    with pytest.raises(RuntimeError, match="r1: reserving, not waiting"):
        h.ended(HandoffEnd(kb.HANDOFF_DONE))
    with pytest.raises(RuntimeError, match="r1: reserving, not decoding"):
        h.finished()


def test_end_terminal_and_may_write() -> None:
    assert not HandoffEnd(kb.HANDOFF_RESERVED).terminal
    assert not HandoffEnd(kb.HANDOFF_TRANSFERRING).terminal
    assert HandoffEnd(kb.HANDOFF_DONE).terminal and HandoffEnd(kb.HANDOFF_TIMED_OUT).terminal
    assert HandoffEnd(kb.HANDOFF_FAILED, prefill_instance_id="p1").prefill_may_write
    assert not HandoffEnd(kb.HANDOFF_FAILED).prefill_may_write
    assert broker_unreachable("DEADLINE_EXCEEDED").prefill_may_write


def test_the_handoff_rules_import_no_grpc() -> None:
    code = (
        "import sys, dsmesh.decode_svc.handoff, dsmesh.prefill_svc.handoff, "
        "dsmesh.instance.failures; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "[]"
