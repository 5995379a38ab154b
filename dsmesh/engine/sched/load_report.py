"""What an engine holds right now, for load reports and metrics: a frozen snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from dsmesh.engine.sched.scheduler import Scheduler


@dataclass(frozen=True)
class EngineLoad:
    total_pages: int  # the KV pool
    free_pages: int  # free now (idle prefix-cache pages count as free)
    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued for admission, holding no pages yet
    # pages those will take when admitted: their known tokens (prompt, and output after a
    # retraction); a reserve_all request's whole life (prompt + max_new_tokens)
    waiting_pages: int
    pending_prompt_tokens: int  # prefill tokens not computed yet: queued or mid-prefill

    @property
    def room_pages(self) -> int:
        """Pages a new request may count on: free pages less what the requests queued here
        take first (FIFO), so a router does not send work that can only queue."""
        return max(0, self.free_pages - self.waiting_pages)

    @property
    def used_pages(self) -> int:
        """Pages held by requests."""
        return self.total_pages - self.free_pages


def engine_load(scheduler: Scheduler, total_pages: int) -> EngineLoad:
    """The load of ``scheduler``'s engine. Safe from another thread (a metrics scrape): the
    queues are copied first, in one step each, and a request's counters are plain reads."""
    running = list(scheduler.running)
    waiting = list(scheduler.waiting)
    pending = sum(r.num_pending for r in running if r.is_prefilling)
    pending += sum(r.num_pending for r in waiting)  # a retracted one recomputes its output too
    return EngineLoad(
        total_pages=total_pages,
        free_pages=scheduler.num_pages_available,
        num_running=len(running),
        num_waiting=len(waiting),
        waiting_pages=sum(scheduler.pages_to_admit(r) for r in waiting),
        pending_prompt_tokens=pending,
    )
