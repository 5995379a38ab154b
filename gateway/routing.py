"""Where a request runs, from reported load: pure policies.

A request runs either on a (prefill, decode) pair or on a unified instance (prefill and
decode in one engine). Decode and unified instances report the same load (``DecodeLoad``): the
KV pages a request holds for its whole life are taken there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillLoad:
    instance_id: str
    waiting_tokens: int
    running_requests: int
    max_queued_tokens: int = 0  # prompt tokens it admits unfinished; 0: unknown, no check

    def has_room(self, prompt_tokens: int) -> bool:
        """Whether it admits a prompt of ``prompt_tokens`` now: within its queue bound, or
        idle (an idle prefill takes a prompt of any length, so a long one is not refused
        forever)."""
        if not self.max_queued_tokens:
            return True
        idle = self.waiting_tokens == 0 and self.running_requests == 0
        return idle or self.waiting_tokens + prompt_tokens <= self.max_queued_tokens


@dataclass(frozen=True)
class DecodeLoad:
    """A decode or unified instance. ``free_pages`` already excludes what requests queued
    inside the instance will take."""

    instance_id: str
    free_pages: int
    total_pages: int
    running_requests: int
    page_size: int = 0  # 0: unknown (an older instance)
    max_running_requests: int = 0  # requests it holds at most; 0: unknown, no check

    def pages_for(self, tokens: int) -> int:
        """KV pages a request of ``tokens`` takes here (at least 1 when unknown)."""
        return -(-tokens // self.page_size) if self.page_size else 1

    @property
    def free_tokens(self) -> int:
        """Free room in tokens, comparable across page sizes."""
        return self.free_pages * max(self.page_size, 1)

    def has_room(self, total_tokens: int) -> bool:
        """A free slot, and free pages for ``total_tokens``."""
        if self.max_running_requests and self.running_requests >= self.max_running_requests:
            return False
        return self.pages_for(total_tokens) <= self.free_pages

    def could_hold(self, total_tokens: int) -> bool:
        """Whether the whole pool, idle, holds a request of ``total_tokens``."""
        return self.pages_for(total_tokens) <= self.total_pages


@dataclass(frozen=True)
class Target:
    """Where one request runs: ``instance_id`` is the decode or unified instance that holds
    its pages and streams its tokens; ``prefill_id`` is set for a pair, None for unified."""

    instance_id: str
    prefill_id: str | None = None

    @property
    def unified(self) -> bool:
        return self.prefill_id is None


def choose_prefill(loads: list[PrefillLoad]) -> PrefillLoad | None:
    """Least waiting prompt tokens, then fewest requests, then id (deterministic)."""
    if not loads:
        return None
    return min(loads, key=lambda x: (x.waiting_tokens, x.running_requests, x.instance_id))


def choose_decode(loads: list[DecodeLoad], pages_needed: int = 0) -> DecodeLoad | None:
    """Among instances with room for the request, most free pages, then fewest running."""
    if not loads:
        return None
    fitting = [x for x in loads if x.free_pages >= pages_needed] or loads
    return min(fitting, key=lambda x: (-x.free_pages, x.running_requests, x.instance_id))


def choose_target(
    prefills: list[PrefillLoad],
    decodes: list[DecodeLoad],
    unifieds: list[DecodeLoad],
    prompt_tokens: int,
    total_tokens: int,
) -> Target | None:
    """A target with room for a request of ``prompt_tokens`` prompt and ``total_tokens``
    prompt + new tokens (capped at the model's context), or None when none has room now.

    Among decode and unified instances with a free slot and free pages for ``total_tokens``,
    the one with
    the most free tokens, then the fewest running requests, then the smallest id; a decode
    counts only when some prefill has room for the prompt, and gets the least loaded of
    those (``choose_prefill``).
    """
    prefill = choose_prefill([p for p in prefills if p.has_room(prompt_tokens)])
    candidates = [(u, True) for u in unifieds if u.has_room(total_tokens)]
    if prefill is not None:
        candidates += [(d, False) for d in decodes if d.has_room(total_tokens)]
    if not candidates:
        return None
    best, unified = min(
        candidates, key=lambda c: (-c[0].free_tokens, c[0].running_requests, c[0].instance_id)
    )
    if unified:
        return Target(best.instance_id)
    assert prefill is not None
    return Target(best.instance_id, prefill.instance_id)


def largest_pool_tokens(
    prefills: list[PrefillLoad], decodes: list[DecodeLoad], unifieds: list[DecodeLoad]
) -> int:
    """Tokens the largest pool that can serve a request holds (decodes count only beside a
    prefill); 0 when no instance can serve."""
    pools = list(unifieds) + (list(decodes) if prefills else [])
    return max((x.total_pages * max(x.page_size, 1) for x in pools), default=0)


def largest_request_tokens(
    prefills: list[PrefillLoad], decodes: list[DecodeLoad], unifieds: list[DecodeLoad]
) -> int | None:
    """The most tokens (prompt + new) one request can take on some instance that can serve
    (decodes count only beside a prefill): its whole pool. None when unknown: no such
    instance, or one of unknown page size (which ``could_hold`` lets take any request)."""
    pools = list(unifieds) + (list(decodes) if prefills else [])
    if not pools or any(not x.page_size for x in pools):
        return None
    return max(x.total_pages * x.page_size for x in pools)


def could_ever_fit(
    prefills: list[PrefillLoad],
    decodes: list[DecodeLoad],
    unifieds: list[DecodeLoad],
    total_tokens: int,
) -> bool:
    """Whether some instance that can serve holds ``total_tokens`` when idle."""
    pools = list(unifieds) + (list(decodes) if prefills else [])
    return any(x.could_hold(total_tokens) for x in pools)
