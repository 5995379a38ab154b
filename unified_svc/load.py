"""What a unified instance reports to routers, from its scheduler: a pure function."""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler import Scheduler


@dataclass(frozen=True)
class UnifiedLoad:
    free_pages: int  # for a new request: after every request already queued here is admitted
    total_pages: int
    running_requests: int  # running and waiting for admission
    waiting_requests: int  # queued in the engine, holding no pages yet


def unified_load(scheduler: Scheduler, total_pages: int) -> UnifiedLoad:
    """The pages a router may still count on. Requests waiting in the engine hold no pages
    yet but are admitted first (FIFO), so what they will take (prompt + ``max_new_tokens``
    each, capped at the context) is not free: a router that saw those pages free would send
    work that can only queue here."""
    waiting = list(scheduler.waiting)
    promised = sum(scheduler.pages_needed(r) for r in waiting)
    return UnifiedLoad(
        free_pages=max(0, scheduler.num_pages_available - promised),
        total_pages=total_pages,
        running_requests=len(scheduler.running) + len(waiting),
        waiting_requests=len(waiting),
    )
