"""The pure handoff state machine: every transition and refusal, with an explicit clock."""

from __future__ import annotations

import pytest

from dsmesh.kv_broker.state import (
    ErrorCode,
    HandoffCause,
    HandoffError,
    HandoffState,
    HandoffTable,
    KVLayout,
    RemotePool,
)

LAYOUT = KVLayout(dtype="float32", page_size=4, kv_dim=96, num_layers=2, model="tiny-v3")
POOL = RemotePool(transfer_session="127.0.0.1:17000", base_ptr=4096, num_pages=8, page_bytes=1536)


def reserve(table: HandoffTable, rid: str = "r1", now: float = 0.0, **kw) -> object:
    args = dict(
        decode_instance_id="d1",
        layout=LAYOUT,
        pool=POOL,
        page_ids=[3, 5, 7],
        num_tokens=10,
    )
    args.update(kw)
    return table.reserve(rid, now=now, **args)


def transferring(table: HandoffTable, rid: str = "r1") -> None:
    reserve(table, rid)
    table.resolve(rid, "p1", LAYOUT, now=1.0)


def error(fn, *args, **kwargs) -> HandoffError:
    with pytest.raises(HandoffError) as info:
        fn(*args, **kwargs)
    return info.value


def test_reserve_creates_reserved_record_with_default_deadline() -> None:
    table = HandoffTable(default_timeout_s=30.0)
    t = reserve(table, now=100.0)
    assert t.old_state is None and t.new_state is HandoffState.RESERVED and t.changed
    assert t.party_ids == ("d1",)
    h = table.get("r1")
    assert h.page_ids == (3, 5, 7) and h.num_tokens == 10 and h.deadline == 130.0
    assert h.pool == POOL and h.layout == LAYOUT and h.prefill_instance_id == ""


def test_reserve_timeout_overrides_default() -> None:
    table = HandoffTable(default_timeout_s=30.0)
    reserve(table, now=10.0, timeout_s=0.5)
    assert table.get("r1").deadline == 10.5


@pytest.mark.parametrize(
    ("rid", "kw", "field"),
    [
        ("", {}, "request_id"),
        ("r1", {"decode_instance_id": ""}, "decode_instance_id"),
        ("r1", {"layout": KVLayout("", 4, 96, 2)}, "layout.dtype"),
        ("r1", {"layout": KVLayout("float32", 0, 96, 2)}, "layout.page_size"),
        ("r1", {"layout": KVLayout("float32", 4, -1, 2)}, "layout.kv_dim"),
        ("r1", {"layout": KVLayout("float32", 4, 96, 0)}, "layout.num_layers"),
        ("r1", {"pool": RemotePool("", 0, 8, 16)}, "pool.transfer_session"),
        ("r1", {"pool": RemotePool("h:1", 0, 0, 16)}, "pool.num_pages"),
        ("r1", {"pool": RemotePool("h:1", 0, 8, 0)}, "pool.page_bytes"),
        ("r1", {"num_tokens": 0}, "num_tokens"),
        ("r1", {"page_ids": []}, "page_ids must not be empty"),
        ("r1", {"page_ids": [1, -2, 3]}, "page_ids[1]=-2"),
        ("r1", {"page_ids": [1, 8, 3]}, "page_ids[1]=8 is outside the pool (0..7)"),
        ("r1", {"page_ids": [1, 2, 1]}, "page_ids[2]=1 repeats page_ids[0]"),
        ("r1", {"page_ids": [1, 2]}, "2 pages of 4 tokens cannot hold num_tokens=10"),
        ("r1", {"timeout_s": 0.0}, "timeout"),
    ],
)
def test_reserve_rejects_bad_input_naming_the_field(rid: str, kw: dict, field: str) -> None:
    table = HandoffTable()
    err = error(reserve, table, rid, **kw)
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert field in err.message
    assert len(table) == 0


def test_reserve_exactly_full_pages_is_fine() -> None:
    table = HandoffTable()
    reserve(table, page_ids=[0, 1], num_tokens=8)
    assert table.get("r1").state is HandoffState.RESERVED


