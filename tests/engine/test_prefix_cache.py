"""Prefix cache: page-aligned sharing, exact outputs, reference counts, eviction, no leaks.

The radix tree is checked against ``ReferenceCache``, a plain dict of whole prefixes with
the same contract (match, release, insert, LRU eviction of unreferenced leaves), on random
operation sequences at page sizes 1, 2 and 16.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsmesh.engine.kv import prefix_cache
from dsmesh.engine.kv.pool import PageAllocator, pages_for
from dsmesh.engine.kv.prefix_cache import PrefixCache, page_hashes
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.request import Request
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sched.scheduler import Scheduler, SchedulerConfig

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
    with pytest.raises(ValueError, match="released more often"):
        cache.release([pages[0]])
    stats = cache.stats()
    assert (stats.num_lookups, stats.num_lookup_tokens, stats.num_hit_tokens) == (3, 27, 8)
    assert stats.hit_rate == 8 / 27
    assert cache.evict(5) == 2
    assert alloc.num_free_pages == 10 and cache.num_cached_pages == 0
    assert cache.stats().num_evicted_pages == 2


def test_eviction_takes_least_recently_used_leaves() -> None:
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=2)
    a = [1, 1, 2, 2, 3, 3, 0]  # pages [1 1] [2 2] [3 3]
    b = [1, 1, 5, 5, 0]  # shares the first page with a
    pages_a = alloc.allocate(3)
    alloc.free(cache.insert(a, pages_a, 0))
    matched = cache.match(b)
    assert matched == pages_a[:1]
    pages_b = matched + alloc.allocate(2)
    alloc.free(cache.insert(b, pages_b, 1))  # b's path is now the most recently used
    assert cache.num_cached_pages == 4
    # a's two leaves go first (its deepest page first), then b's leaf, then the shared root.
    assert cache.evict(1) == 1
    assert cache.match(a) == pages_a[:2]
    cache.release(pages_a[:2])  # a's path is used again: b's leaf is now the oldest
    assert cache.evict(1) == 1
    assert cache.match(b) == pages_a[:1]
    cache.release(pages_a[:1])
    assert cache.evict(1) == 1
    assert cache.match(a) == pages_a[:1]  # a's second page went after b's leaf
    cache.release(pages_a[:1])
    assert cache.evict(10) == 1
    assert cache.num_cached_pages == 0 and alloc.num_free_pages == 8


def test_chained_hashes_name_prefixes() -> None:
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=2)
    prompt = [7, 8, 9, 10, 11, 12, 13]
    hashes = page_hashes(prompt, 2)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert page_hashes(prompt[:4], 2) == hashes[:2]  # a prefix's hashes are a prefix
    assert page_hashes([7, 8, 0, 10], 2)[1] != hashes[1]  # they depend on earlier pages
    assert cache.num_cached_pages_of(hashes) == 0
    alloc.free(cache.insert(prompt[:4], alloc.allocate(2), 0))
    assert cache.num_cached_pages_of(hashes) == 2
    assert cache.num_cached_pages_of(hashes[1:]) == 0  # not a path from the root
    cache.clear()
    assert cache.num_cached_pages_of(hashes) == 0


def test_colliding_hashes_never_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every chained hash equal, matching still compares tokens page by page."""
    monkeypatch.setattr(prefix_cache, "hash", lambda _: 7, raising=False)
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=2)
    a = [1, 2, 3, 4, 5, 6, 0]
    b = [1, 2, 3, 9, 5, 6, 0]  # differs in page 1 only
    pages_a = alloc.allocate(3)
    alloc.free(cache.insert(a, pages_a, 0))
    matched = cache.match(b)
    assert matched == pages_a[:1]
    pages_b = matched + alloc.allocate(3)
    alloc.free(cache.insert(b, pages_b, 1))
    assert cache.num_cached_pages == 5
    assert cache.match(a) == pages_a
    assert cache.match(b) == pages_b[:3]


@pytest.mark.parametrize("page_size", [1, 16])
def test_very_deep_prompt(page_size: int) -> None:
    """20k pages: the nested-tuple keys this replaced hit RecursionError near 1000."""
    num_pages = 20_000
    g = torch.Generator().manual_seed(page_size)
    prompt = torch.randint(0, 129_280, (num_pages * page_size,), generator=g).tolist()
    alloc = PageAllocator(2 * num_pages)
    cache = PrefixCache(alloc, page_size)
    pages = alloc.allocate(num_pages)
    assert cache.insert(prompt, pages, num_matched=0) == []
    resent = prompt + [0]
    assert cache.match(resent) == pages
    assert cache.num_cached_pages_of(page_hashes(prompt, page_size)) == num_pages
    # A prompt that branches off halfway shares exactly the first half.
    half = num_pages // 2
    other = prompt[: half * page_size] + [t + 1 for t in prompt[half * page_size :]]
    shared = cache.match(other)
    assert shared == pages[:half]
    own = alloc.allocate(num_pages - half)
    assert cache.insert(other, shared + own, half) == []
    assert cache.num_cached_pages == 2 * num_pages - half
    assert cache.evict(num_pages) == num_pages - half  # only other's own branch is idle
    assert cache.match(other) == pages[:half]
    cache.release(pages[:half])
    cache.release(pages)
    assert cache.clear() == num_pages
    assert alloc.num_free_pages == alloc.num_pages


