"""Prefix cache: page-aligned sharing, exact outputs, reference counts, eviction, no leaks."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import PageAllocator
from engine.llm_engine import EngineConfig, LLMEngine
from engine.loader import load_model
from engine.prefix_cache import PrefixCache
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def test_match_insert_release_evict() -> None:
    alloc = PageAllocator(10)
    cache = PrefixCache(alloc, page_size=4)
    prompt = list(range(10))  # 2 full pages + 2 tokens
    pages = alloc.allocate(3)
    assert cache.match(prompt) == []
    to_free = cache.insert(prompt, pages, num_matched=0)
    assert to_free == [pages[2]]  # the partial page is not cached
    alloc.free(to_free)
    assert cache.num_cached_pages == 2 and cache.num_evictable_pages == 2
    # Same first page, different second page: only one page matches.
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9, 9]) == [pages[0]]
    assert cache.num_evictable_pages == 1
    # A prompt of exactly 8 tokens may reuse only 1 page: one token must stay to compute.
    assert cache.match(list(range(8))) == [pages[0]]
    cache.release([pages[0], pages[0]])
    assert cache.num_evictable_pages == 2
    assert cache.evict(5) == 2
    assert alloc.num_free_pages == 10 and cache.num_cached_pages == 0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def test_shared_prefix_gives_same_tokens_and_reuses_pages(model) -> None:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 500, (40,), generator=g).tolist()
    prompts = [system + torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 9, 20)]
    plain = LLMEngine(EngineConfig(page_size=4, max_total_tokens=2048), model=model)
    expected = [r.output_ids for r in plain.generate(prompts, GREEDY)]

    cached = LLMEngine(
        EngineConfig(page_size=4, max_total_tokens=2048, prefix_cache=True), model=model
    )
    first = cached.generate(prompts[:1], GREEDY)[0].output_ids
    assert first == expected[0]
    for prompt, want in zip(prompts[1:], expected[1:], strict=True):
        rid = cached.add_request(prompt, GREEDY)
        req = cached.requests[rid]
        cached.step()
        assert req.num_cached_pages == 10  # the 40-token system prompt = 10 pages of 4
        while cached.has_unfinished():
            cached.step()
        assert req.output_ids == want
    assert cached.num_pages_in_use == 0
    assert cached.scheduler.prefix_cache is not None
    assert cached.scheduler.prefix_cache.num_cached_pages >= 10


def test_eviction_makes_room_under_pressure(model) -> None:
    engine = LLMEngine(
        EngineConfig(page_size=4, max_total_tokens=64, prefix_cache=True), model=model
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(6):  # each leaves ~8 cached pages behind in a 16-page pool
        prompt = torch.randint(0, 500, (34,), generator=g).tolist()
        out = engine.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out[0].output_ids) == 4
    assert engine.num_pages_in_use == 0
    alloc = engine.kv_pool.allocator
    assert alloc.num_used_pages == engine.scheduler.prefix_cache.num_cached_pages
