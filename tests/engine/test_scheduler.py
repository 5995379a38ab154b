"""Pages on demand and retraction: a request takes pages as its tokens need them; when the
pool runs short the newest running requests give theirs back and recompute later. Tokens
equal an unlimited pool's, nothing fails or leaks, and a request that can never fit is
refused at once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.kv.pool import OutOfPagesError, PageAllocator
from dsmesh.engine.llm_engine import EngineConfig, GenerationResult, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.request import Request, RequestStatus
from dsmesh.engine.sampling.params import INT32_MAX, SamplingParams
from dsmesh.engine.sched.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


# ---- the scheduler alone -----------------------------------------------------------------------


def run_step(sched: Scheduler, next_token: int = 7) -> list[tuple[str, int]]:
    """One schedule plus the engine's bookkeeping (no model): every chunk is computed (its
    prompt pages shared through the prefix cache, if on), and a request whose known tokens
    are all fed gets ``next_token``. Returns (id, tokens) per chunk."""
    chunks = sched.schedule()
    for c in chunks:
        req = c.request
        assert len(req.pages) * sched.config.page_size >= req.num_computed + c.num_tokens
        start = req.num_computed
        req.num_computed += c.num_tokens
        if start < len(req.prompt_ids):
            sched.share_prompt(req)  # as the engine: computed prompt pages join the cache
        if req.num_computed == req.num_tokens:
            req.output_ids.append(next_token)
    return [(c.request.request_id, c.num_tokens) for c in chunks]


def test_newest_is_retracted_and_resumes_where_it_stopped() -> None:
    alloc = PageAllocator(8)
    sched = Scheduler(SchedulerConfig(page_size=1, max_batch_tokens=64), alloc)
    reqs = [Request(rid, [1, 2], GREEDY, max_total_tokens=10) for rid in "abc"]
    for r in reqs:
        sched.add(r)
    a, b, c = reqs
    # Prompt pages only: 2 + 2 + 2 of 8, each admission leaving a page per running request.
    assert run_step(sched) == [("a", 2), ("b", 2), ("c", 2)]
    assert alloc.num_free_pages == 2
    # Each decode needs a third page: a and b take the last two, c (the newest) gives its back.
    assert run_step(sched) == [("a", 1), ("b", 1)]
    assert sched.stats().num_retractions == 1 and sched.stats().num_retracted_tokens == 2
    assert c.status is RequestStatus.WAITING and list(sched.waiting) == [c]
    assert (c.pages, c.num_computed, c.output_ids) == ([], 0, [7])  # its token is kept
    assert alloc.num_free_pages == 2
    run_step(sched)  # a and b take c's pages; c waits (it needs 3, plus room to grow)
    assert [r.request_id for r in sched.running] == ["a", "b"]
    sched.finish(a, "length")
    sched.finish(b, "length")
    # Re-admitted, c recomputes its prompt and its token as one chunk, then samples.
    assert run_step(sched) == [("c", 3)]
    assert (c.num_computed, c.output_ids, len(c.pages)) == (3, [7, 7], 3)


def test_retraction_keeps_the_computed_prefix_in_the_cache() -> None:
    alloc = PageAllocator(8)
    sched = Scheduler(SchedulerConfig(page_size=1, max_batch_tokens=64, prefix_cache=True), alloc)
    cache = sched.prefix_cache
    assert cache is not None
    reqs = [Request(rid, [i, 2], GREEDY, max_total_tokens=10) for i, rid in enumerate("abc")]
    for r in reqs:
        sched.add(r)
    a, b, c = reqs
    run_step(sched)
    run_step(sched)  # c retracted: its two computed prompt pages stay cached
    assert sched.stats().num_retractions == 1
    # every prompt's pages are cached (shared while running); only c's are idle
    assert cache.num_cached_pages == 6 and cache.num_evictable_pages == 2
    sched.finish(a, "length")
    sched.finish(b, "length")
    assert run_step(sched) == [("c", 1)]  # only the sampled token is computed again
    assert c.num_cached_pages == 2 and c.num_computed == 3


def test_a_reserve_all_request_is_never_retracted() -> None:
    alloc = PageAllocator(6)
    sched = Scheduler(SchedulerConfig(page_size=1, max_batch_tokens=64), alloc)
    held = Request("held", [1, 2], GREEDY, max_total_tokens=4, reserve_all=True)
    grows = Request("grows", [1, 2], GREEDY, max_total_tokens=6)
    sched.add(held)
    sched.add(grows)
    run_step(sched)
    assert len(held.pages) == 4 and len(grows.pages) == 2  # 0 free
    run_step(sched)  # grows needs a page: it is the only one that can give pages back
    assert [r.request_id for r in sched.running] == ["held"]
    assert list(sched.waiting) == [grows]
    with pytest.raises(ValueError, match="cannot be retracted"):
        sched.retract(held)


# ---- requests that share a prompt prefix being computed ----------------------------------------


def test_a_request_waits_for_the_prefix_a_running_one_computes() -> None:
    """Requests sharing a system prompt, arriving together: the first computes it, the rest
    wait a step and take it from the cache; an unrelated request behind them is not held up."""
    alloc = PageAllocator(64)
    sched = Scheduler(SchedulerConfig(page_size=16, max_batch_tokens=256, prefix_cache=True), alloc)
    system = list(range(100, 180))  # 80 tokens: 5 full pages
    a = Request("a", system + [1, 2], GREEDY, max_total_tokens=100)
    b = Request("b", system + [3], GREEDY, max_total_tokens=100)
    other = Request("other", list(range(300, 390)), GREEDY, max_total_tokens=100)
    for r in (a, b, other):
        sched.add(r)
    assert run_step(sched) == [("a", 82), ("other", 90)]
    assert list(sched.waiting) == [b] and sched.stats().num_prefix_waits == 1
    # a's prompt is computed (and shared through the cache): b takes its 5 pages.
    assert run_step(sched) == [("a", 1), ("other", 1), ("b", 1)]
    assert b.num_cached_pages == 5 and b.num_computed == 81
    assert sched.stats().num_prefix_waits == 1


def test_a_follower_joins_once_little_of_the_prefix_is_left() -> None:
    """A prefix computed over several chunks: the follower joins in the step that computes
    its last PREFIX_WAIT_TOKENS, taking from the cache what is computed already."""
    alloc = PageAllocator(64)
    sched = Scheduler(SchedulerConfig(page_size=4, max_batch_tokens=32, prefix_cache=True), alloc)
    system = list(range(100, 180))  # 80 tokens: chunks of 32, 32, 16
    a = Request("a", system, GREEDY, max_total_tokens=100)
    b = Request("b", system + [5, 6], GREEDY, max_total_tokens=100)
    other = Request("other", [1, 2, 3], GREEDY, max_total_tokens=100)
    for r in (a, b, other):
        sched.add(r)
    assert run_step(sched) == [("a", 32)]
    assert run_step(sched) == [("a", 32)]
    # 16 tokens of the prefix left: b computes them beside a rather than wait a step.
    assert run_step(sched) == [("a", 16), ("b", 16)]
    assert b.num_cached_pages == 16 and sched.stats().num_prefix_waits == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_short_shared_prefixes_and_no_cache_never_wait(page_size: int) -> None:
    alloc = PageAllocator(256)
    cached = Scheduler(
        SchedulerConfig(page_size=page_size, max_batch_tokens=256, prefix_cache=True), alloc
    )
    plain = Scheduler(
        SchedulerConfig(page_size=page_size, max_batch_tokens=256), PageAllocator(256)
    )
    for sched, shared in ((cached, 63), (plain, 80)):
        system = list(range(100, 100 + shared))  # 63 tokens: under PREFIX_WAIT_TOKENS
        for rid in "ab":
            sched.add(Request(rid, system + [ord(rid)], GREEDY, max_total_tokens=100))
        assert [rid for rid, _ in run_step(sched)] == ["a", "b"]
        assert sched.stats().num_prefix_waits == 0


def test_followers_give_the_tokens_of_no_cache(model) -> None:
    """Through the engine: a group of prompts sharing a system prompt, all submitted at once,
    gives the tokens of a cache-less engine while computing the system prompt once."""
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    system = torch.randint(0, vocab, (96,), generator=g).tolist()
    prompts = [system + torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 20, 3)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    config = EngineConfig(device="cpu", page_size=16, max_total_tokens=1024, max_batch_tokens=512)
    want = LLMEngine(config, model=model).generate(prompts, params)
    engine = LLMEngine(dataclasses.replace(config, prefix_cache=True), model=model)
    got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert engine.stats.num_prefix_waits == 2
    cache = engine.scheduler.prefix_cache
    assert cache is not None and cache.num_hit_tokens == 2 * 96
    assert engine.num_pages_in_use == 0


def test_may_admit_next_step_follows_slots_and_the_interval() -> None:
    """What overlapped decode asks before it launches a step without the scheduler."""
    alloc = PageAllocator(64)
    config = SchedulerConfig(page_size=4, max_batch_tokens=64, max_running_requests=2)
    sched = Scheduler(dataclasses.replace(config, admit_interval=3), alloc)
    for rid in "abc":
        sched.add(Request(rid, [1, 2, 3], GREEDY, max_total_tokens=20))
    run_step(sched)  # a and b run, c waits for a slot
    assert not sched.may_admit_next_step()  # the batch stays full
    assert not sched.may_admit_next_step(num_leaving=1)  # a slot frees: 1 step of 3 next
    sched.count_unscheduled_step()  # a decode step launched ahead
    assert not sched.may_admit_next_step(num_leaving=1)
    sched.count_unscheduled_step()
    assert sched.may_admit_next_step(num_leaving=1)  # the third step after may admit
    assert not sched.may_admit_next_step()
    every = Scheduler(config, PageAllocator(64))
    every.add(Request("a", [1], GREEDY, max_total_tokens=20))
    assert every.may_admit_next_step()
    run_step(every)
    assert not every.may_admit_next_step()  # nothing waits


# ---- decode: requests reserved for KV that prefill writes ---------------------------------------


def handed_off(sched: Scheduler, rid: str, prompt: list[int], first_token: int = 7) -> Request:
    """What a decode instance does with a request: reserve its pages; once prefill's KV has
    landed, book prefill's first token and start it (as LLMEngine.activate)."""
    req = Request(rid, prompt, GREEDY, max_total_tokens=20)
    sched.reserve(req)
    req.num_computed = len(prompt)
    req.output_ids.append(first_token)
    sched.start_reserved(req)
    return req


