"""Pick a (prefill, decode) pair from reported load: a pure policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillLoad:
    instance_id: str
    waiting_tokens: int
    running_requests: int


@dataclass(frozen=True)
class DecodeLoad:
    instance_id: str
    free_pages: int
    total_pages: int
    running_requests: int
    page_size: int = 0  # 0: unknown (an older instance)

    def pages_for(self, tokens: int) -> int:
        """KV pages a request of ``tokens`` takes here (at least 1 when unknown)."""
        return -(-tokens // self.page_size) if self.page_size else 1


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
