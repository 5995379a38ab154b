"""Decode's side of the KV handoff as plain Python: one :class:`DecodeHandoff` per request, in
a :class:`DecodeHandoffs` table that also keeps the line for pages (arrival order).

    RESERVING --pages--> REGISTERING --Reserve--> WAITING --DONE--> DECODING --last token--> ENDED
        |                     |                      |                  |
        +---------------------+----------------------+------------------+---> ENDED (early)

The rule it keeps: a request's pages are reused only once no prefill can write them. Prefill
can write from its Resolve until it commits or releases the handoff (kv_broker's
``prefill_released``). A broker that cannot say proves nothing, so the pages then wait out the
release quarantine.

No gRPC, no asyncio, no clock: methods that need the time take ``now`` (seconds, any monotonic
origin). A failed call raises :class:`CallFailed` with the status it answers; how its pages come
back is a :class:`Release` that the servicer carries out.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from dsmesh.engine.kv.prefix_hashes import prefix_name
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.instance.failures import CallFailed, Code, already_active, handoff_failed
from dsmesh.v1 import kv_broker_pb2 as kb

ROOM_POLL_S = 0.05  # a request waiting for pages tries again this often (frees not announced)
UNKNOWN_PREFILL = "unknown"  # a handoff's prefill when the broker could not be asked


class Phase(enum.Enum):
    RESERVING = "reserving"  # in line for pages and a running slot
    REGISTERING = "registering"  # pages held; Reserve sent to kv_broker
    WAITING = "waiting"  # registered; waiting for prefill's commit
    DECODING = "decoding"  # the handoff is DONE: the request is in the running batch (or
    # retracted from it for lack of pages, waiting to recompute here)
    ENDED = "ended"  # the call is over; its pages come back as ``release`` says


class Release(enum.Enum):
    """How a request's pages come back once its call is over."""

    NONE = "none"  # nothing to give back: no page taken, or the engine freed them
    NOW = "now"  # free them now: no prefill can be writing them
    AFTER_PREFILL = "after_prefill"  # once kv_broker says prefill released them, or after
    # the quarantine
    QUARANTINE = "quarantine"  # after the whole quarantine: kv_broker cannot say
    ABORT_FIRST = "abort_first"  # tell kv_broker the handoff is ABORTED; its answer decides
    # (DecodeHandoff.after_abort)


@dataclass(frozen=True)
class Reservation:
    """The pages the engine gave a request, in token order. The first ``cached_pages`` hold
    its prompt's KV already: the prefix cache kept them from an earlier request (a previous
    turn of the conversation), the request shares them by reference, and prefill writes none
    of them. The engine matches whole pages and leaves at least the last prompt token to
    compute, so prefill always writes the rest."""

    page_ids: list[int]
    cached_pages: int = 0

    def cached_prefix(self, prompt: list[int], page_size: int) -> int:
        """The name kv_broker carries to prefill for the cached pages: the chained page hash
        of their tokens, which prefill checks against its own prompt."""
        return prefix_name(prompt, self.cached_pages, page_size)


@dataclass(frozen=True)
class HandoffEnd:
    """What kv_broker says of a handoff: its ``HandoffStatus`` as plain values."""

    state: int  # kb.HandoffState
    cause: int = kb.CAUSE_UNSPECIFIED  # kb.HandoffCause
    message: str = ""
    first_token_id: int = 0
    first_token_logprobs: TokenLogprobs | None = None  # when the request asks for logprobs
    draft_token_ids: tuple[int, ...] = ()  # prefill's drafts after the first token (MTP)
    bytes_written: int = 0
    prefill_instance_id: str = ""  # "" while no prefill resolved it
    prefill_released: bool = False

    @property
    def terminal(self) -> bool:
        return self.state not in (kb.HANDOFF_RESERVED, kb.HANDOFF_TRANSFERRING)

    @property
    def prefill_may_write(self) -> bool:
        """A prefill resolved the handoff and has not said it stopped writing."""
        return bool(self.prefill_instance_id) and not self.prefill_released