# ---- property tests against a plain reference ---------------------------------------------


class ReferenceCache:
    """The contract in the plainest terms: whole prefixes as dict keys, LRU by a clock."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.entries: dict[tuple[int, ...], list[int]] = {}  # prefix -> [page, refs, stamp]
        self.clock = 0

    def _prefix(self, ids: list[int], num_pages: int) -> tuple[int, ...]:
        return tuple(ids[: num_pages * self.page_size])

    def _touch(self, prefix: tuple[int, ...]) -> None:
        self.entries[prefix][2] = self.clock
        self.clock += 1

    def match(self, ids: list[int]) -> list[int]:
        n = 0
        while n < (len(ids) - 1) // self.page_size and self._prefix(ids, n + 1) in self.entries:
            n += 1
        for k in range(1, n + 1):
            self.entries[self._prefix(ids, k)][1] += 1
        return [self.entries[self._prefix(ids, k)][0] for k in range(1, n + 1)]

    def release(self, pages: list[int]) -> None:
        by_page = {e[0]: prefix for prefix, e in self.entries.items()}
        for prefix in sorted((by_page[p] for p in pages), key=len, reverse=True):
            self.entries[prefix][1] -= 1
            if self.entries[prefix][1] == 0:
                self._touch(prefix)

    def insert(self, ids: list[int], pages: list[int], num_matched: int) -> list[int]:
        full = min(len(ids) // self.page_size, len(pages))
        to_free = pages[full:]
        for i in range(num_matched, full):
            prefix = self._prefix(ids, i + 1)
            if prefix in self.entries:
                to_free.append(pages[i])
            else:
                self.entries[prefix] = [pages[i], 0, 0]
        for i in range(full, num_matched, -1):  # the request's unmatched path, deepest first
            if self.entries[self._prefix(ids, i)][1] == 0:
                self._touch(self._prefix(ids, i))
        self.release(pages[:num_matched])
        return to_free

    def evict(self, num_pages: int) -> list[int]:
        freed: list[int] = []
        while len(freed) < num_pages:
            parents = {prefix[: -self.page_size] for prefix in self.entries}
            leaves = [p for p, e in self.entries.items() if e[1] == 0 and p not in parents]
            if not leaves:
                break
            oldest = min(leaves, key=lambda p: self.entries[p][2])
            freed.append(self.entries.pop(oldest)[0])
        return freed

    def cached_pages(self) -> set[int]:
        return {e[0] for e in self.entries.values()}

    def num_idle(self) -> int:
        return sum(e[1] == 0 for e in self.entries.values())


@dataclass
class Held:
    """A running request: its prompt, matched (shared) pages and its own pages."""

    ids: list[int]
    matched: list[int]
    own: list[int]


NUM_PAGES = 24
# Prompts are a prefix of one of these page sequences (page kinds) plus a partial page, so
# that they share prefixes, branch, and resend each other.
BASES = ((0, 0, 0, 0, 0, 0, 0), (0, 0, 1, 1, 1, 1, 1), (0, 1, 2, 0, 1, 2, 0), (2, 2, 2, 1, 0))


def prompt_from(page_size: int, base: int, num_pages: int, tail: int) -> list[int]:
    blocks = [[(k * 5 + j) % 7 for j in range(page_size)] for k in range(3)]
    kinds = BASES[base][:num_pages]
    return [t for k in kinds for t in blocks[k]] + blocks[1][: tail % page_size] + [3]


# An operation: its kind and four numbers that each kind reads as it needs.
OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "admit", "finish", "finish", "abort", "evict"]),
        st.integers(0, 15),
        st.integers(0, 7),
        st.integers(0, 15),
        st.integers(0, 20),
    ),
    min_size=10,
    max_size=60,
)


@pytest.mark.parametrize("page_size", [1, 2, 16])
@settings(max_examples=150, deadline=None, derandomize=True)
@given(ops=OPS)
def test_radix_tree_matches_reference(page_size: int, ops: list[tuple]) -> None:
    alloc = PageAllocator(NUM_PAGES)
    cache = PrefixCache(alloc, page_size)
    ref = ReferenceCache(page_size)
    held: list[Held] = []
    lookup_tokens = hit_tokens = lookups = evicted = 0

    def check() -> None:
        assert set(cache._by_page) == ref.cached_pages()
        assert cache.num_cached_pages == len(ref.entries)
        assert cache.num_evictable_pages == ref.num_idle()
        in_use = sum(len(h.own) for h in held)
        assert alloc.num_used_pages == cache.num_cached_pages + in_use
        stats = cache.stats()
        assert (stats.num_lookups, stats.num_lookup_tokens) == (lookups, lookup_tokens)
        assert (stats.num_hit_tokens, stats.num_evicted_pages) == (hit_tokens, evicted)

    for kind, a, b, c, d in ops:
        if kind == "admit":  # as Scheduler.assign_pages
            ids = prompt_from(page_size, a % len(BASES), b, c)
            matched = cache.match(ids)
            assert matched == ref.match(ids)
            need = pages_for(len(ids) + d, page_size) - len(matched)
            short = need - alloc.num_free_pages
            if 0 < short <= cache.num_evictable_pages:
                freed = ref.evict(short)
                assert cache.evict(short) == len(freed)
                evicted += len(freed)
            if not alloc.can_allocate(need):
                cache.abandon(ids, matched)
                ref.release(matched)
            else:
                held.append(Held(ids, matched, alloc.allocate(need)))
                lookups += 1
                lookup_tokens += len(ids)
                hit_tokens += len(matched) * page_size
        elif kind == "finish" and held:  # as Scheduler.release_pages, maybe mid-prefill
            h = held.pop(a % len(held))
            lo = len(h.matched) * page_size
            computed = h.ids[: lo + (len(h.ids) - lo) * min(c, 4) // 4]
            pages = h.matched + h.own
            to_free = cache.insert(computed, pages, len(h.matched))
            assert sorted(to_free) == sorted(ref.insert(computed, pages, len(h.matched)))
            alloc.free(to_free)
        elif kind == "abort" and held:
            h = held.pop(a % len(held))
            cache.release(h.matched)
            ref.release(h.matched)
            alloc.free(h.own)
        elif kind == "evict":
            freed = ref.evict(b % 4)
            assert cache.evict(b % 4) == len(freed)
            evicted += len(freed)
        check()
    for h in held:
        cache.release(h.matched)
        alloc.free(h.own)
    cache.clear()
    assert cache.num_cached_pages == 0 and alloc.num_free_pages == NUM_PAGES


def test_waiting_admission_leaves_cache_and_counters_alone() -> None:
    """A request that cannot be admitted yet neither evicts nor counts as a lookup."""
    page_size = 4
    alloc = PageAllocator(7)
    sched = Scheduler(SchedulerConfig(page_size=page_size, prefix_cache=True), alloc)
    cache = sched.prefix_cache
    assert cache is not None
    alloc.free(cache.insert(list(range(8)), alloc.allocate(2), 0))
    alloc.free(cache.insert([60] * 4, alloc.allocate(1), 0))  # 3 idle cached pages, 4 free

    def request(rid: str, num_tokens: int, prompt: list[int]) -> Request:
        return Request(rid, prompt, GREEDY, max_total_tokens=num_tokens)

    big = request("big", 32, list(range(8)) + [99] * 20)  # a 7-page prompt, the first 2 cached
    sched.add(request("hog", 12, [50] * 9))  # 3 fresh pages
    sched.add(big)
    sched.schedule()
    assert [r.request_id for r in sched.running] == ["hog"]
    for _ in range(3):  # big needs 5 more pages: 1 free + 1 evictable are not enough
        sched.schedule()
    assert [r.request_id for r in sched.running] == ["hog"]
    assert cache.num_cached_pages == 3 and cache.num_evicted_pages == 0
    assert (cache.num_lookups, cache.num_hit_tokens) == (1, 0)
    sched.finish(sched.running[0], "length")
    sched.schedule()  # 4 free + 1 evictable: room
    assert [r.request_id for r in sched.running] == ["big"]
    assert big.num_cached_pages == 2 and big.pages[:2] == cache.match(big.prompt_ids)
    assert cache.num_evicted_pages == 1
    assert (cache.num_lookups - 1, cache.num_lookup_tokens - 28) == (2, 9 + 28)
    assert cache.num_hit_tokens - 8 == 8


# ---- through the engine ----------------------------------------------------------------------


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


def test_long_prompt_at_page_size_1_hits_and_matches(model) -> None:
    """1500 tokens at page size 1, sent twice (the nested-tuple keys failed here)."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 500, (1500,), generator=g).tolist()
    cfg = EngineConfig(page_size=1, max_total_tokens=4096, max_batch_tokens=2048)
    expected = LLMEngine(cfg, model=model).generate([prompt], GREEDY)[0].output_ids

    engine = LLMEngine(dataclasses.replace(cfg, prefix_cache=True), model=model)
    first = engine.generate([prompt], GREEDY)[0].output_ids
    rid = engine.add_request(prompt, GREEDY)
    req = engine.requests[rid]
    engine.step()
    assert req.num_cached_pages == 1499 and req.num_computed == 1500  # one token computed
    while engine.has_unfinished():
        engine.step()
    assert first == expected and req.output_ids == expected
    cache = engine.scheduler.prefix_cache
    assert cache is not None
    assert cache.num_hit_tokens == 1499 and cache.num_lookups == 2
    assert engine.num_pages_in_use == 0


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
    assert engine.scheduler.prefix_cache.num_evicted_pages > 0


