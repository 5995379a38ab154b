"""Prefill's side of the KV handoff as plain Python, one :class:`PrefillHandoff` per request:
which of decode's pages each forward's KV goes to, what kv_broker hears when the request stops
here, and what its Prefill call answers.

    RESOLVING --Resolve--> RESOLVED --submit--> WRITING --landed--> WRITTEN --Commit--> COMMITTED
        |                     |                    |                   |
        +---------------------+--------------------+-------------------+--> STOPPED

A request stops once, whoever stops it: its client (cancelled, Abort), its own failure (an
invalid request, a failed forward or write), kv_broker (an event or an answer that ends the
handoff, or the link to it lost) or a refused commit. The :class:`Stop` says what to tell
kv_broker, what to free and what the call answers; the servicer carries it out.

No gRPC, no asyncio, no clock: methods that need the time take ``now`` (seconds, any monotonic
origin). The event loop moves the phase; the engine thread reads it and calls
:meth:`PrefillHandoff.pages_to_send` (one writer per field).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsmesh.engine.kv.pool import pages_for
from dsmesh.engine.kv.prefix_hashes import prefix_name
from dsmesh.instance.failures import CallFailed, Code, already_active, handoff_failed
from dsmesh.v1 import kv_broker_pb2 as kb

_ENDED = (kb.HANDOFF_FAILED, kb.HANDOFF_ABORTED, kb.HANDOFF_TIMED_OUT)


class Phase(enum.Enum):
    RESOLVING = "resolving"  # waiting for decode's reservation
    RESOLVED = "resolved"  # decode's pages are ours; the prompt waits for transfer room
    WRITING = "writing"  # in the engine; each forward's pages go to decode as they come
    WRITTEN = "written"  # every write landed: committing
    COMMITTED = "committed"
    STOPPED = "stopped"


class Notice(enum.Enum):
    """What kv_broker is told when a request stops here."""

    NONE = "none"  # nothing: it ended the handoff itself, or refused the commit
    FAIL = "fail"  # Fail, with the stop's cause and reason
    ABORT = "abort"  # Abort: the client went away


class Free(enum.Enum):
    """What prefill gives back of decode's pages when a request stops."""

    NOTHING = "nothing"  # none resolved: no page of decode's was ours
    RELEASE = "release"  # resolved, nothing written: Release at once
    LANES = "lanes"  # writes may be queued: the lane drops them, Release after the one in flight


@dataclass(frozen=True)
class Stop:
    notice: Notice
    cause: int  # kb.HandoffCause, told with Notice.FAIL
    reason: str
    free: Free
    in_engine: bool  # the prompt was submitted: abort it there (its pages come back)
    error: CallFailed  # what the Prefill call answers if it still waits for its writes


def check_admission(
    request_id: str, prompt_len: int, queued: Mapping[str, int], max_queued_tokens: int
) -> None:
    """Refuse a duplicate id (ALREADY_EXISTS), or a prompt over ``max_queued_tokens`` with
    the prompts admitted and not finished (``queued``: their lengths by id); RESOURCE_EXHAUSTED
    then, unless nothing else is queued (a prompt that large alone is still served)."""
    if request_id in queued:
        raise already_active(request_id)
    total = sum(queued.values())
    if queued and total + prompt_len > max_queued_tokens:
        raise CallFailed(
            Code.RESOURCE_EXHAUSTED,
            f"prefill is full: {total} prompt tokens queued (limit {max_queued_tokens}); "
            "retry later",
        )


def may_be_duplicate(code: str) -> bool:
    """A Resolve refused with this gRPC status may concern a handoff another prefill (or an
    earlier call with this id) already took: ask kv_broker before answering."""
    return code == "FAILED_PRECONDITION"


def resolve_failed(code: str, details: str, taken: bool = False) -> CallFailed:
    """kv_broker refused the Resolve with the gRPC status named ``code``. ``taken``: it says a
    prefill took the handoff already (asked when :func:`may_be_duplicate`)."""
    message = f"cannot resolve the KV handoff: {details}"
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return CallFailed(Code.UNAVAILABLE, message)
    if may_be_duplicate(code) and taken:
        return CallFailed(Code.ALREADY_EXISTS, message)  # a duplicate of a prefilled request
    return CallFailed(Code[code], message)