def test_a_reservation_takes_its_prompt_pages_and_keeps_them_until_it_runs() -> None:
    alloc = PageAllocator(8)
    sched = Scheduler(SchedulerConfig(page_size=1, max_batch_tokens=64), alloc)
    grows = Request("grows", [1, 2], GREEDY, max_total_tokens=10)
    sched.add(grows)
    run_step(sched)
    reserved = Request("reserved", [1, 2, 3], GREEDY, max_total_tokens=20)
    sched.reserve(reserved)  # its prompt's 3 pages, not 20
    assert (len(reserved.pages), reserved.status, alloc.num_free_pages) == (
        3,
        RequestStatus.RESERVED,
        3,
    )
    for _ in range(3):
        run_step(sched)  # grows takes its 3rd, 4th, 5th pages
    assert alloc.num_free_pages == 0
    # Short again: prefill may be writing the reserved pages, so the only request that can
    # give pages back is the one asking for them.
    assert run_step(sched) == []
    assert grows.status is RequestStatus.WAITING and grows.pages == []
    assert reserved.status is RequestStatus.RESERVED and len(reserved.pages) == 3
    # A new reservation waits behind the retracted request, which came first.
    with pytest.raises(OutOfPagesError, match="1 retracted requests wait to recompute first"):
        sched.reserve(Request("later", [1], GREEDY, max_total_tokens=4))
    sched.finish(reserved, "abort")  # e.g. its handoff failed: nothing reserved any more
    assert sched.reserved == {} and alloc.num_free_pages == 8
    assert run_step(sched) == [("grows", 6)]  # its prompt and 4 tokens, as one chunk