def test_share_caches_a_running_requests_pages_until_a_prefix_cached_meanwhile() -> None:
    alloc = PageAllocator(12)
    cache = PrefixCache(alloc, page_size=2)
    other = alloc.allocate(2)
    alloc.free(cache.insert([0, 1, 7, 7], other, num_matched=0))  # [0, 1] then [7, 7]
    pages = alloc.allocate(3)
    matched = cache.match([0, 1, 2, 3, 4, 5, 6, 7])  # [0, 1] hits
    assert matched == [other[0]]
    mine = matched + pages
    # Shares [2, 3] and [4, 5]; [6] is not a full page yet.
    assert cache.share([0, 1, 2, 3, 4, 5, 6], mine, num_matched=1) == 3
    assert cache.num_cached_pages == 4 and cache.num_evictable_pages == 1  # only [7, 7] idle
    assert cache.match([0, 1, 2, 3, 4, 5, 9]) == [other[0], pages[0], pages[1]]
    # A request with its own copy of a cached page keeps it and the rest private.
    dup = alloc.allocate(2)
    assert cache.match([0, 1, 2, 3]) == [other[0]]
    assert cache.share([0, 1, 7, 7], [other[0], dup[1]], num_matched=1) == 1
    # Finishing drops the references; nothing is freed twice, nothing leaks.
    alloc.free(cache.insert([0, 1, 2, 3, 4, 5, 6, 7], mine, num_matched=3))
    alloc.free(cache.insert([0, 1, 7, 7], [other[0], dup[1]], num_matched=1))
    cache.release([other[0], pages[0], pages[1]])
    alloc.free(dup[:1])
    assert cache.num_evictable_pages == cache.num_cached_pages == 5
    cache.clear()
    assert alloc.num_free_pages == 12


