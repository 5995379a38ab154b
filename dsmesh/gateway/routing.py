"""Where a request runs, from reported load and prefix caches: pure policies.

A request runs either on a (prefill, decode) pair or on a unified instance (prefill and
decode in one engine). Decode and unified instances report the same load (``DecodeLoad``) and
take a request's KV pages the same way: its prompt's when it starts, then more as its tokens
need them, retracting their newest requests when short (docs/ENGINE.md). So a request is
charged its prompt's pages and one to grow into, never its ``max_new_tokens``: clients that
omit ``max_tokens`` (up to the context) run at the concurrency of their prompts. Its whole
life must fit an idle pool (``could_ever_fit``).

KV-aware routing: prefill, decode and unified instances hold a prefix cache. A prompt whose
leading tokens a prefill or unified instance holds costs it fewer tokens to prefill; a decode
that holds them (it kept an earlier turn of the conversation) receives only the pages after
them. ``PrefixHits`` says how many leading tokens of the prompt each instance holds
(dsmesh/gateway/prefix_index.py) and what a cached token is worth against load, as NVIDIA Dynamo's
KV router weighs prefill tokens against active KV blocks: a cached token counts as ``weight``
tokens of queued prefill work less on a prefill, and as ``weight`` more free KV tokens on a
decode or unified instance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Why a target was chosen (the gateway counts decisions by reason).
PREFIX = "prefix"  # the instance holding the longest prefix of the prompt
LOAD = "load"  # another instance held a longer prefix, but this one's lower load won
NO_PREFIX = "no_prefix"  # no instance that could serve holds any of the prompt: load alone
PREFIX_OFF = "prefix_off"  # KV-aware routing is off: load alone
REASONS = (PREFIX, LOAD, NO_PREFIX, PREFIX_OFF)


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

    def pages_to_admit(self, prompt_tokens: int, total_tokens: int) -> int:
        """KV pages a request takes here when it starts: its prompt's and one to grow into,
        at most those of its whole life (``total_tokens``, prompt + new tokens)."""
        return min(self.pages_for(prompt_tokens) + 1, self.pages_for(total_tokens))

    @property
    def free_tokens(self) -> int:
        """Free room in tokens, comparable across page sizes."""
        return self.free_pages * max(self.page_size, 1)

    def has_room(self, prompt_tokens: int, total_tokens: int) -> bool:
        """A free slot, and free pages to start the request (``pages_to_admit``)."""
        if self.max_running_requests and self.running_requests >= self.max_running_requests:
            return False
        return self.pages_to_admit(prompt_tokens, total_tokens) <= self.free_pages

    def could_hold(self, total_tokens: int) -> bool:
        """Whether the whole pool, idle, holds a request of ``total_tokens``."""
        return self.pages_for(total_tokens) <= self.total_pages


@dataclass(frozen=True)
class PrefixHits:
    """Leading prompt tokens each instance's prefix cache holds (absent: none), and what one
    cached token weighs against a token of load (> 0)."""

    cached_tokens: Mapping[str, int]
    weight: float = 1.0

    def of(self, instance_id: str) -> int:
        return self.cached_tokens.get(instance_id, 0)


@dataclass(frozen=True)
class Target:
    """Where one request runs: ``instance_id`` is the decode or unified instance that holds
    its pages and streams its tokens; ``prefill_id`` is set for a pair, None for unified.
    ``cached_tokens``: prompt tokens the instance that prefills it is expected to hold;
    ``reason``: why it was chosen (one of :data:`REASONS`)."""

    instance_id: str
    prefill_id: str | None = None
    cached_tokens: int = field(default=0, compare=False)
    reason: str = field(default=PREFIX_OFF, compare=False)

    @property
    def unified(self) -> bool:
        return self.prefill_id is None


def choose_prefill(loads: list[PrefillLoad], hits: PrefixHits | None = None) -> PrefillLoad | None:
    """Least queued prefill work: waiting prompt tokens, less ``hits.weight`` per cached
    token of this prompt; then fewest requests, then id (deterministic)."""
    if not loads:
        return None

    def cost(x: PrefillLoad) -> tuple[float, int, str]:
        cached = hits.weight * hits.of(x.instance_id) if hits is not None else 0.0
        return (x.waiting_tokens - cached, x.running_requests, x.instance_id)

    return min(loads, key=cost)


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
    hits: PrefixHits | None = None,
) -> Target | None:
    """A target with room for a request of ``prompt_tokens`` prompt and ``total_tokens``
    prompt + new tokens (capped at the model's context), or None when none has room now.

    Among decode and unified instances with a free slot and free pages to start it (its
    prompt's and one more: ``DecodeLoad.pages_to_admit``), the one with the most free tokens
    (plus ``hits.weight`` per cached token of the prompt), then the fewest running requests,
    then the smallest id. A decode counts only when some prefill has room for the prompt,
    and gets the one with the least queued work (``choose_prefill``). Without ``hits``
    (KV-aware routing off), load alone.
    """
    roomy_prefills = [p for p in prefills if p.has_room(prompt_tokens)]
    prefill = choose_prefill(roomy_prefills, hits)
    roomy_unifieds = [u for u in unifieds if u.has_room(prompt_tokens, total_tokens)]
    roomy_decodes = (
        [d for d in decodes if d.has_room(prompt_tokens, total_tokens)] if prefill else []
    )
    if not roomy_unifieds and not roomy_decodes:
        return None

    def held(instance_id: str) -> int:
        return hits.of(instance_id) if hits is not None else 0

    weight = hits.weight if hits is not None else 0.0
    unified_ids = {u.instance_id for u in roomy_unifieds}
    best = min(
        roomy_unifieds + roomy_decodes,
        key=lambda x: (
            # a unified instance's cached tokens are prefill work and pages saved; a decode's
            # (its cache kept an earlier turn) are pages it neither takes nor receives
            -(x.free_tokens + weight * held(x.instance_id)),
            x.running_requests,
            x.instance_id,
        ),
    )
    # the instances that could have prefilled it: unified ones with room, and the prefills
    # with room when a pair could take it
    servers = [u.instance_id for u in roomy_unifieds]
    servers += [p.instance_id for p in roomy_prefills] if roomy_decodes else []
    longest = max((held(i) for i in servers), default=0)
    if best.instance_id in unified_ids:
        chosen = held(best.instance_id)
        return Target(best.instance_id, None, chosen, _reason(hits, chosen, longest))
    assert prefill is not None
    chosen = held(prefill.instance_id)
    return Target(best.instance_id, prefill.instance_id, chosen, _reason(hits, chosen, longest))


def _reason(hits: PrefixHits | None, chosen: int, longest: int) -> str:
    if hits is None:
        return PREFIX_OFF
    if longest == 0:
        return NO_PREFIX
    return PREFIX if chosen == longest else LOAD


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