def test_duplicate_reserve_is_already_exists() -> None:
    table = HandoffTable()
    reserve(table)
    err = error(reserve, table)
    assert err.code is ErrorCode.ALREADY_EXISTS and "RESERVED" in err.message
    transferring(table, "r2")
    table.commit("r2", 1, 0, now=2.0)
    assert error(reserve, table, "r2").code is ErrorCode.ALREADY_EXISTS


def test_resolve_moves_to_transferring_and_restarts_the_deadline() -> None:
    table = HandoffTable(default_timeout_s=30.0)
    reserve(table, now=0.0)
    t = table.resolve("r1", "p1", LAYOUT, now=5.0)
    assert (t.old_state, t.new_state) == (HandoffState.RESERVED, HandoffState.TRANSFERRING)
    assert t.party_ids == ("d1", "p1")
    h = table.get("r1")
    assert h.prefill_instance_id == "p1" and h.deadline == 35.0


def test_deadline_follows_prefills_estimate() -> None:
    table = HandoffTable(default_timeout_s=10.0)
    reserve(table, now=0.0)
    table.resolve("r1", "p1", LAYOUT, now=4.0, expected_s=50.0)  # a long queue ahead
    assert table.get("r1").deadline == 4.0 + 10.0 + 2 * 50.0
    assert table.expire(now=100.0) == []
    # each report keeps the deadline ahead of the rest of the work, never closer
    table.progress("r1", 4, 100, now=60.0, expected_s=30.0)
    assert table.get("r1").deadline == 130.0
    table.progress("r1", 8, 200, now=61.0, expected_s=1.0)
    assert table.get("r1").deadline == 130.0
    table.progress("r1", 8, 200)  # without a clock: progress only
    assert table.get("r1").deadline == 130.0
    (t,) = table.expire(now=130.0)
    assert t.new_state is HandoffState.TIMED_OUT
    assert t.handoff.message == (
        "handoff timed out after 70 s in TRANSFERRING (prefill expected to commit within 30 s)"
    )


def test_expected_time_must_not_be_negative() -> None:
    table = HandoffTable()
    reserve(table)
    err = error(table.resolve, "r1", "p1", LAYOUT, now=0.0, expected_s=-1.0)
    assert err.code is ErrorCode.INVALID_ARGUMENT and "expected time" in err.message
    err = error(table.resolve, "r1", "p1", LAYOUT, now=0.0, expected_s=float("nan"))
    assert err.code is ErrorCode.INVALID_ARGUMENT
    table.resolve("r1", "p1", LAYOUT, now=0.0)
    err = error(table.progress, "r1", 1, 1, now=1.0, expected_s=-0.5)
    assert err.code is ErrorCode.INVALID_ARGUMENT


def test_resolve_unknown_is_not_found() -> None:
    err = error(HandoffTable().resolve, "nope", "p1", LAYOUT, now=0.0)
    assert err.code is ErrorCode.NOT_FOUND and "'nope'" in err.message


def test_resolve_validates_input() -> None:
    table = HandoffTable()
    reserve(table)
    err = error(table.resolve, "r1", "", LAYOUT, now=0.0)
    assert err.code is ErrorCode.INVALID_ARGUMENT and "prefill_instance_id" in err.message
    err = error(table.resolve, "r1", "p1", KVLayout("float32", 4, 0, 2), now=0.0)
    assert err.code is ErrorCode.INVALID_ARGUMENT and "layout.kv_dim" in err.message
    err = error(table.resolve, "", "p1", LAYOUT, now=0.0)
    assert err.code is ErrorCode.INVALID_ARGUMENT and "request_id" in err.message
    assert table.get("r1").state is HandoffState.RESERVED


