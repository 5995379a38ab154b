"""Prefill skips the pages decode holds already (dsmesh/prefill_svc/handoff.py): it writes only the
pages after them, and a reservation that claims pages this prompt cannot share fails the
handoff as a prompt mismatch, before any byte moves. No gRPC, no processes."""

from __future__ import annotations

import pytest

from dsmesh.engine.kv.prefix_hashes import ROOT_HASH, page_hashes, prefix_name
from dsmesh.instance.failures import Code
from dsmesh.prefill_svc.handoff import Free, Notice, PrefillHandoff, same_prefix
from dsmesh.v1 import kv_broker_pb2 as kb

PAGE = 16
DECODE_PAGES = [40, 41, 7, 8, 9, 3]  # decode's reservation: 5 pages for 70 tokens, then room


def test_the_pages_decode_holds_are_never_sent() -> None:
    h = PrefillHandoff("r1", 70, PAGE)
    assert h.resolved(70, DECODE_PAGES, cached_pages=3) is None
    assert h.remote_pages == [40, 41, 7, 8, 9] and h.cached_pages == 3
    h.submit()
    # forwards of 20, 20 and 30 tokens: pages 0..2 are decode's already, 3 and 4 go
    assert list(h.pages_to_send(20)) == []
    assert list(h.pages_to_send(40)) == []
    assert list(h.pages_to_send(70)) == [3, 4]


def test_a_page_half_filled_past_the_cached_ones_is_sent_again() -> None:
    h = PrefillHandoff("r1", 70, PAGE)
    assert h.resolved(70, DECODE_PAGES, cached_pages=2) is None
    h.submit()
    assert list(h.pages_to_send(40)) == [2]  # tokens 32..39 of page 2
    assert list(h.pages_to_send(70)) == [2, 3, 4]


def test_prefill_starting_past_the_cached_pages_sends_from_its_own_start() -> None:
    """Prefill's own prefix cache served 48 tokens: its first output computed 48..70."""
    h = PrefillHandoff("r1", 70, PAGE)
    assert h.resolved(70, DECODE_PAGES, cached_pages=1) is None
    h.submit()
    assert list(h.pages_to_send(70)) == [1, 2, 3, 4]  # its cached pages 1, 2 go too


@pytest.mark.parametrize(
    ("cached_pages", "same_prefix", "message"),
    [
        (5, True, "decode holds 5 pages of this 70-token prompt; it must leave the last one"),
        (-1, True, "decode holds -1 pages of this 70-token prompt"),
        (2, False, "the 2 pages decode holds are not this prompt's prefix"),
    ],
)
def test_pages_decode_cannot_share_fail_the_handoff(
    cached_pages: int, same_prefix: bool, message: str
) -> None:
    h = PrefillHandoff("r1", 70, PAGE)
    stop = h.resolved(70, DECODE_PAGES, cached_pages, same_prefix)
    assert stop is not None and h.stopped
    assert (stop.notice, stop.cause, stop.free, stop.in_engine) == (
        Notice.FAIL,
        kb.CAUSE_PROMPT_MISMATCH,
        Free.RELEASE,  # nothing written
        False,
    )
    assert stop.error.code is Code.FAILED_PRECONDITION and message in stop.error.message


def test_the_prefix_name_is_the_chained_hash_of_the_held_pages() -> None:
    prompt = list(range(100, 170))
    assert prefix_name(prompt, 0, PAGE) == ROOT_HASH
    assert prefix_name(prompt, 3, PAGE) == page_hashes(prompt, PAGE)[2]
    assert prefix_name(prompt, 4, PAGE) == page_hashes(prompt[:64], PAGE)[-1]
    with pytest.raises(ValueError, match="70 tokens do not fill 5 pages"):
        prefix_name(prompt, 5, PAGE)
    # prefill compares decode's name with its own prompt's
    name = prefix_name(prompt, 3, PAGE)
    assert same_prefix(prompt, 3, name, PAGE)
    assert not same_prefix(prompt, 2, name, PAGE)
    assert not same_prefix(prompt, 5, name, PAGE)  # the prompt has not 5 pages
    assert same_prefix(prompt, 0, ROOT_HASH, PAGE)
    other = prompt[:40] + [1] + prompt[41:]  # differs in page 2
    assert same_prefix(other, 2, prefix_name(prompt, 2, PAGE), PAGE)
    assert not same_prefix(other, 3, name, PAGE)
