"""The gateway's admission queue and its ledger of dispatched requests: pure state.

A request waits here, first in first out, until a target has room for it
(``routing.choose_target``): at most ``max_inflight`` requests are dispatched to instances,
and at most ``max_queued`` wait; beyond that the gateway refuses. Nothing here awaits or reads
a clock: callers pass ``now`` (monotonic seconds) and the latest loads, and apply the answers.

Loads are polled a few times a second, so the ledger corrects them for what this gateway did
since each report was asked for. A request is in a report when it reached the instance before
the report was asked for and ended after: a report asked for before a request started lacks
its pages (subtract them), and one asked for before a request ended still counts pages that
are free again (add them back). Other gateways' requests show up at the next poll. A prefill's
queue holds a prompt until prefill answers the request, which this gateway sees exactly, so
its own prompts not yet answered bound what it sends there.

With KV-aware routing (``prefix_weight`` > 0) targets are also scored by the prefix of the
prompt that each instance's cache holds (``MeshLoads.prefixes``, dsmesh/gateway/prefix_index.py),
while a prefill is still charged its whole prompt: its queue bound (``--max-queued-tokens``)
counts whole prompts, whatever its cache holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from dsmesh.gateway.prefix_index import PrefixIndex, PromptPages
from dsmesh.gateway.routing import (
    DecodeLoad,
    PrefillLoad,
    PrefixHits,
    Target,
    choose_target,
    could_ever_fit,
    largest_pool_tokens,
)


@dataclass(frozen=True)
class Ticket:
    """One request, as admission sees it."""

    request_id: str
    prompt_tokens: int
    # prompt + max_new_tokens, capped at the model's context: it must fit an idle pool, but
    # is charged only its prompt's pages and one more (DecodeLoad.pages_to_admit)
    total_tokens: int
    prompt: PromptPages | None = field(default=None, compare=False)  # for KV-aware routing


@dataclass(frozen=True)
class MeshLoads:
    """The latest load of every healthy instance, and when each was asked for (``asked_at``,
    monotonic seconds, by instance id)."""

    prefills: tuple[PrefillLoad, ...] = ()
    decodes: tuple[DecodeLoad, ...] = ()
    unifieds: tuple[DecodeLoad, ...] = ()
    asked_at: Mapping[str, float] = field(default_factory=dict)
    # the prefixes each instance's cache holds (a live view); None: not followed
    prefixes: PrefixIndex | None = field(default=None, compare=False)

    @property
    def routable(self) -> bool:
        """Some target exists: a unified instance, or a prefill and a decode."""
        return bool(self.unifieds) or (bool(self.prefills) and bool(self.decodes))

    def choose(self, ticket: Ticket, prefix_weight: float = 0.0) -> Target | None:
        """Where ``ticket`` goes now (``routing.choose_target``); with ``prefix_weight`` > 0
        and the prompt's pages known, KV-aware."""
        hits = None
        if prefix_weight > 0 and ticket.prompt is not None and self.prefixes is not None:
            ids = [x.instance_id for x in (*self.prefills, *self.decodes, *self.unifieds)]
            hits = PrefixHits(self.prefixes.hits(ticket.prompt, ids), prefix_weight)
        return choose_target(
            list(self.prefills),
            list(self.decodes),
            list(self.unifieds),
            ticket.prompt_tokens,
            ticket.total_tokens,
            hits,
        )

    def pages_for(self, target: Target, ticket: Ticket) -> int:
        """The pages ``ticket`` is charged on ``target``: those it takes when it starts."""
        instance = self._instance(target.instance_id)
        return instance.pages_to_admit(ticket.prompt_tokens, ticket.total_tokens)

    def charged(self, target: Target, prompt_tokens: int, pages: int) -> MeshLoads:
        """These loads after one more request went to ``target``."""
        return replace(
            self,
            prefills=tuple(
                replace(
                    p,
                    waiting_tokens=p.waiting_tokens + prompt_tokens,
                    running_requests=p.running_requests + 1,
                )
                if p.instance_id == target.prefill_id
                else p
                for p in self.prefills
            ),
            decodes=_charge(self.decodes, target.instance_id, pages, 1),
            unifieds=_charge(self.unifieds, target.instance_id, pages, 1),
        )

    def _instance(self, instance_id: str) -> DecodeLoad:
        for x in (*self.decodes, *self.unifieds):
            if x.instance_id == instance_id:
                return x
        raise KeyError(instance_id)


def _charge(
    loads: tuple[DecodeLoad, ...], instance_id: str, pages: int, requests: int
) -> tuple[DecodeLoad, ...]:
    return tuple(
        replace(
            x,
            free_pages=min(x.total_pages, max(0, x.free_pages - pages)),
            running_requests=max(0, x.running_requests + requests),
        )
        if x.instance_id == instance_id
        else x
        for x in loads
    )


# ---- errors --------------------------------------------------------------------------------


class AdmissionError(Exception):
    """A request is not admitted; the subclass says why."""