def broker_unreachable(code: str) -> HandoffEnd:
    """How a handoff ends for decode when kv_broker stops answering (``code``: the gRPC status
    name of the failed call): FAILED, and no telling whether prefill is still writing."""
    return HandoffEnd(
        kb.HANDOFF_FAILED,
        kb.CAUSE_BROKER_UNREACHABLE,
        f"kv_broker unreachable: {code}",
        prefill_instance_id=UNKNOWN_PREFILL,
    )


class DecodeHandoff:
    """One Decode call, from its arrival to the return of its pages."""

    def __init__(self, request_id: str, room_deadline: float, quarantine_s: float) -> None:
        self.request_id = request_id
        self.phase = Phase.RESERVING
        self.room_deadline = room_deadline  # in line for pages until then
        self.release = Release.NONE  # once ENDED
        self._quarantine_s = quarantine_s
        self._quarantine_ends: float | None = None
        self._may_write = False  # the call was cancelled mid-handoff: prefill may be writing
        # Decode's Abort found the request reserved, not yet in the running batch. Set and
        # read on the engine thread only, so the activation cannot slip past the Abort.
        self.aborted = False
        # An engine command reserving for it is running (DecodeHandoffs.wait_for_room), and
        # one ever was: the engine may hold pages for it whatever ends its call.
        self.engine_reserving = False
        self._engine_asked = False

    def reserving(self) -> None:
        """An engine command reserves pages for the request now; it waits for the answer,
        past its room deadline if need be (the engine may be granting them)."""
        self._expect(Phase.RESERVING)
        self.engine_reserving = self._engine_asked = True

    def reserve_answered(self) -> None:
        """The engine command that reserved for the request has returned."""
        self.engine_reserving = False

    def reserved(self) -> None:
        """The engine gave the request its pages and a running slot."""
        self._expect(Phase.RESERVING)
        self.phase = Phase.REGISTERING

    def refused(self, code: str, details: str) -> CallFailed:
        """kv_broker refused the Reserve call with the gRPC status named ``code``."""
        self._expect(Phase.REGISTERING)
        message = f"kv_broker refused the reservation: {details}"
        if code in ("ALREADY_EXISTS", "INVALID_ARGUMENT"):
            # Certainly not registered, so no prefill can write into our pages; a handoff of
            # this id is not ours to abort (it may be a live duplicate's).
            self._end(Release.NOW)
            return CallFailed(Code[code], message)
        # The reservation may have reached the broker (a lost answer): the call's end aborts it
        # there, and the pages wait for prefill if it resolved the reservation meanwhile.
        if code == "ABORTED":  # the request was aborted before it got here
            return CallFailed(Code.CANCELLED, message)
        return CallFailed(Code.UNAVAILABLE, message)

    def registered(self) -> None:
        self._expect(Phase.REGISTERING)
        self.phase = Phase.WAITING

    def ended(self, end: HandoffEnd) -> int:
        """The handoff is over. DONE: the first token, and the request decodes. Otherwise
        raises the call's failure; the pages come back once prefill can no longer write."""
        self._expect(Phase.WAITING)
        if end.state == kb.HANDOFF_DONE:
            self.phase = Phase.DECODING
            return end.first_token_id
        self._end(Release.AFTER_PREFILL if end.prefill_may_write else Release.NOW)
        raise handoff_failed(end.state, end.cause, end.message)

    def abort_before_start(self) -> None:
        """The client aborted the request while its pages are reserved and it has not joined
        the running batch: a handoff that still ends DONE ends the request "abort" at its
        activation, which frees the pages, instead of decoding it (engine thread)."""
        self.aborted = True

    def finished(self) -> None:
        """The last token is out; the engine freed the pages."""
        self._expect(Phase.DECODING)
        self._end(Release.NONE)

    def call_ended(self, cancelled: bool) -> Release:
        """The Decode call is over (finished, failed, or ``cancelled`` by its client): how
        its pages come back."""
        if self.phase is Phase.ENDED:
            return self.release
        if self.phase is Phase.RESERVING:
            # An engine command may have taken pages for it (asked to reserve, or cancelled
            # while a command for the line was on its way), whether the call was cancelled
            # or gave up: commands run in order, so a free after it gives them back.
            self._end(Release.NOW if cancelled or self._engine_asked else Release.NONE)
        elif self.phase is Phase.DECODING:
            self._end(Release.NOW)  # DONE: prefill's last write landed before its commit
        else:
            self._may_write = cancelled  # mid-handoff: prefill may have resolved it
            self._end(Release.ABORT_FIRST)
        return self.release

    def after_abort(self, answer: HandoffEnd | None) -> Release:
        """How the pages come back, from kv_broker's answer to the abort (None: no answer)."""
        if answer is None:
            return Release.QUARANTINE if self._may_write else Release.NOW
        writing = self._may_write or bool(answer.prefill_instance_id)
        if writing and not answer.prefill_released and answer.state != kb.HANDOFF_DONE:
            return Release.AFTER_PREFILL
        return Release.NOW

    def keep_waiting(self, now: float, released: bool) -> bool:
        """AFTER_PREFILL: ask kv_broker again? ``released``: its last answer (False also when it
        could not say). The first call starts the quarantine, and nothing waits past it."""
        if released:
            return False
        if self._quarantine_ends is None:
            self._quarantine_ends = now + self._quarantine_s
        return now < self._quarantine_ends

    def _end(self, release: Release) -> None:
        self.phase = Phase.ENDED
        self.release = release

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"request {self.request_id}: {self.phase.value}, not {phase.value}")


