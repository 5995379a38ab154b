"""A reservation whose first pages decode holds already (its prefix cache): the table checks
the count, keeps it with the name of those pages, and hands both to prefill at Resolve."""

from __future__ import annotations

import pytest

from dsmesh.kv_broker.state import ErrorCode, HandoffError, HandoffState, HandoffTable
from dsmesh.v1 import kv_broker_pb2 as pb
from tests.kv_broker.conftest import LAYOUT as LAYOUT_PB
from tests.kv_broker.conftest import Broker, reserve_request
from tests.kv_broker.test_state import LAYOUT, reserve

# LAYOUT has 4 tokens per page; reserve() registers pages [3, 5, 7] for 10 prompt tokens.


def test_the_cached_pages_travel_from_reserve_to_resolve() -> None:
    table = HandoffTable()
    reserve(table, cached_pages=2, cached_prefix=-77)
    h = table.resolve("r1", "p1", LAYOUT, now=1.0).handoff
    assert (h.cached_pages, h.cached_prefix) == (2, -77)
    assert h.page_ids == (3, 5, 7)  # every page, in token order: prefill skips the first two
    assert h.state is HandoffState.TRANSFERRING
    plain = HandoffTable()
    reserve(plain)
    assert (plain.get("r1").cached_pages, plain.get("r1").cached_prefix) == (0, 0)


@pytest.mark.parametrize(
    ("kw", "text"),
    [
        # 3 pages of 4 hold tokens 0..11: prefill would write nothing of a 10-token prompt
        ({"cached_pages": 3, "cached_prefix": 5}, "cached_pages=3 of 4 tokens"),
        # 2 pages hold 8 tokens: a prompt of 8 would leave its last token unwritten
        ({"cached_pages": 2, "num_tokens": 8, "page_ids": [1, 2]}, "num_tokens=8"),
        ({"cached_pages": -1}, "cached_pages=-1"),
        ({"cached_prefix": 12}, "cached_prefix=12 names pages, but cached_pages is 0"),
    ],
)
def test_a_reservation_must_leave_prefill_the_last_page(kw: dict, text: str) -> None:
    table = HandoffTable()
    with pytest.raises(HandoffError) as info:
        reserve(table, **kw)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and text in info.value.message
    assert len(table) == 0


def test_one_token_past_the_cached_pages_is_enough() -> None:
    table = HandoffTable()
    reserve(table, page_ids=[1, 2, 3], num_tokens=9, cached_pages=2, cached_prefix=1)
    assert table.get("r1").cached_pages == 2


@pytest.mark.asyncio
async def test_the_broker_service_carries_the_cached_pages(broker: Broker) -> None:
    await broker.decode("d1")
    await broker.prefill("p1")
    await broker.stub.Reserve(reserve_request("r1", cached_pages=2, cached_prefix=-(1 << 62)))
    resolved = await broker.stub.Resolve(
        pb.ResolveRequest(request_id="r1", prefill_instance_id="p1", layout=LAYOUT_PB)
    )
    assert (resolved.cached_pages, resolved.cached_prefix) == (2, -(1 << 62))
    assert list(resolved.page_ids) == [3, 5, 7] and resolved.num_tokens == 10