def test_a_reservation_leaves_a_page_per_growing_request() -> None:
    sched = Scheduler(SchedulerConfig(page_size=1, max_batch_tokens=64), PageAllocator(6))
    handed_off(sched, "a", [1, 2])  # 2 pages
    with pytest.raises(OutOfPagesError, match=r"need 4 KV pages \(\+1 kept free"):
        sched.reserve(Request("b", [1, 2, 3, 4], GREEDY, max_total_tokens=8))
    assert sched.num_pages_available == 4 and sched.reserved == {}
    sched.reserve(Request("c", [1, 2, 3], GREEDY, max_total_tokens=8))  # 3 + 1 of 4


def test_a_handed_off_request_is_retracted_and_recomputes_here() -> None:
    alloc = PageAllocator(8)
    sched = Scheduler(SchedulerConfig(page_size=1, max_batch_tokens=64), alloc)
    a = handed_off(sched, "a", [1, 2])
    b = handed_off(sched, "b", [3, 4])
    assert alloc.num_free_pages == 4  # prompt pages only
    run_step(sched)
    run_step(sched)  # each grew to 4 pages (2 prompt + 2 tokens): the pool is full
    assert alloc.num_free_pages == 0
    assert run_step(sched) == [("a", 1)]  # a needs a 5th page: b, the newer, gives its back
    assert sched.stats().num_retractions == 1
    assert (b.status, b.pages, b.num_computed, b.output_ids) == (
        RequestStatus.WAITING,
        [],
        0,
        [7, 7, 7],  # prefill's first token and its own two are kept
    )
    sched.finish(a, "length")
    # b recomputes its prompt, prefill's token and its own as one chunk, then samples.
    assert run_step(sched) == [("b", 5)]
    assert (b.num_computed, b.output_ids) == (5, [7, 7, 7, 7])


