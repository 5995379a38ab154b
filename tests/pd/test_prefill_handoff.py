"""Prefill's handoff as plain Python (dsmesh/prefill_svc/handoff.py): admission, which of decode's
pages each forward's KV goes to, and every way a request stops (what kv_broker hears, what is
freed, what the call answers). No gRPC, no processes, an explicit clock."""

from __future__ import annotations

import pytest

from dsmesh.instance.failures import CallFailed, Code
from dsmesh.prefill_svc.handoff import (
    Free,
    Notice,
    Phase,
    PrefillHandoff,
    Stop,
    check_admission,
    commit_failed,
    may_be_duplicate,
    resolve_failed,
)
from dsmesh.v1 import kv_broker_pb2 as kb

PAGE = 16
DECODE_PAGES = [40, 41, 7, 8, 9, 3]  # decode's reservation: prompt pages, then room to decode


def at(phase: str, prompt_len: int = 70) -> PrefillHandoff:
    """A handoff moved to ``phase`` the way the servicer moves it."""
    h = PrefillHandoff("r1", prompt_len, PAGE)
    if phase == "resolving":
        return h
    assert h.resolved(prompt_len, DECODE_PAGES) is None
    if phase == "resolved":
        return h
    h.submit()
    if phase == "writing":
        return h
    h.prefilled(10.0)
    assert h.written()
    if phase == "written":
        return h
    h.committed(10.5)
    assert phase == "committed"
    return h


def stop_of(stop: Stop | None) -> tuple:
    assert stop is not None
    return stop.notice, stop.cause, stop.free, stop.in_engine, stop.error.code, stop.error.message


def test_admission_refuses_a_duplicate_and_work_past_the_queue_limit() -> None:
    check_admission("new", 100, {}, max_queued_tokens=50)  # alone, a large prompt is served
    check_admission("new", 20, {"a": 30}, max_queued_tokens=50)
    with pytest.raises(CallFailed) as err:
        check_admission("a", 1, {"a": 30}, max_queued_tokens=50)
    assert (err.value.code, err.value.message) == (
        Code.ALREADY_EXISTS,
        "request a is already active",
    )
    with pytest.raises(CallFailed) as err:
        check_admission("new", 21, {"a": 30}, max_queued_tokens=50)
    assert (err.value.code, err.value.message) == (
        Code.RESOURCE_EXHAUSTED,
        "prefill is full: 30 prompt tokens queued (limit 50); retry later",
    )


@pytest.mark.parametrize(
    ("code", "taken", "answered"),
    [
        ("UNAVAILABLE", False, Code.UNAVAILABLE),
        ("DEADLINE_EXCEEDED", False, Code.UNAVAILABLE),
        ("FAILED_PRECONDITION", True, Code.ALREADY_EXISTS),  # a duplicate, already prefilled
        ("FAILED_PRECONDITION", False, Code.FAILED_PRECONDITION),  # e.g. a layout mismatch
        ("NOT_FOUND", False, Code.NOT_FOUND),  # decode never reserved
        ("ABORTED", False, Code.ABORTED),  # aborted before prefill got to it
    ],
)
def test_a_refused_resolve_answers_by_its_code(code: str, taken: bool, answered: Code) -> None:
    err = resolve_failed(code, "no reservation for request 'r1' (waited 30000 ms)", taken)
    assert err.code is answered
    assert err.message == (
        "cannot resolve the KV handoff: no reservation for request 'r1' (waited 30000 ms)"
    )
    assert may_be_duplicate(code) == (code == "FAILED_PRECONDITION")


def test_success_writes_each_page_once_and_a_partial_page_again() -> None:
    h = PrefillHandoff("r1", 70, PAGE)
    assert h.resolved(70, DECODE_PAGES) is None
    assert h.phase is Phase.RESOLVED and h.remote_pages == [40, 41, 7, 8, 9]  # 5 pages of 70
    h.submit()
    assert h.phase is Phase.WRITING
    # forwards of 20, 20 and 30 tokens: the page each leaves half-filled goes again
    assert list(h.pages_to_send(20)) == [0, 1]
    assert list(h.pages_to_send(40)) == [1, 2]
    assert list(h.pages_to_send(0)) == []  # an output that computed nothing (computed=(0, 0))
    assert list(h.pages_to_send(70)) == [2, 3, 4]
    h.prefilled(100.0)
    assert h.written() and h.phase is Phase.WRITTEN
    assert h.committed(100.25) == pytest.approx(0.25)
    assert h.phase is Phase.COMMITTED and not h.stopped


