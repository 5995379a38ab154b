"""Continuous batching with chunked prefill under a per-step token budget; pages on demand.

Each step: every decoding request gets one token; prefilling requests (oldest first) get
prompt chunks from what remains of ``max_batch_tokens``; then waiting requests are admitted in
arrival order while pages and running slots allow. With the prefix cache on, a waiting request
whose prompt shares a prefix that a running request is computing waits until it is computed
(a step, or a chunk of a long prompt) and then takes it from the cache, letting the requests
behind it in.

Pages follow the tokens. Admission takes the pages of a request's known tokens (its prompt;
after a retraction, prompt and output), and a decoding request takes one more page when its
next token starts one. When the pool runs short for a decode step, the newest running
requests are retracted: their pages go back (their computed full pages into the prefix cache,
when there is one, so the recompute is cheap) and they wait at the front of the queue, to
recompute prompt and output as one prefill when pages are free again. The oldest request is
never retracted for a newer one, so every request finishes.

A ``reserve_all`` request (PD prefill: the KV transfer reads its pages after it finished)
takes pages for its whole life at admission and is never retracted.

A request reserved on a decode instance (:meth:`Scheduler.reserve`, KV that another process
writes) takes the pages of its prompt only, in its turn: never while a retracted request waits,
and leaving a page per growing request free. It holds them outside the running batch while
prefill writes them, so it is never retracted then; from :meth:`Scheduler.start_reserved` on it
grows and is retracted like any other, and recomputes prompt and output here.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass

from dsmesh.engine.kv.pool import OutOfPagesError, PageAllocator, pages_for
from dsmesh.engine.kv.prefix_cache import PrefixCache
from dsmesh.engine.kv.prefix_hashes import page_hashes
from dsmesh.engine.request import Request, RequestStatus

# A waiting request waits for a running one computing the same prompt prefix when they share
# at least this many tokens of it (rounded down to pages, at least one page): less is cheaper
# to compute again than to wait a step for.
PREFIX_WAIT_TOKENS = 64


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    max_running_requests: int = 64
    max_batch_tokens: int = 2048  # new tokens per forward; also the prefill chunk size
    prefix_cache: bool = False
    # Slots a decoding request may write past its next token in a step: the drafts that
    # speculative decoding verifies (dsmesh/engine/speculative/worker.py); its pages are taken with
    # it.
    num_lookahead_tokens: int = 0
    # While requests decode, waiting requests join at most every ``admit_interval`` steps,
    # so the prompt chunks of several arrivals share one forward (a step with prompt chunks
    # runs them eagerly) instead of each arrival costing one; 1 = every step.
    admit_interval: int = 1
    # With the prefix cache: when no run of free pages holds a prompt chunk's pages (or
    # ``PROMPT_RUN_PAGES`` of them), evict idle cached pages (least recently used first)
    # until one does, up to ``PROMPT_RUN_EVICTIONS`` times that run. For the instances
    # a prompt's KV is copied between (prefill, decode): the copy moves a run per layer, and
    # evicting only the shortfall left the few free pages scattered, so prompts came out in
    # runs of 1-3 pages after a while (docs/PD.md, "KV pages in runs").
    contiguous_prompts: bool = False


# SchedulerConfig.contiguous_prompts: the run of free pages a prompt chunk's evictions aim
# for (64 pages of 16 tokens: one copy per layer per 1024 prompt tokens; a longer chunk
# takes the longest runs), and the pages they may evict for it, per page of the run
PROMPT_RUN_PAGES = 64
PROMPT_RUN_EVICTIONS = 4


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int


@dataclass(frozen=True)
class SchedulerStats:
    """Counters since the scheduler was made."""

    num_retractions: int  # requests taken out of the running batch for lack of pages
    num_retracted_tokens: int  # computed tokens those gave up (recomputed, less cache hits)
    # tokens whose pages admission took before the request had them (reserve_all's
    # max_total_tokens beyond its prompt); 0 while every request's pages follow its tokens
    num_reserved_ahead_tokens: int = 0
    # admissions put off by a step because a running request was computing the same
    # prompt pages (Scheduler._waits_for_prefix), so they take them from the cache after
    num_prefix_waits: int = 0


def _arrival(request: Request) -> int:
    return request.arrival


class Scheduler:
    """Owns the waiting queue, the running batch (both in arrival order) and who holds which
    page. Not thread-safe: one engine thread."""

    def __init__(self, config: SchedulerConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.prefix_cache = (
            PrefixCache(allocator, config.page_size) if config.prefix_cache else None
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # decode: holding pages for KV that another process writes, not yet running
        self.reserved: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_retractions = 0
        self.num_retracted_tokens = 0
        self.num_reserved_ahead_tokens = 0
        self.num_prefix_waits = 0
        self._steps_since_admission = 0

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            self.num_retractions,
            self.num_retracted_tokens,
            self.num_reserved_ahead_tokens,
            self.num_prefix_waits,
        )

    def pages_to_admit(self, request: Request) -> int:
        """Pages ``request`` takes when admitted (before prefix-cache hits): its whole life
        for ``reserve_all``, else those of the tokens it knows now."""
        tokens = request.max_total_tokens if request.reserve_all else request.num_tokens
        return pages_for(tokens, self.config.page_size)

    @property
    def num_pages_in_use(self) -> int:
        """Pages held by requests (idle prefix-cache pages are free for this count)."""
        idle = self.prefix_cache.num_evictable_pages if self.prefix_cache else 0
        return self.allocator.num_used_pages - idle

    @property
    def num_pages_available(self) -> int:
        idle = self.prefix_cache.num_evictable_pages if self.prefix_cache else 0
        return self.allocator.num_free_pages + idle

    def add(self, request: Request) -> None:
        request.arrival = next(self._arrivals)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- pages --------------------------------------------------------------------------

    def _take(self, request: Request, num: int) -> None:
        """Give ``request`` ``num`` more pages, evicting idle cached pages as needed; the
        caller checked that ``num <= num_pages_available``."""
        short = num - self.allocator.num_free_pages
        if short > 0:
            assert self.prefix_cache is not None
            self.prefix_cache.evict(short)
        if self.config.contiguous_prompts and num > 1 and self.prefix_cache is not None:
            self._evict_for_run(min(num, PROMPT_RUN_PAGES))
        request.add_pages(self.allocator.allocate(num))

    def _evict_for_run(self, run: int) -> None:
        """Evict idle cached pages until ``run`` consecutive pages are free, at most
        ``PROMPT_RUN_EVICTIONS * run`` (SchedulerConfig.contiguous_prompts)."""
        cache = self.prefix_cache
        assert cache is not None
        budget = PROMPT_RUN_EVICTIONS * run
        while budget > 0 and not self.allocator.has_run(run):
            evicted = cache.evict(min(run, budget))
            if evicted == 0:
                return
            budget -= evicted

    def try_grow(self, request: Request, num_tokens: int) -> bool:
        """Pages for the first ``num_tokens`` tokens of ``request``, from free and idle cached
        pages only; False, taking none, if short."""
        need = pages_for(num_tokens, self.config.page_size) - len(request.pages)
        if need <= 0:
            return True
        if need > self.num_pages_available:
            return False
        self._take(request, need)
        return True

    def _headroom(self) -> int:
        """Pages kept free at admission: one per running or reserved request that grows on
        demand, so admitting never makes the next decode step retract."""
        return sum(1 for r in (*self.running, *self.reserved.values()) if not r.reserve_all)

    def assign_pages(self, request: Request, headroom: int = 0) -> bool:
        """Give ``request`` its admission pages (cached prefix first) if ``headroom`` pages
        stay available after; False, holding nothing, if short."""
        cache = self.prefix_cache
        ids = request.known_ids if request.output_ids else request.prompt_ids
        # a request owing prompt logprobs computes every prompt position (no cache hit)
        use_cache = cache is not None and not request.owes_prompt_logprobs
        matched = cache.match(ids) if use_cache else []
        need = self.pages_to_admit(request) - len(matched)
        if need + headroom > self.num_pages_available:
            # Evict nothing: a request that must wait anyway leaves the cache whole.
            if use_cache:
                cache.abandon(ids, matched)
            return False
        request.set_pages(matched)
        self._take(request, need)
        request.num_cached_pages = len(matched)
        request.num_computed = len(matched) * self.config.page_size
        if request.num_cached_prompt_tokens is None:  # first admission: not a recompute
            request.num_cached_prompt_tokens = request.num_computed
        if request.reserve_all:
            self.num_reserved_ahead_tokens += request.max_total_tokens - request.num_tokens
        return True

    def reserve(self, request: Request) -> None:
        """Pages now, scheduling later (decode instance waiting for prefill's KV): those of
        its known tokens (the prompt; all of ``max_total_tokens`` for ``reserve_all``), if a
        page per growing request stays free after and no retracted request waits (it came
        first). Raises OutOfPagesError, holding nothing, otherwise."""
        if self.waiting:
            raise OutOfPagesError(f"{len(self.waiting)} retracted requests wait to recompute first")
        headroom = self._headroom()
        if not self.assign_pages(request, headroom):
            kept = f" (+{headroom} kept free for requests to grow)" if headroom else ""
            raise OutOfPagesError(
                f"need {self.pages_to_admit(request)} KV pages{kept}, "
                f"{self.num_pages_available} available"
            )
        request.arrival = next(self._arrivals)
        request.status = RequestStatus.RESERVED
        self.reserved[request.request_id] = request

    def start_reserved(self, request: Request) -> None:
        """A reserved request whose prompt KV has arrived joins the running batch."""
        if request.status is not RequestStatus.RESERVED:
            raise ValueError(f"request {request.request_id} is not reserved")
        del self.reserved[request.request_id]
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=_arrival)

    # ---- retraction ---------------------------------------------------------------------

    def retract(self, request: Request) -> None:
        """Take a running request out of the batch for lack of pages: its computed tokens
        go to the prefix cache (when on) and its pages back; it waits, in arrival order
        ahead of every request that never ran, to recompute them."""
        if request.reserve_all or request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request.request_id} cannot be retracted")
        self.running.remove(request)
        self.num_retractions += 1
        self.num_retracted_tokens += request.num_computed
        self.release_pages(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        index = bisect.bisect(self.waiting, request.arrival, key=_arrival)
        self.waiting.insert(index, request)

    def _make_room(self, request: Request, num_tokens: int) -> bool:
        """Pages for the first ``num_tokens`` tokens of running ``request``, retracting the
        newest running requests while short; False if ``request`` itself was retracted (it
        was the newest one left that can be)."""
        while not self.try_grow(request, num_tokens):
            victim = next((r for r in reversed(self.running) if not r.reserve_all), None)
            assert victim is not None, "a reserve_all request holds pages for its whole life"
            self.retract(victim)
            if victim is request:
                return False
        return True

    # ---- the step -----------------------------------------------------------------------

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        retractions = self.num_retractions
        # Oldest first, so the pages go to the oldest and the newest are retracted (a victim
        # is always at or after the request being served: never one already scheduled).
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.is_prefilling:
                continue  # retracted just now, or gets a prefill chunk below
            lookahead = self.config.num_lookahead_tokens
            if self._make_room(req, min(req.num_computed + 1 + lookahead, req.max_total_tokens)):
                chunks.append(ScheduledChunk(req, 1))
                budget -= 1 + lookahead
        for req in self.running:  # prefill and recompute: their pages came at admission
            if req.is_prefilling and budget > 0:
                n = min(req.num_pending, budget)
                chunks.append(ScheduledChunk(req, n))
                budget -= n
        if self.num_retractions != retractions:
            return chunks  # short of pages: admit nothing this step
        self._steps_since_admission += 1
        if self._defer_admission(chunks):
            return chunks
        computing = self._pages_being_computed() if self.waiting else set()
        for req in list(self.waiting):  # oldest first; one short of pages stops the rest
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if self._waits_for_prefix(req, computing):
                self.num_prefix_waits += 1
                continue
            if not self.assign_pages(req, self._headroom()):
                break
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_arrival)
            n = min(req.num_pending, budget)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
            self._steps_since_admission = 0
            computing.update(self._uncomputed_page_names(req))
        return chunks

    # ---- prompts that share a prefix being computed ----------------------------------------

    def _prompt_page_names(self, request: Request) -> list[int]:
        """Chained hashes of ``request``'s full prompt pages (dsmesh/engine/kv/prefix_hashes.py),
        computed once."""
        if request.prompt_page_names is None:
            request.prompt_page_names = page_hashes(request.prompt_ids, self.config.page_size)
        return request.prompt_page_names

    def _uncomputed_page_names(self, request: Request) -> list[int]:
        """Names of the full prompt pages whose KV ``request`` has not computed yet (a page
        computed in part counts)."""
        if self.prefix_cache is None or request.num_computed >= len(request.prompt_ids):
            return []
        return self._prompt_page_names(request)[request.num_computed // self.config.page_size :]

    def _pages_being_computed(self) -> set[int]:
        """Names of the prompt pages that running requests have still to compute; empty
        without a prefix cache (no one could take them from it)."""
        names: set[int] = set()
        if self.prefix_cache is not None:
            for req in self.running:
                names.update(self._uncomputed_page_names(req))
        return names

    def _waits_for_prefix(self, request: Request, computing: set[int]) -> bool:
        """Whether admitting ``request`` waits a step: a running request (or one admitted
        this step) computes at least ``PREFIX_WAIT_TOKENS`` tokens of the same prompt
        prefix, which the prefix cache serves once computed, instead of ``request``
        computing them again alongside it (SGLang's in-batch prefix caching). The first of
        a group of requests sharing a system prompt computes it; the rest follow a step or
        a chunk later. Never while nothing else is computed: it cannot wait on itself."""
        if not computing or self.prefix_cache is None or request.owes_prompt_logprobs:
            return False
        need = max(1, PREFIX_WAIT_TOKENS // self.config.page_size)
        shared = 0
        for name in self._prompt_page_names(request):
            if name in computing:
                shared += 1
                if shared >= need:
                    return True
        return False

    def may_admit_next_step(self, num_leaving: int = 0) -> bool:
        """Whether the next :meth:`schedule`, with every running request decoding and
        ``num_leaving`` of them gone first, could admit a waiting request. False when none
        waits, when the running batch stays full, or while admissions wait out
        ``admit_interval``; True is conservative (pages may still be short)."""
        if not self.waiting:
            return False
        if len(self.running) - num_leaving >= self.config.max_running_requests:
            return False
        interval = self.config.admit_interval
        return not (interval > 1 and self._steps_since_admission + 1 < interval)

    def count_unscheduled_step(self) -> None:
        """A decode step the engine ran without :meth:`schedule` (overlapped decode launched
        it ahead, certain that :meth:`schedule` would give the same chunks and admit none)
        counts toward ``admit_interval`` as a scheduled one does."""
        self._steps_since_admission += 1

    def _defer_admission(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether waiting requests wait one more step: a pure decode step (no prompt chunk
        scheduled) within ``admit_interval`` steps of the last admission."""
        return (
            self.config.admit_interval > 1
            and bool(self.waiting)
            and bool(chunks)
            and all(not c.request.is_prefilling for c in chunks)
            and self._steps_since_admission < self.config.admit_interval
        )

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and return its pages (unless it keeps them); idempotent."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RESERVED:
            del self.reserved[request.request_id]
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if not request.keep_pages:
            self.release_pages(request)

    def share_prompt(self, request: Request) -> None:
        """Share the full pages of ``request``'s computed prompt through the prefix cache (when
        there is one) while it runs, so that requests with the same prompt admitted from now
        on reuse its KV instead of computing it again."""
        if self.prefix_cache is None or not request.pages:
            return
        computed = request.prompt_ids[: request.num_computed]
        held = request.num_cached_pages + request.num_shared_pages
        held = self.prefix_cache.share(computed, request.pages, held)
        request.num_shared_pages = held - request.num_cached_pages

    def release_pages(self, request: Request) -> None:
        """Return a request's pages: the full pages of its computed tokens (prompt and
        output) to the prefix cache, the rest freed."""
        if not request.pages:
            return
        pages = request.pages
        if self.prefix_cache is not None:
            computed = request.known_ids[: request.num_computed]
            held = request.num_cached_pages + request.num_shared_pages
            pages = self.prefix_cache.insert(computed, pages, held)
        self.allocator.free(pages)
        request.set_pages([])
        request.num_cached_pages = 0
        request.num_shared_pages = 0