class DecodeHandoffs:
    """This instance's Decode calls by request id, and the line for pages: a request takes
    pages only when every request that arrived before it has them, for up to
    ``reserve_wait_s``. An id stays taken until its pages are back."""

    def __init__(self, reserve_wait_s: float, release_quarantine_s: float) -> None:
        self.reserve_wait_s = reserve_wait_s
        self.release_quarantine_s = release_quarantine_s
        self._calls: dict[str, DecodeHandoff] = {}
        self._line: deque[DecodeHandoff] = deque()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._calls

    @property
    def num_waiting(self) -> int:
        """Requests registered with kv_broker, waiting for prefill's commit."""
        return sum(1 for h in self._calls.values() if h.phase is Phase.WAITING)

    @property
    def num_in_line(self) -> int:
        """Requests waiting for pages or a running slot."""
        return len(self._line)

    def open(self, request_id: str, now: float) -> DecodeHandoff:
        """A new call takes its place in line; ALREADY_EXISTS while the id is taken."""
        if request_id in self._calls:
            raise already_active(request_id)
        handoff = DecodeHandoff(request_id, now + self.reserve_wait_s, self.release_quarantine_s)
        self._calls[request_id] = handoff
        self._line.append(handoff)
        return handoff

    def close(self, handoff: DecodeHandoff) -> None:
        """Its pages are back: the id is free again."""
        self.leave_line(handoff)
        if self._calls.get(handoff.request_id) is handoff:
            del self._calls[handoff.request_id]

    def get(self, request_id: str) -> DecodeHandoff | None:
        return self._calls.get(request_id)

    @property
    def line(self) -> list[DecodeHandoff]:
        """The requests waiting for pages or a running slot, first come first."""
        return list(self._line)

    def first_in_line(self, handoff: DecodeHandoff) -> bool:
        return bool(self._line) and self._line[0] is handoff

    def wait_for_room(self, handoff: DecodeHandoff, why: str | None, now: float) -> float:
        """``handoff`` found no room (``why``; None: requests before it are still waiting):
        seconds to wait before it tries again. RESOURCE_EXHAUSTED once its wait is over."""
        if handoff.engine_reserving:
            return ROOM_POLL_S  # the engine is answering: its pages may be on their way
        why = why or "requests before it are still waiting for room"
        remaining = handoff.room_deadline - now
        if remaining <= 0:
            raise CallFailed(
                Code.RESOURCE_EXHAUSTED,
                f"decode is full: {why} (waited {self.reserve_wait_s:g} s)",
            )
        return min(remaining, ROOM_POLL_S)

    def leave_line(self, handoff: DecodeHandoff) -> None:
        """It has its pages, or stopped waiting for them: the next in line goes."""
        if handoff in self._line:
            self._line.remove(handoff)