def test_layout_mismatch_fails_handoff_and_names_every_field() -> None:
    table = HandoffTable()
    reserve(
        table,
        layout=KVLayout("bfloat16", 1, 96, 2, "tiny-v3"),
        page_ids=[0, 1, 2, 3, 4, 5, 6, 7],
        num_tokens=8,
    )
    prefill = KVLayout("float32", 16, 96, 2, "tiny-v3")
    err = error(table.resolve, "r1", "p1", prefill, now=3.0)
    expected = (
        "KV layout mismatch: dtype prefill=float32 decode=bfloat16; page_size prefill=16 decode=1"
    )
    assert err.code is ErrorCode.FAILED_PRECONDITION
    assert err.message == expected
    (t,) = err.transitions
    assert (t.old_state, t.new_state) == (HandoffState.RESERVED, HandoffState.FAILED)
    assert t.party_ids == ("d1", "p1")
    h = table.get("r1")
    assert h.state is HandoffState.FAILED and h.message == expected and h.terminal_at == 3.0


def test_layout_mismatch_shows_empty_model_fingerprint() -> None:
    assert KVLayout("f", 1, 1, 1, "").mismatches(KVLayout("f", 1, 1, 1, "abc")) == [
        "model prefill='' decode=abc"
    ]


def test_resolve_twice_is_failed_precondition() -> None:
    table = HandoffTable()
    transferring(table)
    err = error(table.resolve, "r1", "p2", LAYOUT, now=2.0)
    assert err.code is ErrorCode.FAILED_PRECONDITION
    assert err.message == "cannot resolve request 'r1': handoff is TRANSFERRING, not RESERVED"


def test_progress_updates_only_while_transferring() -> None:
    table = HandoffTable()
    reserve(table)
    h = table.progress("r1", 4, 100)
    assert h.state is HandoffState.RESERVED and h.tokens_written == 0 and h.bytes_written == 0
    table.resolve("r1", "p1", LAYOUT, now=1.0)
    h = table.progress("r1", 8, 3072)
    assert (h.tokens_written, h.bytes_written) == (8, 3072)
    h = table.progress("r1", 4, 1536)  # a late report never moves progress back
    assert (h.tokens_written, h.bytes_written) == (8, 3072)
    table.abort("r1", now=2.0)
    h = table.progress("r1", 10, 9999)
    assert h.state is HandoffState.ABORTED and h.bytes_written == 3072


def test_progress_rejects_bad_numbers() -> None:
    table = HandoffTable()
    transferring(table)
    assert "tokens_written" in error(table.progress, "r1", -1, 0).message
    assert "bytes_written" in error(table.progress, "r1", 0, -5).message
    err = error(table.progress, "r1", 11, 0)
    assert err.code is ErrorCode.INVALID_ARGUMENT and "num_tokens=10" in err.message
    assert error(table.progress, "zz", 0, 0).code is ErrorCode.NOT_FOUND


def test_commit_moves_to_done_with_first_token() -> None:
    table = HandoffTable()
    transferring(table)
    table.progress("r1", 8, 3000)
    t = table.commit("r1", 0, 4608, now=7.0)
    assert (t.old_state, t.new_state) == (HandoffState.TRANSFERRING, HandoffState.DONE)
    h = table.get("r1")
    assert h.first_token_id == 0 and h.bytes_written == 4608 and h.tokens_written == 10
    assert h.terminal_at == 7.0 and h.message == ""
    assert table.active() == 0


@pytest.mark.parametrize(
    ("setup", "code", "text"),
    [
        ("reserved", ErrorCode.FAILED_PRECONDITION, "handoff is RESERVED, not TRANSFERRING"),
        ("done", ErrorCode.FAILED_PRECONDITION, "handoff is DONE, not TRANSFERRING"),
        ("failed", ErrorCode.FAILED_PRECONDITION, "handoff is FAILED (disk on fire)"),
        ("aborted", ErrorCode.FAILED_PRECONDITION, "handoff is ABORTED (request was aborted)"),
        ("timed_out", ErrorCode.FAILED_PRECONDITION, "handoff is TIMED_OUT (handoff timed out"),
    ],
)
def test_commit_outside_transferring_names_the_state(
    setup: str, code: ErrorCode, text: str
) -> None:
    table = HandoffTable(default_timeout_s=10.0)
    reserve(table)
    if setup != "reserved":
        table.resolve("r1", "p1", LAYOUT, now=1.0)
    if setup == "done":
        table.commit("r1", 5, 0, now=2.0)
    elif setup == "failed":
        table.fail("r1", "disk on fire", now=2.0)
    elif setup == "aborted":
        table.abort("r1", now=2.0)
    elif setup == "timed_out":
        table.expire(now=11.0)
    err = error(table.commit, "r1", 5, 0, now=3.0)
    assert err.code is code
    assert text in err.message and "cannot commit request 'r1'" in err.message