def test_full_chunks_never_resend() -> None:
    h = at("writing", prompt_len=64)
    assert [list(h.pages_to_send(end)) for end in (32, 64)] == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("num_tokens", "pages"),
    [(60, DECODE_PAGES), (70, DECODE_PAGES[:4])],
    ids=["other-prompt", "too-few-pages"],
)
def test_a_reservation_for_another_prompt_fails_the_handoff(num_tokens: int, pages) -> None:
    h = PrefillHandoff("r1", 70, PAGE)
    stop = h.resolved(num_tokens, pages)
    message = (
        f"decode reserved {len(pages)} pages for {num_tokens} tokens; this prompt has 70 tokens"
    )
    assert stop_of(stop) == (
        Notice.FAIL,
        kb.CAUSE_PROMPT_MISMATCH,
        Free.RELEASE,  # nothing written: decode's pages go back at once
        False,
        Code.FAILED_PRECONDITION,
        message,
    )
    assert stop is not None and stop.reason == message and h.stopped
    with pytest.raises(CallFailed):
        h.submit()


@pytest.mark.parametrize(
    ("phase", "free", "in_engine"),
    [
        ("resolving", Free.NOTHING, False),
        ("resolved", Free.RELEASE, False),
        ("writing", Free.LANES, True),
        ("written", Free.LANES, True),
    ],
)
def test_client_cancel_aborts_the_handoff_and_frees_by_phase(
    phase: str, free: Free, in_engine: bool
) -> None:
    h = at(phase)
    stop = h.client_gone("prefill call cancelled by its client")
    assert stop_of(stop) == (
        Notice.ABORT,
        kb.CAUSE_CLIENT_ABORTED,
        free,
        in_engine,
        Code.ABORTED,
        "prefill call cancelled by its client",
    )
    assert h.stopped and h.client_gone("again") is None


def test_nothing_stops_a_committed_request() -> None:
    h = at("committed")
    assert h.client_gone("aborted by the client") is None
    assert h.broker_ended(kb.HANDOFF_ABORTED, kb.CAUSE_CLIENT_ABORTED, "x") is None
    assert h.fail(kb.CAUSE_TRANSFER_FAILED, "x") is None


@pytest.mark.parametrize(
    ("cause", "reason", "code"),
    [
        (kb.CAUSE_INVALID_REQUEST, "sampling.max_new_tokens: too large", Code.INVALID_ARGUMENT),
        (kb.CAUSE_TRANSFER_FAILED, "KV transfer failed: peer gone", Code.ABORTED),
        (kb.CAUSE_LAYOUT_MISMATCH, "KV transfer failed: KV layout mismatch: ...", Code.ABORTED),
        (kb.CAUSE_PREFILL_FAILED, "prefill failed: engine error", Code.ABORTED),
    ],
)
def test_a_failure_here_fails_the_handoff_with_its_cause(cause: int, reason: str, code: Code):
    h = at("writing")
    stop = h.fail(cause, reason)
    assert stop_of(stop) == (Notice.FAIL, cause, Free.LANES, True, code, reason)
    assert stop is not None and stop.reason == reason
    assert not h.written()  # the lane's final job after a stop commits nothing


@pytest.mark.parametrize(
    ("state", "cause", "message", "code", "text"),
    [
        (
            kb.HANDOFF_ABORTED,
            kb.CAUSE_CLIENT_ABORTED,
            "request was aborted",
            Code.CANCELLED,
            "KV handoff HANDOFF_ABORTED: request was aborted",
        ),
        (
            kb.HANDOFF_TIMED_OUT,
            kb.CAUSE_TIMED_OUT,
            "handoff timed out after 30 s in TRANSFERRING",
            Code.DEADLINE_EXCEEDED,
            "KV handoff HANDOFF_TIMED_OUT: handoff timed out after 30 s in TRANSFERRING",
        ),
        (
            kb.HANDOFF_FAILED,
            kb.CAUSE_DECODE_LOST,
            "decode instance d1 is gone",
            Code.UNAVAILABLE,
            "KV handoff HANDOFF_FAILED: decode instance d1 is gone",
        ),
        (
            kb.HANDOFF_FAILED,
            kb.CAUSE_PREFILL_UNREACHABLE,
            "prefill unreachable: x",
            Code.UNAVAILABLE,
            "KV handoff HANDOFF_FAILED: prefill unreachable: x",
        ),
    ],
    ids=["aborted", "timed-out", "decode-lost", "prefill-unreachable"],
)
def test_the_broker_ending_the_handoff_stops_the_writes(state, cause, message, code, text) -> None:
    h = at("writing")
    assert h.broker_ended(kb.HANDOFF_TRANSFERRING, kb.CAUSE_UNSPECIFIED, "") is None  # live
    stop = h.broker_ended(state, cause, message)
    assert stop_of(stop) == (Notice.NONE, cause, Free.LANES, True, code, text)