def _prompt_runs(contiguous: bool) -> list[int]:
    """Runs of consecutive page ids in each request's pages, under churn in a pool full of
    idle cached prompts (a prefill's steady state): 6 requests at a time, each ending at a
    random step, new ones with unseen prompts."""
    rng = random.Random(3)
    sched = Scheduler(
        SchedulerConfig(
            page_size=4, prefix_cache=True, max_batch_tokens=4096, contiguous_prompts=contiguous
        ),
        PageAllocator(300),
    )
    runs, seen, n = [], set(), 0
    for _ in range(400):
        if len(sched.running) < 6:
            prompt = [rng.randrange(1000) for _ in range(rng.choice([37, 45, 61]))]
            sched.add(Request(f"r{n}", prompt, GREEDY, max_total_tokens=len(prompt) + 4))
            n += 1
        sched.schedule()
        for r in sched.running:
            if r.request_id not in seen:
                seen.add(r.request_id)
                pages = list(r.pages)
                runs.append(1 + sum(b != a + 1 for a, b in zip(pages, pages[1:], strict=False)))
            r.num_computed = len(r.prompt_ids)  # its prompt ran
        if sched.running and rng.random() < 0.5:
            sched.finish(sched.running[rng.randrange(len(sched.running))], "length")
    assert sched.prefix_cache is not None and sched.prefix_cache.num_evicted_pages > 1000
    return runs[50:]  # once the pool is full of cached prompts


def test_contiguous_prompts_keeps_each_prompts_pages_one_run() -> None:
    on, off = _prompt_runs(True), _prompt_runs(False)
    assert len(on) > 100 and sum(on) / len(on) < 1.05, sum(on) / len(on)
    # evicting only the shortfall leaves a prompt in many runs (what the KV copy pays for)
    assert sum(off) / len(off) > 3, sum(off) / len(off)