class QueueFull(AdmissionError):
    """The queue holds ``max_queued`` requests. ``unroutable``: no instance can serve now
    (a role has no healthy instance, e.g. while the supervisor restarts it), so the queue is
    full of requests waiting for one (UNAVAILABLE rather than RESOURCE_EXHAUSTED)."""

    def __init__(self, num_waiting: int, unroutable: bool = False) -> None:
        why = "; no instance can serve until one (re)starts" if unroutable else ""
        super().__init__(
            f"the gateway queue is full ({num_waiting} requests waiting{why}); retry later"
        )
        self.num_waiting = num_waiting
        self.unroutable = unroutable


class TooLarge(AdmissionError):
    """No instance could ever hold the request, even idle: its prompt with its first new
    token (``field`` "input_ids"), or prompt + max_new_tokens ("sampling.max_new_tokens")."""

    def __init__(self, total_tokens: int, largest_tokens: int, prompt_tokens: int = 0) -> None:
        if prompt_tokens:
            self.field = "input_ids"
            what = f"the prompt has {prompt_tokens} tokens; with its first new token it"
        else:
            self.field = "sampling.max_new_tokens"
            what = "prompt + max_new_tokens"
        super().__init__(
            f"{what} needs KV for {total_tokens} tokens but the largest instance holds "
            f"{largest_tokens}"
        )


class Unroutable(AdmissionError):
    """No instance to route to, for longer than the caller waits for one."""

    def __init__(self) -> None:
        super().__init__(
            "no healthy instance to route to: a unified instance, or a prefill and a decode"
        )


# ---- the ledger ----------------------------------------------------------------------------


@dataclass
class _Dispatched:
    target: Target
    prompt_tokens: int
    pages: int  # on the target's decode or unified instance
    started_at: float = math.inf  # when its call to the target began; inf: not yet
    ended_at: float | None = None
    held: bool = True  # it took its pages and slot (one refused for lack of them did not)
    prefilled: bool = False  # prefill answered: the request left prefill's queue


