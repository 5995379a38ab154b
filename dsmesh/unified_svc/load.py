"""What a unified instance reports to routers, from its engine's load: a pure function."""

from __future__ import annotations

from dataclasses import dataclass

from dsmesh.engine.sched.load_report import EngineLoad


@dataclass(frozen=True)
class UnifiedLoad:
    free_pages: int  # for a new request: after every request already queued here is admitted
    total_pages: int
    running_requests: int  # running and waiting for admission
    waiting_requests: int  # queued in the engine, holding no pages yet


def unified_load(load: EngineLoad) -> UnifiedLoad:
    """The pages a router may still count on. Requests waiting in the engine hold no pages
    yet but are admitted first (FIFO), so what they will take (prompt + ``max_new_tokens``
    each, capped at the context) is not free: a router that saw those pages free would send
    work that can only queue here."""
    return UnifiedLoad(
        free_pages=max(0, load.free_pages - load.waiting_pages),
        total_pages=load.total_pages,
        running_requests=load.num_running + load.num_waiting,
        waiting_requests=load.num_waiting,
    )