def test_commit_rejects_negative_token() -> None:
    table = HandoffTable()
    transferring(table)
    err = error(table.commit, "r1", -1, 0, now=2.0)
    assert err.code is ErrorCode.INVALID_ARGUMENT and "first_token_id" in err.message


def test_fail_is_terminal_and_idempotent() -> None:
    table = HandoffTable()
    transferring(table)
    t = table.fail("r1", "transfer engine error", now=2.0)
    assert (t.old_state, t.new_state) == (HandoffState.TRANSFERRING, HandoffState.FAILED)
    assert t.handoff.message == "transfer engine error"
    again = table.fail("r1", "other", now=3.0)
    assert not again.changed and again.handoff.message == "transfer engine error"
    assert again.handoff.terminal_at == 2.0
    assert table.abort("r1", now=4.0).new_state is HandoffState.FAILED
    reserve(table, "r2")
    assert table.fail("r2", "", now=1.0).handoff.message == "failed (no reason given)"
    assert error(table.fail, "", "x", now=0.0).code is ErrorCode.INVALID_ARGUMENT


def test_fail_before_reservation_leaves_a_failed_tombstone() -> None:
    """The gateway fails a request whose prefill it lost before decode reserved: the late
    reserve is refused (not as a duplicate), and decode's abort leaves the record FAILED."""
    table = HandoffTable()
    cause = HandoffCause.PREFILL_UNREACHABLE
    t = table.fail("r1", "prefill unreachable: Socket closed", now=1.0, cause=cause)
    assert t.old_state is None and t.new_state is HandoffState.FAILED and t.party_ids == ()
    h = table.get("r1")
    assert h.tombstone and (h.cause, h.prefill_released, h.terminal_at) == (cause, True, 1.0)
    err = error(reserve, table, "r1", now=2.0)
    assert err.code is ErrorCode.FAILED_PRECONDITION
    assert err.message == "request 'r1' failed: prefill unreachable: Socket closed"
    assert error(table.resolve, "r1", "p1", LAYOUT, now=2.0).code is ErrorCode.FAILED_PRECONDITION
    aborted = table.abort("r1", now=3.0)
    assert not aborted.changed and (aborted.new_state, aborted.handoff.cause) == (
        HandoffState.FAILED,
        cause,
    )
    assert not table.fail("r1", "again", now=4.0).changed
    assert table.gc(now=61.0) == ["r1"]
    reserve(table, "r1", now=62.0)  # the tombstone is gone: the id is free again


def test_abort_reserved_and_transferring() -> None:
    table = HandoffTable()
    reserve(table, "r1")
    transferring(table, "r2")
    t1 = table.abort("r1", now=2.0)
    t2 = table.abort("r2", now=2.0)
    assert (t1.old_state, t1.new_state) == (HandoffState.RESERVED, HandoffState.ABORTED)
    assert (t2.old_state, t2.new_state) == (HandoffState.TRANSFERRING, HandoffState.ABORTED)
    assert t2.party_ids == ("d1", "p1")
    assert not table.abort("r2", now=3.0).changed
    err = error(table.resolve, "r1", "p1", LAYOUT, now=3.0)
    assert err.code is ErrorCode.ABORTED and "ABORTED" in err.message


def test_abort_of_done_is_a_no_op() -> None:
    table = HandoffTable()
    transferring(table)
    table.commit("r1", 9, 0, now=2.0)
    t = table.abort("r1", now=3.0)
    assert not t.changed and t.new_state is HandoffState.DONE and t.handoff.first_token_id == 9


