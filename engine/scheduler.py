"""Continuous batching with chunked prefill under a per-step token budget.

Each step: every decoding request gets one token; prefilling requests (oldest first) get
prompt chunks from what remains of ``max_batch_tokens``; then waiting requests are admitted in
arrival order while pages and running slots allow. A request reserves KV pages for its whole
life (prompt + ``max_new_tokens``, capped at the context) when admitted, so a running request
never stalls or gets evicted for lack of memory; admission waits instead. With a prefix
cache, a request's leading full prompt pages may be shared with earlier requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.kv_cache import OutOfPagesError, PageAllocator, pages_for
from engine.prefix_cache import PrefixCache
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    max_running_requests: int = 64
    max_batch_tokens: int = 2048  # new tokens per forward; also the prefill chunk size
    prefix_cache: bool = False


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.prefix_cache = (
            PrefixCache(allocator, config.page_size) if config.prefix_cache else None
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def pages_needed(self, request: Request) -> int:
        return pages_for(request.max_total_tokens, self.config.page_size)

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
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def assign_pages(self, request: Request) -> bool:
        """Give ``request`` its pages (cached prefix first); False, holding nothing, if short."""
        matched = self.prefix_cache.match(request.prompt_ids) if self.prefix_cache else []
        need = self.pages_needed(request) - len(matched)
        if need > self.allocator.num_free_pages and self.prefix_cache is not None:
            self.prefix_cache.evict(need - self.allocator.num_free_pages)
        if not self.allocator.can_allocate(need):
            if self.prefix_cache is not None:
                self.prefix_cache.release(matched)
            return False
        request.pages = matched + self.allocator.allocate(need)
        request.page_table = torch.tensor(request.pages, dtype=torch.int64)
        request.num_cached_pages = len(matched)
        request.num_computed = len(matched) * self.config.page_size
        return True

    def reserve(self, request: Request) -> None:
        """Pages now, scheduling later (decode instance waiting for prefill's KV)."""
        if not self.assign_pages(request):
            raise OutOfPagesError(
                f"need {self.pages_needed(request)} KV pages, {self.num_pages_available} available"
            )
        request.status = RequestStatus.RESERVED

    def start_reserved(self, request: Request) -> None:
        """A reserved request whose prompt KV has arrived joins the running batch."""
        if request.status is not RequestStatus.RESERVED:
            raise ValueError(f"request {request.request_id} is not reserved")
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        for req in self.running:
            if not req.is_prefilling:
                chunks.append(ScheduledChunk(req, 1))
                budget -= 1
        for req in self.running:
            if req.is_prefilling and budget > 0:
                n = min(req.num_pending, budget)
                chunks.append(ScheduledChunk(req, n))
                budget -= n
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_running_requests
            and self.assign_pages(self.waiting[0])
        ):
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            n = min(req.num_pending, budget)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        return chunks

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and return its pages (unless it keeps them); idempotent."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if not request.keep_pages:
            self.release_pages(request)

    def release_pages(self, request: Request) -> None:
        """Return a request's pages: full prompt pages to the prefix cache, the rest freed."""
        if not request.pages:
            return
        pages = request.pages
        if self.prefix_cache is not None:
            computed_prompt = request.prompt_ids[
                : min(request.num_computed, len(request.prompt_ids))
            ]
            pages = self.prefix_cache.insert(computed_prompt, pages, request.num_cached_pages)
        self.allocator.free(pages)
        request.pages = []
        request.page_table = None
        request.num_cached_pages = 0