def same_prefix(
    prompt: Sequence[int], cached_pages: int, cached_prefix: int, page_size: int
) -> bool:
    """Whether ``cached_prefix``, decode's name for the ``cached_pages`` leading pages it
    holds, names this prompt's first pages (dsmesh/engine/kv/prefix_hashes.py)."""
    try:
        return prefix_name(prompt, cached_pages, page_size) == cached_prefix
    except ValueError:  # the prompt has not that many pages
        return False


def commit_failed(code: str, details: str) -> CallFailed:
    """kv_broker refused the commit with the gRPC status named ``code``: ABORTED when the
    handoff had ended already, UNAVAILABLE when the broker could not be reached."""
    failed = Code.ABORTED if code == "FAILED_PRECONDITION" else Code.UNAVAILABLE
    return CallFailed(failed, f"KV handoff could not be committed: {details}")


class PrefillHandoff:
    """One Prefill call's handoff into decode's pages."""

    def __init__(self, request_id: str, prompt_len: int, page_size: int) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.page_size = page_size
        self.phase = Phase.RESOLVING
        self.remote_pages: list[int] = []  # decode's pages for the prompt, in token order
        self.next_page = 0  # first prompt page not yet (fully) sent; engine thread
        self.cached_pages = 0  # leading pages decode holds already: never sent
        self.stop: Stop | None = None  # how it stopped, once STOPPED
        self._prefilled_at: float | None = None

    @property
    def stopped(self) -> bool:
        return self.phase is Phase.STOPPED

    # ---- the way to a commit --------------------------------------------------------------

    def resolved(
        self,
        num_tokens: int,
        page_ids: Sequence[int],
        cached_pages: int = 0,
        prefix_matches: bool = True,
    ) -> Stop | None:
        """Decode's reservation: ``page_ids`` for ``num_tokens`` prompt tokens, the first
        ``cached_pages`` of which decode holds already (they are never written), and
        ``prefix_matches``: whether the name decode gave those pages is this prompt's. None when
        it fits this prompt; a Stop (FAILED_PRECONDITION) when decode reserved for another,
        or holds pages of another prefix. A request stopped while it resolved gets a Stop that
        gives the reservation back."""
        if self.stop is not None:  # the reservation is ours all the same: give it back
            return Stop(Notice.NONE, kb.CAUSE_UNSPECIFIED, "", Free.RELEASE, False, self.stop.error)
        self._expect(Phase.RESOLVING)
        self.phase = Phase.RESOLVED
        needed = pages_for(self.prompt_len, self.page_size)
        message = ""
        if num_tokens != self.prompt_len or len(page_ids) < needed:
            message = (
                f"decode reserved {len(page_ids)} pages for {num_tokens} tokens; "
                f"this prompt has {self.prompt_len} tokens"
            )
        elif not 0 <= cached_pages * self.page_size < self.prompt_len:
            message = (
                f"decode holds {cached_pages} pages of this {self.prompt_len}-token prompt; "
                "it must leave the last one to write"
            )
        elif not prefix_matches:
            message = f"the {cached_pages} pages decode holds are not this prompt's prefix"
        if message:
            failure = CallFailed(Code.FAILED_PRECONDITION, message)
            return self._stop(Notice.FAIL, kb.CAUSE_PROMPT_MISMATCH, message, failure)
        self.remote_pages = list(page_ids[:needed])
        self.cached_pages = cached_pages
        self.next_page = cached_pages  # decode's copy of those pages stays as it is
        return None

    def submit(self) -> None:
        """The prompt goes to the engine now; raises the call's failure if it stopped."""
        if self.stop is not None:
            raise self.stop.error
        self._expect(Phase.RESOLVED)
        self.phase = Phase.WRITING

    def pages_to_send(self, end: int) -> range:
        """Engine thread, after a forward computed the prompt up to token ``end``: the
        indexes of the request's pages to write now, each into ``remote_pages`` at the same
        index; none of the ``cached_pages`` that decode holds. A page the forward left
        half-filled is sent again with the next chunk."""
        last = pages_for(end, self.page_size)
        if last <= self.next_page:
            return range(0)
        pages = range(self.next_page, last)
        self.next_page = end // self.page_size
        return pages

    def prefilled(self, now: float) -> None:
        """Engine thread: the forward that sampled the first token ended at ``now``."""
        self._prefilled_at = now

    def written(self) -> bool:
        """Every write landed (the lane's final job): commit, unless it stopped meanwhile."""
        if self.phase is not Phase.WRITING:
            return False
        self.phase = Phase.WRITTEN
        return True

    def committed(self, now: float) -> float:
        """kv_broker took the commit: the seconds since the last forward ended (what the
        handoff added to the request's time to first token)."""
        self.phase = Phase.COMMITTED
        if self._prefilled_at is None:
            return 0.0
        return max(0.0, now - self._prefilled_at)

    # ---- stops: each returns None when the request stopped (or committed) already ---------

    def fail(self, cause: int, reason: str) -> Stop | None:
        """It failed here for ``cause`` (``kb.HandoffCause``): kv_broker hears FAILED. The
        call answers INVALID_ARGUMENT for an invalid request, ABORTED for anything else."""
        code = Code.INVALID_ARGUMENT if cause == kb.CAUSE_INVALID_REQUEST else Code.ABORTED
        return self._stop(Notice.FAIL, cause, reason, CallFailed(code, reason))

    def client_gone(self, reason: str) -> Stop | None:
        """The call was cancelled or aborted: kv_broker hears ABORTED (decode: CANCELLED)."""
        failure = CallFailed(Code.ABORTED, reason)
        return self._stop(Notice.ABORT, kb.CAUSE_CLIENT_ABORTED, reason, failure)

    def broker_ended(self, state: int, cause: int, message: str) -> Stop | None:
        """kv_broker says the handoff is in ``state`` (an event, or its answer to Progress):
        a request whose handoff FAILED, ABORTED or TIMED_OUT stops writing."""
        if state not in _ENDED:
            return None
        failure = handoff_failed(state, cause, message)
        return self._stop(Notice.NONE, cause, failure.message, failure)

    def broker_lost(self, why: str) -> Stop | None:
        """The kv_broker link dropped. A restarted broker has no record of the handoff and
        decode stops waiting when its own calls fail, so a handoff being written can never
        commit: stop writing now. One still resolving fails through its Resolve call, one
        written at its commit."""
        if self.phase not in (Phase.RESOLVED, Phase.WRITING):
            return None
        reason = f"{why}; the KV handoff cannot complete"
        failure = CallFailed(Code.UNAVAILABLE, reason)
        return self._stop(Notice.NONE, kb.CAUSE_UNSPECIFIED, reason, failure)

    def commit_refused(self, failure: CallFailed) -> Stop:
        """kv_broker refused the commit (``failure``: :func:`commit_failed`): stop quietly, the
        handoff is over there. A request stopped meanwhile has nothing left to stop."""
        stop = self._stop(Notice.NONE, kb.CAUSE_UNSPECIFIED, failure.message, failure)
        if stop is None:
            return Stop(Notice.NONE, kb.CAUSE_UNSPECIFIED, "", Free.NOTHING, False, failure)
        return stop

    def _stop(self, notice: Notice, cause: int, reason: str, error: CallFailed) -> Stop | None:
        if self.phase in (Phase.STOPPED, Phase.COMMITTED):
            return None
        free = {
            Phase.RESOLVING: Free.NOTHING,
            Phase.RESOLVED: Free.RELEASE,
            Phase.WRITING: Free.LANES,
            Phase.WRITTEN: Free.LANES,
        }[self.phase]
        in_engine = self.phase in (Phase.WRITING, Phase.WRITTEN)
        self.phase = Phase.STOPPED
        self.stop = Stop(notice, cause, reason, free, in_engine, error)
        return self.stop

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"request {self.request_id}: {self.phase.value}, not {phase.value}")