def test_abort_before_reservation_leaves_a_tombstone() -> None:
    table = HandoffTable()
    t = table.abort("r1", now=1.0)
    assert t.old_state is None and t.new_state is HandoffState.ABORTED and t.party_ids == ()
    assert table.get("r1").tombstone
    err = error(reserve, table, "r1", now=2.0)
    assert err.code is ErrorCode.ABORTED and err.message == "request 'r1' was aborted"
    err = error(table.resolve, "r1", "p1", LAYOUT, now=2.0)
    assert err.code is ErrorCode.ABORTED
    assert not table.abort("r1", now=3.0).changed
    assert table.active() == 0
    assert error(table.abort, "", now=0.0).code is ErrorCode.INVALID_ARGUMENT


def test_instance_lost_fails_live_handoffs_of_that_instance_only() -> None:
    table = HandoffTable()
    reserve(table, "a")  # decode d1, reserved
    transferring(table, "b")  # d1 + p1
    reserve(table, "c", decode_instance_id="d2")
    table.resolve("c", "p1", LAYOUT, now=1.0)  # d2 + p1
    transferring(table, "done")
    table.commit("done", 1, 0, now=1.0)
    lost = table.instance_lost("p1", now=5.0)
    assert sorted(t.handoff.request_id for t in lost) == ["b", "c"]
    assert {t.handoff.message for t in lost} == {"prefill instance p1 is gone"}
    assert all(t.new_state is HandoffState.FAILED for t in lost)
    assert table.get("a").state is HandoffState.RESERVED
    assert table.get("done").state is HandoffState.DONE
    (t,) = table.instance_lost("d1", now=6.0)
    assert t.handoff.request_id == "a" and t.handoff.message == "decode instance d1 is gone"
    assert table.instance_lost("d1", now=7.0) == []


def test_expire_times_out_live_handoffs_past_deadline() -> None:
    table = HandoffTable(default_timeout_s=10.0)
    reserve(table, "a", now=0.0)
    transferring(table, "b")  # reserved at 0, resolved at 1
    reserve(table, "c", now=5.0)
    transferring(table, "d")
    table.commit("d", 1, 0, now=2.0)
    assert table.expire(now=9.99) == []
    (t,) = table.expire(now=10.0)
    assert t.handoff.request_id == "a"
    assert t.handoff.message == "handoff timed out after 10 s in RESERVED"
    assert table.expire(now=10.99) == []
    (t,) = table.expire(now=11.0)
    assert t.handoff.request_id == "b"
    assert t.handoff.message == "handoff timed out after 10 s in TRANSFERRING"
    assert t.party_ids == ("d1", "p1")
    assert table.get("d").state is HandoffState.DONE
    assert [t.handoff.request_id for t in table.expire(now=15.0)] == ["c"]


def test_gc_drops_terminal_records_after_ttl() -> None:
    table = HandoffTable()
    transferring(table, "done")
    table.commit("done", 1, 0, now=10.0)
    table.abort("tomb", now=20.0)
    reserve(table, "live", now=0.0)
    assert table.gc(now=69.9, ttl_s=60.0) == []
    assert table.gc(now=70.0, ttl_s=60.0) == ["done"]
    assert table.gc(now=80.0, ttl_s=60.0) == ["tomb"]
    assert "live" in table and len(table) == 1
    reserve(table, "tomb", now=81.0)  # the tombstone is gone: the id is free again


def test_counts_and_active() -> None:
    table = HandoffTable()
    reserve(table, "a")
    transferring(table, "b")
    transferring(table, "c")
    table.commit("c", 1, 0, now=2.0)
    table.abort("d", now=2.0)
    counts = table.counts()
    assert counts == {
        HandoffState.RESERVED: 1,
        HandoffState.TRANSFERRING: 1,
        HandoffState.DONE: 1,
        HandoffState.FAILED: 0,
        HandoffState.ABORTED: 1,
        HandoffState.TIMED_OUT: 0,
    }
    assert table.active() == 2


def test_get_unknown_and_snapshots_are_copies() -> None:
    table = HandoffTable()
    assert error(table.get, "zz").code is ErrorCode.NOT_FOUND
    t = reserve(table)
    t.handoff.state = HandoffState.DONE
    assert table.get("r1").state is HandoffState.RESERVED