# ---- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "v3")


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    return load_model(tiny_dir)


def batch(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts sharing a 20-token system prefix (so retracted requests hit the cache), half
    greedy and half seeded sampling, some stopping at EOS."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, vocab, (20,), generator=g).tolist()
    lengths = [3, 11, 30, 1, 17, 25, 6, 40]
    prompts = [system + torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    params = []
    for i in range(len(prompts)):
        new = 24 + 3 * i
        if i % 2:
            params.append(
                SamplingParams(
                    temperature=0.9,
                    top_p=0.95,
                    seed=100 + i,
                    max_new_tokens=new,
                    ignore_eos=i % 3 != 0,
                )
            )
        else:
            params.append(SamplingParams(max_new_tokens=new, ignore_eos=i % 4 != 0))
    return prompts, params


@pytest.fixture(scope="module")
def unlimited_runs() -> dict[int, list[GenerationResult]]:
    """The batch's results in an unlimited pool, by page size (filled on first use)."""
    return {}


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_gives_the_tokens_of_an_unlimited_pool(
    model, unlimited_runs, page_size: int, prefix_cache: bool
) -> None:
    prompts, params = batch(model.config.vocab_size)
    unlimited = EngineConfig(
        device="cpu", page_size=page_size, max_total_tokens=4096, max_batch_tokens=48
    )
    if page_size not in unlimited_runs:
        unlimited_runs[page_size] = LLMEngine(unlimited, model=model).generate(prompts, params)
    want = unlimited_runs[page_size]
    # Room for the largest request alone (60 + 45 tokens), far from the whole batch's.
    assert sum(len(p) for p in prompts) + sum(p.max_new_tokens for p in params) > 4 * 128
    small = dataclasses.replace(unlimited, max_total_tokens=128, prefix_cache=prefix_cache)
    engine = LLMEngine(small, model=model)
    got = engine.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert engine.stats.num_retractions > 0  # the pool really was short
    assert engine.num_pages_in_use == 0
    if prefix_cache:
        cache = engine.scheduler.prefix_cache
        assert cache is not None and cache.num_hit_tokens > 0


def test_a_batch_far_beyond_the_pool_completes(model) -> None:
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 500, (8,), generator=g).tolist() for _ in range(16)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)  # 16 x 48 tokens in 96
    engine = LLMEngine(EngineConfig(device="cpu", page_size=4, max_total_tokens=96), model=model)
    results = engine.generate(prompts, params)
    assert all(len(r.output_ids) == 40 and r.finish_reason == "length" for r in results)
    assert engine.stats.num_retractions > 0
    assert engine.kv_pool.allocator.num_used_pages == 0


def test_max_new_tokens_up_to_the_context_takes_no_pages_up_front(model) -> None:
    """A client that omits max_tokens means "up to the context": such requests run side by
    side, holding only the pages their tokens fill."""
    engine = LLMEngine(EngineConfig(device="cpu", page_size=4, max_total_tokens=4096), model=model)
    assert engine.max_context == 4096  # each may reach the whole pool
    params = SamplingParams(max_new_tokens=INT32_MAX, ignore_eos=True)
    ids = [engine.add_request([i + 1] * 10, params) for i in range(8)]
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 8
    assert engine.num_pages_in_use == 8 * 3  # 12 tokens each: 3 pages of 4
    for rid in ids:
        assert engine.abort(rid)
    assert engine.num_pages_in_use == 0


def test_a_request_that_can_never_fit_names_the_field(model) -> None:
    engine = LLMEngine(EngineConfig(device="cpu", page_size=4, max_total_tokens=64), model=model)
    with pytest.raises(InvalidRequestError, match="the pool has only 16") as err:
        engine.add_request([1] * 64, GREEDY)  # 64 + 1 tokens: 17 pages
    assert err.value.field == "input_ids"
    with pytest.raises(InvalidRequestError, match="the pool has only 16") as err:
        engine.add_request([1] * 60, SamplingParams(max_new_tokens=5))
    assert err.value.field == "sampling.max_new_tokens"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request([1] * 4096, GREEDY)  # the context
    assert err.value.field == "input_ids"
    assert not engine.has_unfinished()
    # Exactly the pool: it runs alone, to its end.
    res = engine.generate([[1] * 60], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert len(res.output_ids) == 4 and engine.num_pages_in_use == 0
