"""The gateway's routing policy and admission queue, as pure state: no process, no network."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsmesh.gateway.admission import (
    AdmissionQueue,
    Ledger,
    MeshLoads,
    QueueFull,
    Ticket,
    TooLarge,
    Unroutable,
)
from dsmesh.gateway.registry import requests_held
from dsmesh.gateway.routing import (
    DecodeLoad,
    PrefillLoad,
    Target,
    choose_target,
    could_ever_fit,
    largest_pool_tokens,
)
from dsmesh.v1 import decode_pb2
from dsmesh.v1 import kv_broker_pb2 as kb

# ---- routing ---------------------------------------------------------------------------------


def test_target_is_the_roomiest_instance_that_fits_pair_or_unified() -> None:
    prefills = [PrefillLoad("p0", 0, 0)]
    decodes = [DecodeLoad("d0", 10, 100, 0, page_size=16)]  # 160 tokens free
    unifieds = [
        DecodeLoad("u0", 20, 100, 5, page_size=16),  # 320 tokens free
        DecodeLoad("u1", 20, 100, 2, page_size=16),  # same room, fewer running
    ]
    assert choose_target(prefills, decodes, unifieds, 10, 100) == Target("u1")
    # room is compared in tokens: 200 pages of 1 token hold less than 20 pages of 16
    assert choose_target(prefills, [DecodeLoad("d1", 200, 400, 0, 1)], unifieds, 10, 100) == (
        Target("u1")
    )
    # the unified instance has no room left: the pair takes it
    small = [DecodeLoad("u0", 2, 100, 0, 16)]
    assert choose_target(prefills, decodes, small, 10, 100) == Target("d0", "p0")
    # ties fall to the smallest id, whatever the order given
    tied = [DecodeLoad("u9", 5, 10, 0, 16), DecodeLoad("u3", 5, 10, 0, 16)]
    assert choose_target([], [], tied, 1, 16) == Target("u3")
    assert choose_target([], [], list(reversed(tied)), 1, 16) == Target("u3")


def test_a_decode_needs_a_prefill_with_room_for_the_prompt() -> None:
    decodes = [DecodeLoad("d0", 100, 100, 0, 16)]
    assert choose_target([], decodes, [], 10, 20) is None
    full = PrefillLoad("p0", 900, 3, max_queued_tokens=1000)
    assert choose_target([full], decodes, [], 100, 120) == Target("d0", "p0")
    assert choose_target([full], decodes, [], 101, 120) is None
    roomy = PrefillLoad("p1", 950, 9, max_queued_tokens=0)  # 0: bound unknown, no check
    assert choose_target([full, roomy], decodes, [], 500, 520) == Target("d0", "p1")
    # an idle prefill takes a prompt beyond its bound (else that prompt could never run)
    idle = PrefillLoad("p2", 0, 0, max_queued_tokens=1000)
    assert choose_target([idle], decodes, [], 1500, 1510) == Target("d0", "p2")
    # among prefills with room, the least loaded
    light = PrefillLoad("p3", 10, 1, max_queued_tokens=1000)
    assert choose_target([full, light], decodes, [], 50, 60) == Target("d0", "p3")


def test_nothing_fits_means_wait_and_never_fits_means_refuse() -> None:
    prefills = [PrefillLoad("p0", 0, 0)]
    decodes = [DecodeLoad("d0", 3, 64, 1, 16)]  # 48 tokens free of 1024
    unifieds = [DecodeLoad("u0", 1, 32, 1, 16)]  # 16 free of 512
    assert choose_target(prefills, decodes, unifieds, 40, 49) is None
    assert could_ever_fit(prefills, decodes, unifieds, 1024)
    assert not could_ever_fit(prefills, decodes, unifieds, 1025)
    assert largest_pool_tokens(prefills, decodes, unifieds) == 1024
    # without a prefill, decodes serve nothing
    assert not could_ever_fit([], decodes, unifieds, 600)
    assert largest_pool_tokens([], decodes, unifieds) == 512


# ---- the queue -------------------------------------------------------------------------------

PAGE = 16


def unified(free_pages: int, total_pages: int = 64, name: str = "u0") -> DecodeLoad:
    return DecodeLoad(name, free_pages, total_pages, 0, PAGE)


def loads(*unifieds: DecodeLoad, asked_at: float = 0.0, **more) -> MeshLoads:
    return MeshLoads(
        unifieds=unifieds,
        asked_at={u.instance_id: asked_at for u in (*unifieds, *more.get("decodes", ()))}
        | {p.instance_id: asked_at for p in more.get("prefills", ())},
        **more,
    )


def ticket(n: int, pages: int = 4, prompt: int = 10) -> Ticket:
    return Ticket(f"r{n}", prompt, pages * PAGE)


def test_requests_go_at_once_while_pages_last_then_wait_in_order() -> None:
    q = AdmissionQueue(max_inflight=100, max_queued=10)
    mesh = loads(unified(10))  # one report; nothing polled again in between
    prompt = 3 * PAGE  # charged its 3 prompt pages and one to grow into
    assert q.submit(ticket(0, prompt=prompt), mesh, 1.0) == Target("u0")
    assert q.submit(ticket(1, prompt=prompt), mesh, 1.0) == Target("u0")  # 8 of 10 charged
    assert q.submit(ticket(2, prompt=prompt), mesh, 1.0) is None  # 2 pages left: waits
    assert q.submit(ticket(3, pages=1), mesh, 1.0) is None  # fits, but nobody passes r2
    assert (q.num_dispatched, q.num_waiting) == (2, 2)
    assert q.pump(mesh, 1.1, route_wait_s=5).dispatched == []
    q.release("r0", 1.2)  # its 4 pages are free again, before any new report
    out = q.pump(mesh, 1.2, route_wait_s=5)
    assert [(t.request_id, tgt) for t, tgt in out.dispatched] == [
        ("r2", Target("u0")),
        ("r3", Target("u0")),
    ]
    assert (q.num_dispatched, q.num_waiting) == (3, 0)


def test_max_inflight_bounds_dispatched_requests_and_max_queued_the_waiting() -> None:
    q = AdmissionQueue(max_inflight=2, max_queued=3)
    mesh = loads(unified(1000, 1000))
    assert [q.submit(ticket(n), mesh, 0.0) for n in range(5)] == [Target("u0")] * 2 + [None] * 3
    with pytest.raises(QueueFull, match=r"the gateway queue is full \(3 requests waiting\)"):
        q.submit(ticket(5), mesh, 0.0)
    q.release("r3", 0.1)  # a waiting client went away: it leaves the queue
    assert q.submit(ticket(6), mesh, 0.1) is None
    q.release("r0", 0.2)
    assert [t.request_id for t, _ in q.pump(mesh, 0.2, 5).dispatched] == ["r2"]
    assert (q.num_dispatched, q.num_waiting) == (2, 2)
    # no queue at all: a request that cannot go at once is refused
    none = AdmissionQueue(max_inflight=1, max_queued=0)
    assert none.submit(ticket(0), mesh, 0.0) == Target("u0")
    with pytest.raises(QueueFull):
        none.submit(ticket(1), mesh, 0.0)


def test_a_request_an_instance_turned_away_goes_back_to_the_head_of_the_queue() -> None:
    """An instance refused a dispatched request for room (nothing ran): submitted again with
    ``first``, it goes ahead of the requests that came after it, even with the queue full."""
    q = AdmissionQueue(max_inflight=1, max_queued=2)
    mesh = loads(unified(1000, 1000))
    assert [q.submit(ticket(n), mesh, 0.0) for n in range(3)] == [Target("u0"), None, None]
    q.release("r0", 1.0, held=False)  # refused before it took pages
    assert q.submit(ticket(0), mesh, 1.0, first=True) == Target("u0")  # ahead of r1, r2
    assert q.num_waiting == 2
    # Refused again, and r1 took the slot meanwhile: r0 waits at the head, past max_queued.
    q.release("r0", 2.0, held=False)
    assert [t.request_id for t, _ in q.pump(mesh, 2.0, 5).dispatched] == ["r1"]
    assert q.submit(ticket(3), mesh, 2.0) is None  # the queue is full again: r2, r3
    assert q.submit(ticket(0), mesh, 2.0, first=True) is None
    assert q.num_waiting == 3
    with pytest.raises(QueueFull):
        q.submit(ticket(4), mesh, 2.0)  # a new request still meets the bound
    q.release("r1", 3.0)
    assert [t.request_id for t, _ in q.pump(mesh, 3.0, 5).dispatched] == ["r0"]


def test_a_request_no_instance_could_hold_is_refused_at_once() -> None:
    q = AdmissionQueue(max_inflight=8, max_queued=8)
    small, large = unified(0, 16, "u0"), unified(0, 64, "u1")
    with pytest.raises(TooLarge, match="needs KV for 1040 tokens but the largest instance holds"):
        q.submit(ticket(0, pages=65), loads(small, large), 0.0)
    assert q.submit(ticket(1, pages=60), loads(small, large), 0.0) is None  # waits for room
    # the large instance leaves: the waiting request can never run any more
    out = q.pump(loads(small), 1.0, route_wait_s=5)
    assert [(t.request_id, type(e)) for t, e in out.failed] == [("r1", TooLarge)]
    assert q.num_waiting == 0


def test_requests_wait_for_an_instance_then_fail_after_route_wait() -> None:
    q = AdmissionQueue(max_inflight=8, max_queued=8)
    empty = MeshLoads()
    assert q.submit(ticket(0), empty, 10.0) is None  # not refused: instances may come
    assert q.pump(empty, 12.0, route_wait_s=5).failed == []
    assert q.submit(ticket(1), empty, 13.0) is None
    out = q.pump(empty, 15.0, route_wait_s=5)
    assert [(t.request_id, type(e)) for t, e in out.failed] == [("r0", Unroutable)]
    out = q.pump(loads(unified(64)), 16.0, route_wait_s=5)  # an instance came: r1 goes
    assert [t.request_id for t, _ in out.dispatched] == ["r1"]
    # the wait counts from when the mesh became unroutable, not from the request's arrival
    assert q.submit(ticket(2, pages=100), loads(unified(0, 200)), 17.0) is None  # waits: full
    assert q.pump(empty, 30.0, route_wait_s=5).failed == []
    assert [t.request_id for t, _ in q.pump(empty, 35.0, route_wait_s=5).failed] == ["r2"]


def test_a_full_queue_with_no_instance_says_so_and_accepted_requests_pass_its_bound() -> None:
    """While no instance can serve (a role restarting) the queue fills with requests waiting
    for one: past its bound the refusal says so (the gateway answers UNAVAILABLE, not
    RESOURCE_EXHAUSTED). A request the gateway accepted earlier (migrated or re-queued)
    goes back at the head, past the bound."""
    q = AdmissionQueue(max_inflight=8, max_queued=2)
    empty = MeshLoads()
    assert q.submit(ticket(0), empty, 1.0) is None
    assert q.submit(ticket(1), empty, 1.0) is None
    with pytest.raises(QueueFull) as info:
        q.submit(ticket(2), empty, 1.0)
    assert info.value.unroutable and "no instance can serve" in str(info.value)
    assert q.submit(ticket(3), empty, 1.5, first=True) is None  # accepted before: no refusal
    assert q.num_waiting == 3
    out = q.pump(loads(unified(64)), 2.0, route_wait_s=600)  # the instance is back
    assert [t.request_id for t, _ in out.dispatched] == ["r3", "r0", "r1"]
    busy = AdmissionQueue(max_inflight=0, max_queued=0)
    with pytest.raises(QueueFull) as info:
        busy.submit(ticket(4), loads(unified(64)), 3.0)
    assert not info.value.unroutable  # instances exist: plain overload (429)


def test_pairs_charge_the_prefill_queue_until_prefill_answers() -> None:
    q = AdmissionQueue(max_inflight=8, max_queued=8)

    def mesh(waiting: int, running: int, asked_at: float) -> MeshLoads:
        return MeshLoads(
            prefills=(PrefillLoad("p0", waiting, running, max_queued_tokens=100),),
            decodes=(DecodeLoad("d0", 100, 100, 0, PAGE),),
            asked_at={"p0": asked_at, "d0": asked_at},
        )

    assert q.submit(Ticket("a", 60, 64), mesh(0, 0, 0.0), 1.0) == Target("d0", "p0")
    assert q.submit(Ticket("b", 60, 64), mesh(0, 0, 0.0), 1.0) is None  # 60 + 60 > 100
    q.started("a", 1.1)
    # prefill computed "a" and reports an empty queue, but "a" is still in it until prefill
    # answers (it commits the first token first): the gateway knows, so "b" still waits
    assert q.pump(mesh(0, 0, 1.5), 1.6, 5).dispatched == []
    q.prefilled("a")
    assert [t.request_id for t, _ in q.pump(mesh(0, 0, 1.5), 1.7, 5).dispatched] == ["b"]
    # a report of other gateways' work counts too
    q.submit(Ticket("c", 50, 64), mesh(0, 0, 1.5), 1.8)
    q.prefilled("b")
    assert q.pump(mesh(60, 1, 1.9), 2.0, 5).dispatched == []  # 60 + 50 > 100
    assert [t.request_id for t, _ in q.pump(mesh(40, 1, 2.1), 2.2, 5).dispatched] == ["c"]


# ---- the ledger ------------------------------------------------------------------------------


def test_ledger_counts_each_request_once_between_polls() -> None:
    ledger = Ledger()
    target = Target("u0")
    ledger.charge("a", target, 10, 4)
    report = loads(unified(60), asked_at=1.0)

    def free(r: MeshLoads) -> int:
        return ledger.corrected(r).unifieds[0].free_pages

    assert free(report) == 56  # charged, not started: no report has it yet
    ledger.started("a", 2.0)
    assert free(report) == 56  # asked for before it started
    assert free(loads(unified(56), asked_at=3.0)) == 56  # asked for after: already in it
    ledger.end("a", 4.0)
    assert free(loads(unified(56), asked_at=3.0)) == 60  # in that report, ended since
    assert free(loads(unified(60), asked_at=5.0)) == 60  # asked for after it ended
    ledger.prune({"u0": 3.0})
    assert len(ledger) == 1  # the report of 3.0 still counts it
    ledger.prune({"u0": 5.0})
    assert len(ledger) == 0


def test_a_refused_request_gives_back_nothing() -> None:
    ledger = Ledger()
    ledger.charge("a", Target("u0"), 10, 4)
    ledger.started("a", 1.0)
    ledger.end("a", 3.0, held=False)  # refused for lack of pages: it never held any
    report = loads(DecodeLoad("u0", 0, 64, 3, PAGE), asked_at=2.0)
    corrected = ledger.corrected(report).unifieds[0]
    assert (corrected.free_pages, corrected.running_requests) == (0, 3)
    ledger.charge("b", Target("u0"), 10, 4)
    ledger.end("b", 3.0)  # never started (its client left first): no report ever had it
    ledger.prune({"u0": 0.0})
    assert len(ledger) == 1


@st.composite
def histories(draw) -> list[tuple]:
    """Events on one instance, one per tick: ("go", pages) starts a request, ("end", n)
    ends the n-th, ("poll",) asks for a report. An instance takes a request's pages when its
    call arrives and frees them when it ends."""
    events: list[tuple] = []
    live: list[int] = []
    started = 0
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["go", "end", "poll"] if live else ["go", "poll"]))
        if kind == "go":
            events.append(("go", draw(st.integers(1, 4))))
            live.append(started)
            started += 1
        elif kind == "end":
            events.append(("end", live.pop(draw(st.integers(0, len(live) - 1)))))
        else:
            events.append(("poll",))
    return events


@given(histories())
def test_ledger_corrected_load_equals_the_true_load_at_every_moment(events) -> None:
    total = 64
    ledger = Ledger()
    held: dict[int, int] = {}  # request -> pages it holds on the instance now
    report = loads(unified(total, total), asked_at=0.0)
    started = 0
    for now, event in enumerate(events, start=1):
        if event[0] == "go":
            ledger.charge(f"r{started}", Target("u0"), 1, event[1])
            ledger.started(f"r{started}", now)
            held[started] = event[1]
            started += 1
        elif event[0] == "end":
            ledger.end(f"r{event[1]}", now)
            held.pop(event[1])
        else:
            report = loads(unified(total - sum(held.values()), total), asked_at=now)
            ledger.prune(report.asked_at)
        assert ledger.corrected(report).unifieds[0].free_pages == total - sum(held.values())
    ledger.prune({"u0": len(events) + 1.0})  # a report newer than every end
    assert len(ledger) == len(held)  # only live requests are remembered


def test_an_instance_without_a_free_slot_has_no_room() -> None:
    busy = DecodeLoad("u0", 100, 100, 8, PAGE, max_running_requests=8)
    assert choose_target([], [], [busy], 1, 16) is None
    q = AdmissionQueue(max_inflight=100, max_queued=10)
    mesh = loads(DecodeLoad("u0", 100, 100, 6, PAGE, max_running_requests=8))
    assert [q.submit(ticket(n, pages=1), mesh, 0.0) for n in range(3)] == [
        Target("u0"),
        Target("u0"),
        None,
    ]
    q.release("r0", 1.0)  # a slot is free again, before the next report
    assert [t.request_id for t, _ in q.pump(mesh, 1.0, 5).dispatched] == ["r2"]


def test_a_decode_counts_its_reserved_and_waiting_requests_as_slots_held() -> None:
    load = decode_pb2.DecodeLoad(running_requests=60, waiting_handoffs=4, max_running_requests=64)
    assert requests_held(kb.ROLE_DECODE, load) == 64  # reserved, awaiting KV: no slot left
    # a unified instance's running_requests counts its engine's queue already
    assert requests_held(kb.ROLE_UNIFIED, load) == 60


# ---- pages on demand ---------------------------------------------------------------------------


def test_a_request_is_charged_its_prompt_pages_and_one_more() -> None:
    d = DecodeLoad("d0", 100, 100, 0, PAGE)
    assert d.pages_to_admit(40, 4096) == 3 + 1  # not the 256 pages of its whole life
    assert d.pages_to_admit(40, 48) == 3  # never more than its whole life
    assert DecodeLoad("old", 100, 100, 0).pages_to_admit(40, 4096) == 1  # page size unknown


@pytest.mark.parametrize("pair", [False, True])
def test_omitted_max_tokens_runs_at_the_concurrency_of_the_prompts(pair: bool) -> None:
    """OpenAI's omitted max_tokens asks for the whole pool (dsmesh.gateway.core.room_to_generate):
    each such request is charged its prompt's pages, not the pool, so many go at once."""
    pool = DecodeLoad("d0", 64, 64, 0, PAGE)  # 1024 tokens
    if pair:
        mesh = MeshLoads(
            prefills=(PrefillLoad("p0", 0, 0),),
            decodes=(pool,),
            asked_at={"p0": 0.0, "d0": 0.0},
        )
    else:
        mesh = loads(pool)
    q = AdmissionQueue(max_inflight=100, max_queued=100)
    targets = [q.submit(Ticket(f"r{n}", 40, 1024), mesh, 0.0) for n in range(20)]
    went = [t for t in targets if t is not None]
    assert len(went) == 16  # 4 pages each of 64, where charging the whole pool lets 1 go
    assert all(t.instance_id == "d0" and (t.prefill_id == "p0") == pair for t in went)


def test_a_request_that_can_never_fit_names_the_field() -> None:
    q = AdmissionQueue(max_inflight=8, max_queued=8)
    mesh = loads(unified(0, 4))  # 64 tokens
    with pytest.raises(TooLarge) as info:
        q.submit(Ticket("prompt", 64, 64), mesh, 0.0)  # with its first new token: 65
    assert info.value.field == "input_ids"
    assert str(info.value) == (
        "the prompt has 64 tokens; with its first new token it needs KV for 65 tokens but "
        "the largest instance holds 64"
    )
    with pytest.raises(TooLarge) as info:
        q.submit(Ticket("long", 10, 65), mesh, 0.0)
    assert info.value.field == "sampling.max_new_tokens"
    assert q.submit(Ticket("fits", 63, 64), mesh, 0.0) is None  # waits for room