def test_state_values_match_the_proto() -> None:
    from dsmesh.v1 import kv_broker_pb2

    for state in HandoffState:
        assert kv_broker_pb2.HandoffState.Value(f"HANDOFF_{state.name}") == state.value
    assert [s for s in HandoffState if s.terminal] == [
        HandoffState.DONE,
        HandoffState.FAILED,
        HandoffState.ABORTED,
        HandoffState.TIMED_OUT,
    ]


def test_prefill_released_by_commit_mismatch_and_unresolved_end() -> None:
    table = HandoffTable()
    transferring(table, "done")
    assert not table.get("done").prefill_released  # prefill is writing
    assert table.commit("done", 1, 0, now=2.0).handoff.prefill_released
    reserve(table, "mismatch")
    err = error(table.resolve, "mismatch", "p1", KVLayout("bfloat16", 4, 96, 2, "tiny-v3"), 1.0)
    assert err.transitions[0].handoff.prefill_released  # refused before any write
    reserve(table, "unresolved")
    t = table.abort("unresolved", now=2.0)
    assert t.handoff.prefill_released and t.handoff.prefill_instance_id == ""
    assert table.abort("tomb", now=2.0).handoff.prefill_released


def test_abort_while_transferring_waits_for_release() -> None:
    table = HandoffTable()
    transferring(table)
    t = table.abort("r1", now=2.0)
    assert t.new_state is HandoffState.ABORTED and not t.handoff.prefill_released
    r = table.release("r1")
    assert r.changed and not r.state_changed
    assert (r.old_state, r.new_state) == (HandoffState.ABORTED, HandoffState.ABORTED)
    assert r.handoff.prefill_released and r.party_ids == ("d1", "p1")
    assert not table.release("r1").changed  # idempotent
    assert table.get("r1").prefill_released


def test_release_while_transferring_keeps_state() -> None:
    table = HandoffTable()
    transferring(table)
    r = table.release("r1")
    assert r.new_state is HandoffState.TRANSFERRING and r.handoff.prefill_released
    reserve(table, "r2")
    unresolved = table.release("r2")  # nobody resolved it: nothing to release
    assert not unresolved.changed and not unresolved.handoff.prefill_released
    assert error(table.release, "zz").code is ErrorCode.NOT_FOUND


def test_lost_prefill_releases_its_finished_handoffs() -> None:
    table = HandoffTable(default_timeout_s=10.0)
    transferring(table, "aborted")
    table.abort("aborted", now=2.0)
    transferring(table, "timed_out")
    table.expire(now=11.0)
    transferring(table, "released")
    table.fail("released", "x", now=2.0)
    table.release("released")
    out = table.instance_lost("p1", now=12.0)
    by_id = {t.handoff.request_id: t for t in out}
    assert sorted(by_id) == ["aborted", "timed_out"]
    for t in out:
        assert not t.state_changed and t.changed and t.handoff.prefill_released
    transferring(table, "live")
    (t,) = table.instance_lost("p1", now=13.0)
    assert t.new_state is HandoffState.FAILED and t.handoff.prefill_released


def test_lost_decode_does_not_release_prefill_writes() -> None:
    table = HandoffTable()
    transferring(table)
    (t,) = table.instance_lost("d1", now=2.0)
    assert t.new_state is HandoffState.FAILED and not t.handoff.prefill_released


# ---- causes: every way a handoff ends says why, beside its message ------------------------


def test_cause_values_match_the_proto() -> None:
    from dsmesh.v1 import kv_broker_pb2

    assert [c.name for c in HandoffCause] == [
        name.removeprefix("CAUSE_") for name, _ in kv_broker_pb2.HandoffCause.items()
    ]
    for cause in HandoffCause:
        assert kv_broker_pb2.HandoffCause.Value(f"CAUSE_{cause.name}") == cause.value


