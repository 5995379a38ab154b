"""Continuous batching with chunked prefill under a per-step token budget.

Each step: every decoding request gets one token; prefilling requests (oldest first) get
prompt chunks from what remains of ``max_batch_tokens``; then waiting requests are admitted in
arrival order while pages and running slots allow. A request reserves KV pages for its whole
life (prompt + ``max_new_tokens``, capped at the context) when admitted, so a running request
never stalls or gets evicted for lack of memory; admission waits instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.kv_cache import PageAllocator, pages_for
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    max_running_requests: int = 64
    max_batch_tokens: int = 2048  # new tokens per forward; also the prefill chunk size


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def pages_needed(self, request: Request) -> int:
        return pages_for(request.max_total_tokens, self.config.page_size)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
            and self.allocator.can_allocate(self.pages_needed(self.waiting[0]))
        ):
            req = self.waiting.popleft()
            req.pages = self.allocator.allocate(self.pages_needed(req))
            req.page_table = torch.tensor(req.pages, dtype=torch.int64)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            n = min(req.num_pending, budget)
            chunks.append(ScheduledChunk(req, n))
            budget -= n
        return chunks

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and return its pages; safe to call once per request."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.allocator.free(request.pages)
        else:
            self.waiting.remove(request)
        request.pages = []
        request.page_table = None
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