class Ledger:
    """Requests this gateway dispatched, until no report could still miscount them."""

    def __init__(self) -> None:
        self._entries: dict[str, _Dispatched] = {}

    @property
    def num_live(self) -> int:
        return sum(1 for e in self._entries.values() if e.ended_at is None)

    def __len__(self) -> int:
        return len(self._entries)

    def charge(self, request_id: str, target: Target, prompt_tokens: int, pages: int) -> None:
        self._entries[request_id] = _Dispatched(target, prompt_tokens, pages)

    def started(self, request_id: str, now: float) -> None:
        """The call to the target began: a report asked for from now on accounts for it
        (until then every report is assumed to lack it)."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.ended_at is None:
            entry.started_at = now

    def prefilled(self, request_id: str) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.prefilled = True

    def end(self, request_id: str, now: float, held: bool = True) -> bool:
        entry = self._entries.get(request_id)
        if entry is None or entry.ended_at is not None:
            return False
        entry.ended_at = now
        entry.held = held
        return True

    def corrected(self, loads: MeshLoads) -> MeshLoads:
        """``loads`` as they are now, by what this gateway did since each was asked for."""
        prefills = []
        for p in loads.prefills:
            asked = loads.asked_at.get(p.instance_id, -math.inf)
            mine = [
                e
                for e in self._entries.values()
                if e.target.prefill_id == p.instance_id and e.ended_at is None
                if not e.prefilled
            ]
            unreported = [e for e in mine if e.started_at >= asked]
            prefills.append(
                replace(
                    p,
                    waiting_tokens=max(
                        p.waiting_tokens + sum(e.prompt_tokens for e in unreported),
                        sum(e.prompt_tokens for e in mine),
                    ),
                    running_requests=max(p.running_requests + len(unreported), len(mine)),
                )
            )
        return replace(
            loads,
            prefills=tuple(prefills),
            decodes=tuple(self._correct(d, loads.asked_at) for d in loads.decodes),
            unifieds=tuple(self._correct(u, loads.asked_at) for u in loads.unifieds),
        )

    def _correct(self, load: DecodeLoad, asked_at: Mapping[str, float]) -> DecodeLoad:
        asked = asked_at.get(load.instance_id, -math.inf)
        pages = requests = 0
        for e in self._entries.values():
            if e.target.instance_id != load.instance_id:
                continue
            counted = e.started_at < asked and (e.ended_at is None or e.ended_at >= asked)
            if e.ended_at is None and not counted:
                pages, requests = pages + e.pages, requests + 1
            elif e.ended_at is not None and counted and e.held:
                pages, requests = pages - e.pages, requests - 1
        if not pages and not requests:
            return load
        return _charge((load,), load.instance_id, pages, requests)[0]

    def prune(self, asked_at: Mapping[str, float]) -> None:
        """Forget ended requests that every current report of their instances has seen end
        (or that never started)."""

        def settled(e: _Dispatched) -> bool:
            if e.ended_at is None:
                return False
            if e.started_at == math.inf:
                return True
            ids = [e.target.instance_id, e.target.prefill_id]
            return all(asked_at.get(i, math.inf) > e.ended_at for i in ids if i is not None)

        for request_id in [r for r, e in self._entries.items() if settled(e)]:
            del self._entries[request_id]


# ---- the queue -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Pumped:
    """What one :meth:`AdmissionQueue.pump` decided: requests to send now, and requests that
    leave the queue with an error."""

    dispatched: list[tuple[Ticket, Target]] = field(default_factory=list)
    failed: list[tuple[Ticket, AdmissionError]] = field(default_factory=list)


class AdmissionQueue:
    """``prefix_weight``: what a cached prompt token weighs against a token of load in
    routing (``routing.PrefixHits``); 0 routes by load alone."""

    def __init__(self, max_inflight: int, max_queued: int, prefix_weight: float = 0.0) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.prefix_weight = prefix_weight
        self.ledger = Ledger()
        self._waiting: dict[str, tuple[Ticket, float]] = {}  # arrival order; value: since
        self._unroutable_since: float | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_dispatched(self) -> int:
        return self.ledger.num_live

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def submit(
        self, ticket: Ticket, loads: MeshLoads, now: float, first: bool = False
    ) -> Target | None:
        """A new request: its target when it can go at once (nobody waits ahead of it and a
        target has room), else None and it waits. Raises :class:`TooLarge` when no instance
        could ever hold it, :class:`QueueFull` when ``max_queued`` requests wait already.

        ``first``: a request admitted before whose instance refused it for room before doing
        any work (decode's ``--reserve-wait``); it goes back to the head of the queue, past
        the ``max_queued`` bound, since it was accepted already."""
        self._check_fits(ticket, loads)
        if (first or not self._waiting) and loads.routable:
            target = self._try_dispatch(ticket, self.ledger.corrected(loads))
            if target is not None:
                return target
        if first:
            self._waiting = {ticket.request_id: (ticket, now), **self._waiting}
        else:
            if len(self._waiting) >= self.max_queued:
                raise QueueFull(len(self._waiting), unroutable=not loads.routable)
            self._waiting[ticket.request_id] = (ticket, now)
        if not loads.routable and self._unroutable_since is None:
            self._unroutable_since = now
        return None

    def pump(self, loads: MeshLoads, now: float, route_wait_s: float) -> Pumped:
        """Dispatch waiting requests in arrival order while the first one fits (none passes
        it). Requests that no instance can hold any more fail with :class:`TooLarge`; when
        no target has existed for ``route_wait_s`` (counted from when each request came, at
        the earliest), waiting requests fail with :class:`Unroutable`."""
        self.ledger.prune(loads.asked_at)
        out = Pumped()
        if not self._waiting:
            self._unroutable_since = None if loads.routable else self._unroutable_since
            return out
        if not loads.routable:
            if self._unroutable_since is None:
                self._unroutable_since = now
            for request_id, (ticket, since) in list(self._waiting.items()):
                if now - max(since, self._unroutable_since) >= route_wait_s:
                    del self._waiting[request_id]
                    out.failed.append((ticket, Unroutable()))
            return out
        self._unroutable_since = None
        view = self.ledger.corrected(loads)
        for request_id, (ticket, _) in list(self._waiting.items()):
            try:
                self._check_fits(ticket, loads)
            except TooLarge as exc:
                del self._waiting[request_id]
                out.failed.append((ticket, exc))
                continue
            target = self._try_dispatch(ticket, view)
            if target is None:
                break
            del self._waiting[request_id]
            view = view.charged(target, ticket.prompt_tokens, view.pages_for(target, ticket))
            out.dispatched.append((ticket, target))
        return out

    def started(self, request_id: str, now: float) -> None:
        self.ledger.started(request_id, now)

    def prefilled(self, request_id: str) -> None:
        self.ledger.prefilled(request_id)

    def release(self, request_id: str, now: float, held: bool = True) -> None:
        """The request is over: it leaves the queue, or its dispatch ends (``held``: it took
        its pages)."""
        if self._waiting.pop(request_id, None) is None:
            self.ledger.end(request_id, now, held)

    def _try_dispatch(self, ticket: Ticket, view: MeshLoads) -> Target | None:
        if self.ledger.num_live >= self.max_inflight:
            return None
        target = view.choose(ticket, self.prefix_weight)
        if target is not None:
            pages = view.pages_for(target, ticket)
            self.ledger.charge(ticket.request_id, target, ticket.prompt_tokens, pages)
        return target

    @staticmethod
    def _check_fits(ticket: Ticket, loads: MeshLoads) -> None:
        if not loads.routable:
            return  # nothing to judge by yet
        pools = (list(loads.prefills), list(loads.decodes), list(loads.unifieds))
        first = ticket.prompt_tokens + 1
        if not could_ever_fit(*pools, first):
            raise TooLarge(first, largest_pool_tokens(*pools), ticket.prompt_tokens)
        if not could_ever_fit(*pools, ticket.total_tokens):
            raise TooLarge(ticket.total_tokens, largest_pool_tokens(*pools))