def test_live_and_done_handoffs_have_no_cause() -> None:
    table = HandoffTable()
    assert reserve(table).handoff.cause is HandoffCause.UNSPECIFIED
    t = table.resolve("r1", "p1", LAYOUT, now=1.0)
    assert t.handoff.cause is HandoffCause.UNSPECIFIED
    done = table.commit("r1", 5, 100, now=2.0).handoff
    assert (done.state, done.cause, done.message) == (
        HandoffState.DONE,
        HandoffCause.UNSPECIFIED,
        "",
    )


def test_layout_mismatch_cause() -> None:
    table = HandoffTable()
    reserve(table)
    err = error(table.resolve, "r1", "p1", KVLayout("float32", 8, 96, 2, "tiny-v3"), now=1.0)
    [t] = err.transitions
    assert (t.new_state, t.handoff.cause) == (HandoffState.FAILED, HandoffCause.LAYOUT_MISMATCH)
    assert table.get("r1").cause is HandoffCause.LAYOUT_MISMATCH
    assert t.handoff.message.startswith("KV layout mismatch: page_size prefill=8 decode=4")


def test_timeout_cause() -> None:
    table = HandoffTable(default_timeout_s=5.0)
    reserve(table, now=0.0)
    [t] = table.expire(now=5.0)
    assert (t.new_state, t.handoff.cause) == (HandoffState.TIMED_OUT, HandoffCause.TIMED_OUT)
    assert t.handoff.message == "handoff timed out after 5 s in RESERVED"


def test_abort_cause_and_the_tombstones() -> None:
    table = HandoffTable()
    transferring(table)
    t = table.abort("r1", now=2.0)
    assert (t.new_state, t.handoff.cause) == (HandoffState.ABORTED, HandoffCause.CLIENT_ABORTED)
    assert table.abort("r1", now=3.0).handoff.cause is HandoffCause.CLIENT_ABORTED  # unchanged
    tomb = table.abort("early", now=4.0).handoff
    assert (tomb.state, tomb.cause) == (HandoffState.ABORTED, HandoffCause.CLIENT_ABORTED)


def test_lost_instance_causes() -> None:
    table = HandoffTable()
    transferring(table, "by-prefill")  # prefill p1
    reserve(table, "by-decode", decode_instance_id="d2")
    [lost_p] = table.instance_lost("p1", now=2.0)
    [lost_d] = table.instance_lost("d2", now=2.0)
    assert (lost_p.handoff.request_id, lost_p.handoff.cause) == (
        "by-prefill",
        HandoffCause.PREFILL_LOST,
    )
    assert (lost_d.handoff.request_id, lost_d.handoff.cause) == (
        "by-decode",
        HandoffCause.DECODE_LOST,
    )
    assert lost_p.handoff.message == "prefill instance p1 is gone"
    assert lost_d.handoff.message == "decode instance d2 is gone"


@pytest.mark.parametrize(
    "cause",
    [
        HandoffCause.PROMPT_MISMATCH,
        HandoffCause.PREFILL_UNREACHABLE,
        HandoffCause.PREFILL_FAILED,
        HandoffCause.TRANSFER_FAILED,
        HandoffCause.INVALID_REQUEST,
        HandoffCause.LAYOUT_MISMATCH,
    ],
)
def test_fail_keeps_the_cause_it_is_given(cause: HandoffCause) -> None:
    table = HandoffTable()
    transferring(table)
    t = table.fail("r1", "it broke", now=2.0, cause=cause)
    assert (t.new_state, t.handoff.cause, t.handoff.message) == (
        HandoffState.FAILED,
        cause,
        "it broke",
    )


def test_fail_without_a_cause_and_after_the_end() -> None:
    table = HandoffTable()
    transferring(table)
    assert table.fail("r1", "", now=2.0).handoff.cause is HandoffCause.UNSPECIFIED
    table = HandoffTable()
    reserve(table, now=0.0, timeout_s=1.0)
    table.expire(now=1.0)
    late = table.fail("r1", "late", now=2.0, cause=HandoffCause.TRANSFER_FAILED)
    assert not late.changed  # the first end stands, with its cause
    assert (late.handoff.cause, late.handoff.message) == (
        HandoffCause.TIMED_OUT,
        "handoff timed out after 1 s in RESERVED",
    )