def test_the_broker_ending_a_written_handoff_drops_its_pages_before_the_commit() -> None:
    h = at("written")
    stop = h.broker_ended(kb.HANDOFF_ABORTED, kb.CAUSE_CLIENT_ABORTED, "request was aborted")
    assert stop_of(stop)[:4] == (Notice.NONE, kb.CAUSE_CLIENT_ABORTED, Free.LANES, True)
    # then the commit is refused: nothing is left to stop, the call answers the refusal
    refused = commit_failed("FAILED_PRECONDITION", "cannot commit request 'r1': handoff is ABORTED")
    assert stop_of(h.commit_refused(refused)) == (
        Notice.NONE,
        kb.CAUSE_UNSPECIFIED,
        Free.NOTHING,
        False,
        Code.ABORTED,
        "KV handoff could not be committed: cannot commit request 'r1': handoff is ABORTED",
    )


@pytest.mark.parametrize(
    ("code", "answered"), [("FAILED_PRECONDITION", Code.ABORTED), ("UNAVAILABLE", Code.UNAVAILABLE)]
)
def test_a_refused_commit_frees_everything_quietly(code: str, answered: Code) -> None:
    h = at("written")
    failure = commit_failed(code, "details")
    assert (failure.code, failure.message) == (
        answered,
        "KV handoff could not be committed: details",
    )
    assert stop_of(h.commit_refused(failure)) == (
        Notice.NONE,  # the handoff is over at the broker, or the broker is gone
        kb.CAUSE_UNSPECIFIED,
        Free.LANES,
        True,
        answered,
        "KV handoff could not be committed: details",
    )


@pytest.mark.parametrize(
    ("phase", "stops"),
    [
        ("resolving", False),  # fails through its Resolve call
        ("resolved", True),
        ("writing", True),
        ("written", False),  # fails at its commit
        ("committed", False),
    ],
)
def test_losing_the_broker_stops_the_handoffs_being_written(phase: str, stops: bool) -> None:
    h = at(phase)
    stop = h.broker_lost("kv_broker stream lost (UNAVAILABLE)")
    if not stops:
        assert stop is None and h.phase.value == phase
        return
    reason = "kv_broker stream lost (UNAVAILABLE); the KV handoff cannot complete"
    free, in_engine = (Free.RELEASE, False) if phase == "resolved" else (Free.LANES, True)
    assert stop_of(stop) == (
        Notice.NONE,
        kb.CAUSE_UNSPECIFIED,
        free,
        in_engine,
        Code.UNAVAILABLE,
        reason,
    )


def test_a_request_stopped_while_resolving_gives_the_reservation_back() -> None:
    h = PrefillHandoff("r1", 70, PAGE)
    first = h.client_gone("aborted by the client")
    assert first is not None and first.free is Free.NOTHING
    # Resolve answered after the stop: decode's pages are ours all the same
    stop = h.resolved(70, DECODE_PAGES)
    assert stop is not None
    assert (stop.notice, stop.free, stop.in_engine) == (Notice.NONE, Free.RELEASE, False)
    assert stop.error is first.error
    with pytest.raises(CallFailed) as err:
        h.submit()  # and the prompt never reaches the engine
    assert err.value is first.error


def test_a_request_stopped_while_waiting_for_transfer_room_never_reaches_the_engine() -> None:
    h = at("resolved")
    stop = h.broker_ended(kb.HANDOFF_TIMED_OUT, kb.CAUSE_TIMED_OUT, "late")
    assert stop is not None and stop.free is Free.RELEASE and not stop.in_engine
    with pytest.raises(CallFailed) as err:
        h.submit()
    assert err.value.code is Code.DEADLINE_EXCEEDED


def test_the_first_stop_wins() -> None:
    h = at("writing")
    first = h.fail(kb.CAUSE_TRANSFER_FAILED, "KV transfer failed: x")
    assert first is not None
    assert h.client_gone("aborted by the client") is None
    assert h.broker_ended(kb.HANDOFF_FAILED, kb.CAUSE_TRANSFER_FAILED, "x") is None
    assert h.broker_lost("lost") is None
    assert h.stop is first


def test_steps_out_of_order_are_refused() -> None:
    h = PrefillHandoff("r1", 70, PAGE)
    with pytest.raises(RuntimeError, match="r1: resolving, not resolved"):
        h.submit()
    assert not h.written()
    assert h.committed(5.0) == 0.0  # no forward recorded: nothing to attribute
