"""Decode's admission on the engine thread: pages and a running slot, or why not."""

from __future__ import annotations

import pytest

from dsmesh.decode_svc.handoff import Reservation
from dsmesh.decode_svc.servicer import _try_reserve
from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(max_total_tokens=256, page_size=16, max_running_requests=2, device="cpu")
    )


def test_a_request_holds_a_slot_from_its_reservation(engine: LLMEngine) -> None:
    params = SamplingParams(max_new_tokens=8)
    first = _try_reserve(engine, [1, 2, 3], params, "a")
    second = _try_reserve(engine, [1, 2, 3], params, "b")
    assert first == Reservation([0]) and second == Reservation([1])  # the prompt's one page
    third = _try_reserve(engine, [1, 2, 3], params, "c")
    assert third == "all 2 request slots are taken (--max-running-requests)"
    assert engine.scheduler.num_pages_available == 14  # the third took nothing
    engine.abort("a")
    assert _try_reserve(engine, [1, 2, 3], params, "c") == Reservation([0])
    for rid in ("b", "c"):
        engine.abort(rid)


def test_short_of_pages_says_how_many(engine: LLMEngine) -> None:
    _try_reserve(engine, [1] * 100, SamplingParams(max_new_tokens=10), "hold")  # 7 pages
    why = _try_reserve(engine, [1] * 200, SamplingParams(max_new_tokens=50), "big")
    # the prompt's 13 pages, and one kept free for "hold" to grow into once it runs
    assert why == "need 13 KV pages (+1 kept free for requests to grow), 9 available"
    engine.abort("hold")


def test_invalid_requests_raise(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="sampling.max_new_tokens"):
        _try_reserve(engine, [1, 2, 3], SamplingParams(max_new_tokens=10_000), "huge")
