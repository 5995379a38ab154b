"""A decode engine's prefix cache, in one process: the KV of a finished request (prompt and
generated tokens, full pages) stays cached; a follow-up turn reserved there shares those pages
and receives only the rest from prefill. Tokens equal the offline engine's; no page leaks."""

from __future__ import annotations

import pytest
import torch

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def config(page_size: int, **kw) -> EngineConfig:
    fields = dict(page_size=page_size, max_total_tokens=512, max_batch_tokens=32)
    return EngineConfig(**{**fields, "prefix_cache": True, **kw})


def handoff(prefill: LLMEngine, decode: LLMEngine, prompt, params, rid: str) -> tuple[list, int]:
    """One PD request: decode reserves, prefill computes, the pages decode does not hold
    are copied; returns the tokens and how many leading pages decode held."""
    reserved = decode.reserve(prompt, params, rid)
    held = reserved.num_cached_pages
    prefill.add_request(prompt, params, request_id=rid, prefill_only=True)
    first = None
    while first is None:
        for out in prefill.step():
            if out.request_id == rid and out.finished:
                first = out.new_token_ids[0]
    src = prefill.requests[rid]
    n_pages = -(-len(prompt) // prefill.config.page_size)
    # decode's copy of the pages it holds is its own (computed there in an earlier turn):
    # the same KV as prefill's, up to rounding
    torch.testing.assert_close(
        decode.kv_pool.buffer[:, reserved.pages[:held]],
        prefill.kv_pool.buffer[:, src.pages[:held]],
        rtol=1e-4,
        atol=1e-4,
    )
    for i in range(held, n_pages):  # only the pages decode does not hold
        decode.kv_pool.buffer[:, reserved.pages[i]] = prefill.kv_pool.buffer[:, src.pages[i]]
    prefill.release(rid)
    tokens = list(decode.activate(rid, first).new_token_ids)
    while rid in decode.requests:
        for out in decode.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens, held


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_follow_up_turn_shares_the_pages_decode_kept(model, page_size: int) -> None:
    g = torch.Generator().manual_seed(11)
    first_prompt = torch.randint(0, 500, (37,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=11, ignore_eos=True)
    offline = LLMEngine(config(page_size, prefix_cache=False), model=model)
    prefill = LLMEngine(config(page_size), model=model)
    decode = LLMEngine(config(page_size), model=model)

    turn1, held = handoff(prefill, decode, first_prompt, params, "t1")
    assert held == 0 and turn1 == offline.generate([first_prompt], params)[0].output_ids
    cache = decode.scheduler.prefix_cache
    assert cache is not None and decode.num_pages_in_use == 0
    # prompt + output less the last token (its KV was never computed), full pages only
    assert cache.num_cached_pages == (37 + 11 - 1) // page_size

    second_prompt = first_prompt + turn1 + [7, 8, 9, 10, 11]  # 53 tokens
    turn2, held = handoff(prefill, decode, second_prompt, params, "t2")
    assert held == (37 + 11 - 1) // page_size
    assert turn2 == offline.generate([second_prompt], params)[0].output_ids
    assert cache.stats().num_hit_tokens == held * page_size
    assert decode.num_pages_in_use == 0 and prefill.num_pages_in_use == 0


def test_abort_gives_the_shared_pages_back_to_the_cache(model) -> None:
    decode = LLMEngine(config(4), model=model)
    cache = decode.scheduler.prefix_cache
    assert cache is not None
    prompt = list(range(3, 43))  # 40 tokens: 10 pages
    a = decode.reserve(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), "a")
    cached_pages = set(a.pages)  # the prompt's 10 pages
    decode.activate("a", 5)
    while "a" in decode.requests:
        decode.step()
    assert cache.num_cached_pages == 10 and decode.num_pages_in_use == 0  # 40 + 4 - 1 tokens

    follow_up = prompt + [9] * 9
    b = decode.reserve(follow_up, SamplingParams(max_new_tokens=4), "b")
    assert b.num_cached_pages == 10 and set(b.pages[:10]) == cached_pages
    assert cache.num_evictable_pages == 0  # held by b: never evicted while it waits
    assert decode.abort("b") is True
    assert decode.num_pages_in_use == 0 and cache.num_evictable_pages == 10
    # the pages b took for the rest (never written) were freed, not cached
    assert cache.num_cached_pages == 10
    c = decode.reserve(follow_up, SamplingParams(max_new_tokens=4), "c")
    assert c.num_cached_pages == 10 and set(c.pages[:10]) == cached_pages
    decode.abort("c")
    assert decode.num_pages_in_use == 0


def test_cached_pages_are_evicted_when_a_reservation_needs_them(model) -> None:
    decode = LLMEngine(config(4, max_total_tokens=64), model=model)  # 16 pages
    cache = decode.scheduler.prefix_cache
    assert cache is not None
    decode.reserve(list(range(3, 43)), SamplingParams(max_new_tokens=2, ignore_eos=True), "a")
    decode.activate("a", 5)
    while "a" in decode.requests:
        decode.step()
    assert cache.num_cached_pages == 10
    other = decode.reserve(list(range(100, 148)), SamplingParams(max_new_tokens=4), "b")
    assert other.num_cached_pages == 0 and len(other.pages) == 12
    assert cache.stats().num_evicted_pages >= 6  # 16 pages: 12 for b, some for growth
    decode.abort("b")
    assert decode.num_pages_in_use == 0
