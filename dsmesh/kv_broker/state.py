"""The KV handoff state machine, one record per request, as plain Python.

    RESERVED --resolve--> TRANSFERRING --commit--> DONE
        |                      |
        +----------------------+--> FAILED | ABORTED | TIMED_OUT

Beside the state, each record tracks ``prefill_released``: whether prefill can still write
into decode's pages. Decode must not reuse its pages before that is true, whatever the state:
a handoff can be ABORTED while prefill's writes are still in flight.

A reservation may say that decode holds the first pages of the prompt already
(``cached_pages``: its prefix cache kept them from an earlier turn); the table carries that,
with the name of those pages' tokens, to prefill, which writes only the pages after them.

Deadlines follow the work: a reservation must be picked up by a prefill within the handoff's
timeout; from then on, each Resolve and Progress moves the deadline to at least the timeout
plus twice what prefill expects the rest to take (its queue, the compute, the KV bytes over
its measured bandwidth), so a long queue or a large prompt is not timed out while it moves,
and a prefill that stops reporting is.

No gRPC, no asyncio, no clock: every method that needs the time takes ``now`` (seconds,
any monotonic origin). Mutating methods return a :class:`Transition` (or a list of them)
saying what changed and whom to tell; refusals raise :class:`HandoffError` with an
:class:`ErrorCode` that the servicer maps onto a gRPC status. Every record that ends other than
DONE carries a :class:`HandoffCause` beside its message, so the parties choose their status
from the cause, never from the text.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_TERMINAL_TTL_S = 60.0
EXPECTED_SLACK = 2.0  # the deadline keeps this many times prefill's estimate ahead


class HandoffState(enum.IntEnum):
    """Values equal the proto's ``dsmesh.v1.HandoffState`` numbers."""

    RESERVED = 1
    TRANSFERRING = 2
    DONE = 3
    FAILED = 4
    ABORTED = 5
    TIMED_OUT = 6

    @property
    def terminal(self) -> bool:
        return self >= HandoffState.DONE


class HandoffCause(enum.IntEnum):
    """Why a handoff ended other than DONE. Values equal the proto's ``dsmesh.v1.HandoffCause``
    numbers; the table sets the first seven, a party's ``Fail`` names the others."""

    UNSPECIFIED = 0  # live, DONE, or a Fail that named no cause
    LAYOUT_MISMATCH = 1
    PROMPT_MISMATCH = 2
    TIMED_OUT = 3
    CLIENT_ABORTED = 4
    PREFILL_LOST = 5
    DECODE_LOST = 6
    PREFILL_UNREACHABLE = 7
    PREFILL_FAILED = 8
    TRANSFER_FAILED = 9
    INVALID_REQUEST = 10
    BROKER_UNREACHABLE = 11  # decode's own verdict when it loses the broker; never stored


class ErrorCode(enum.Enum):
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    INVALID_ARGUMENT = "invalid_argument"
    FAILED_PRECONDITION = "failed_precondition"
    ABORTED = "aborted"


class HandoffError(Exception):
    """A refused operation. ``transitions`` lists changes that happened anyway (a layout
    mismatch fails the handoff *and* refuses the resolve); the caller must publish them."""

    def __init__(
        self, code: ErrorCode, message: str, transitions: Sequence[Transition] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.transitions = tuple(transitions)


def _invalid(message: str) -> HandoffError:
    return HandoffError(ErrorCode.INVALID_ARGUMENT, message)


def _show(value: object) -> str:
    return repr(value) if value == "" else str(value)


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool; prefill and decode must agree on every field."""

    dtype: str
    page_size: int  # tokens per page
    kv_dim: int  # kv_lora_rank + qk_rope_head_dim
    num_layers: int
    model: str = ""  # fingerprint of the model config; may be empty, but must then match
    transport: str = ""  # transfer engine and protocol, e.g. "mooncake/nvlink_intra"

    def validate(self, name: str = "layout") -> None:
        if not self.dtype:
            raise _invalid(f"{name}.dtype is required")
        for field in ("page_size", "kv_dim", "num_layers"):
            value = getattr(self, field)
            if value <= 0:
                raise _invalid(f"{name}.{field} must be positive, got {value}")

    def mismatches(self, decode: KVLayout) -> list[str]:
        """``self`` is prefill's layout; one ``"field prefill=X decode=Y"`` per difference."""
        out = []
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(decode, field.name)
            if mine != theirs:
                out.append(f"{field.name} prefill={_show(mine)} decode={_show(theirs)}")
        return out


@dataclass(frozen=True)
class RemotePool:
    """Where decode's pool lives in its transfer engine (addresses are opaque here)."""

    transfer_session: str
    base_ptr: int
    num_pages: int  # pages per layer
    page_bytes: int  # bytes of one page of one layer

    def validate(self, name: str = "pool") -> None:
        if not self.transfer_session:
            raise _invalid(f"{name}.transfer_session is required")
        if self.base_ptr < 0:
            raise _invalid(f"{name}.base_ptr must not be negative, got {self.base_ptr}")
        for field in ("num_pages", "page_bytes"):
            value = getattr(self, field)
            if value <= 0:
                raise _invalid(f"{name}.{field} must be positive, got {value}")


@dataclass
class Handoff:
    """One request's handoff. ``layout``/``pool`` are None only for a tombstone: a request
    aborted or failed before decode reserved anything, kept so a late reserve or resolve
    fails fast."""

    request_id: str
    state: HandoffState
    decode_instance_id: str
    layout: KVLayout | None
    pool: RemotePool | None
    page_ids: tuple[int, ...]
    num_tokens: int
    timeout_s: float
    deadline: float
    # Leading ``page_ids`` whose KV decode holds already (its prefix cache): prefill writes
    # none of them. ``cached_prefix`` names their tokens (a chained page hash, opaque here)
    # so that prefill can check its prompt starts with them.
    cached_pages: int = 0
    cached_prefix: int = 0
    prefill_instance_id: str = ""
    allowed_s: float = 0.0  # deadline minus the last report that set it
    expected_s: float = 0.0  # prefill's last estimate of the time to its commit
    first_token_id: int | None = None
    # The first token's logprobs as prefill committed them (a serialised message), carried
    # to decode unread; None when the request asked for none.
    first_token_logprobs: bytes | None = None
    # Speculative decoding: the tokens prefill drafted after the first one, carried to
    # decode unread (its first step verifies them); empty when it drafted none.
    draft_token_ids: tuple[int, ...] = ()
    bytes_written: int = 0
    tokens_written: int = 0
    message: str = ""
    cause: HandoffCause = HandoffCause.UNSPECIFIED  # set when it ends other than DONE
    terminal_at: float | None = None
    # Prefill can no longer write into decode's pages: it released or committed the
    # handoff, is gone, or no prefill ever resolved it and it is terminal.
    prefill_released: bool = False

    @property
    def tombstone(self) -> bool:
        return self.layout is None

    @property
    def party_ids(self) -> tuple[str, ...]:
        """Attached instances that take part: decode first, then prefill once resolved."""
        return tuple(i for i in (self.decode_instance_id, self.prefill_instance_id) if i)

    def snapshot(self) -> Handoff:
        return dataclasses.replace(self)


@dataclass(frozen=True)
class Transition:
    """A change to one handoff's state or ``prefill_released`` (or, from idempotent calls,
    no change at all); ``handoff`` is a snapshot taken after it."""

    handoff: Handoff
    old_state: HandoffState | None  # None: the record was created
    old_prefill_released: bool = False

    @property
    def new_state(self) -> HandoffState:
        return self.handoff.state

    @property
    def state_changed(self) -> bool:
        return self.old_state != self.handoff.state

    @property
    def changed(self) -> bool:
        return self.state_changed or self.old_prefill_released != self.handoff.prefill_released

    @property
    def party_ids(self) -> tuple[str, ...]:
        return self.handoff.party_ids


def _require_id(value: str, name: str) -> None:
    if not value:
        raise _invalid(f"{name} is required")


class HandoffTable:
    """All handoffs of one broker, keyed by request_id."""

    def __init__(self, default_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be positive, got {default_timeout_s}")
        self.default_timeout_s = default_timeout_s
        self._handoffs: dict[str, Handoff] = {}

    def __len__(self) -> int:
        return len(self._handoffs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._handoffs

    def get(self, request_id: str) -> Handoff:
        return self._lookup(request_id).snapshot()

    def counts(self) -> dict[HandoffState, int]:
        out = dict.fromkeys(HandoffState, 0)
        for h in self._handoffs.values():
            out[h.state] += 1
        return out

    def active(self) -> int:
        return sum(1 for h in self._handoffs.values() if not h.state.terminal)

    # -- decode side -------------------------------------------------------------------

    @staticmethod
    def validate_reservation(
        request_id: str,
        decode_instance_id: str,
        layout: KVLayout,
        pool: RemotePool,
        page_ids: Sequence[int],
        num_tokens: int,
        timeout_s: float | None = None,
        cached_pages: int = 0,
        cached_prefix: int = 0,
    ) -> None:
        """INVALID_ARGUMENT naming the first bad field of a reservation, else nothing."""
        _require_id(request_id, "request_id")
        _require_id(decode_instance_id, "decode_instance_id")
        layout.validate()
        pool.validate()
        if num_tokens <= 0:
            raise _invalid(f"num_tokens must be positive, got {num_tokens}")
        if not page_ids:
            raise _invalid("page_ids must not be empty")
        first_index: dict[int, int] = {}
        for i, page_id in enumerate(page_ids):
            if not 0 <= page_id < pool.num_pages:
                raise _invalid(
                    f"page_ids[{i}]={page_id} is outside the pool (0..{pool.num_pages - 1})"
                )
            j = first_index.setdefault(page_id, i)
            if j != i:
                raise _invalid(f"page_ids[{i}]={page_id} repeats page_ids[{j}]")
        if len(page_ids) * layout.page_size < num_tokens:
            raise _invalid(
                f"page_ids: {len(page_ids)} pages of {layout.page_size} tokens cannot hold "
                f"num_tokens={num_tokens}"
            )
        if timeout_s is not None and timeout_s <= 0:
            raise _invalid(f"timeout must be positive, got {timeout_s}")
        # Prefill always writes the page of the last prompt token (it samples the first
        # token there), so decode can hold fewer pages than the prompt fills, never all.
        if not 0 <= cached_pages * layout.page_size < num_tokens:
            raise _invalid(
                f"cached_pages={cached_pages} of {layout.page_size} tokens must be >= 0 and "
                f"leave some of num_tokens={num_tokens} to write"
            )
        if cached_prefix and not cached_pages:
            raise _invalid(f"cached_prefix={cached_prefix} names pages, but cached_pages is 0")

    def reserve(
        self,
        request_id: str,
        decode_instance_id: str,
        layout: KVLayout,
        pool: RemotePool,
        page_ids: Sequence[int],
        num_tokens: int,
        now: float,
        timeout_s: float | None = None,
        cached_pages: int = 0,
        cached_prefix: int = 0,
    ) -> Transition:
        """Decode registered ``page_ids`` (in token order) for ``num_tokens`` prompt tokens,
        the first ``cached_pages`` of which it holds already (named by ``cached_prefix``).

        ``timeout_s`` bounds the whole handoff (None: the table default)."""
        self.validate_reservation(
            request_id,
            decode_instance_id,
            layout,
            pool,
            page_ids,
            num_tokens,
            timeout_s,
            cached_pages,
            cached_prefix,
        )
        existing = self._handoffs.get(request_id)
        if existing is not None:
            if existing.state is HandoffState.ABORTED:
                raise HandoffError(ErrorCode.ABORTED, f"request {request_id!r} was aborted")
            if existing.tombstone:  # failed before decode got here: no duplicate's handoff
                raise HandoffError(
                    ErrorCode.FAILED_PRECONDITION,
                    f"request {request_id!r} failed: {existing.message}",
                )
            raise HandoffError(
                ErrorCode.ALREADY_EXISTS,
                f"request {request_id!r} already has a handoff ({existing.state.name})",
            )
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        h = Handoff(
            request_id=request_id,
            state=HandoffState.RESERVED,
            decode_instance_id=decode_instance_id,
            layout=layout,
            pool=pool,
            page_ids=tuple(page_ids),
            num_tokens=num_tokens,
            timeout_s=timeout,
            deadline=now + timeout,
            cached_pages=cached_pages,
            cached_prefix=cached_prefix,
            allowed_s=timeout,
        )
        self._handoffs[request_id] = h
        return Transition(h.snapshot(), None)

    # -- prefill side ------------------------------------------------------------------

    def resolve(
        self,
        request_id: str,
        prefill_instance_id: str,
        layout: KVLayout,
        now: float,
        expected_s: float = 0.0,
    ) -> Transition:
        """Prefill takes the reservation: RESERVED -> TRANSFERRING, or FAILED on a layout
        mismatch (raised as FAILED_PRECONDITION carrying that transition). ``expected_s``:
        prefill's estimate of the time until it commits (0 = none); the deadline becomes
        ``now + timeout + EXPECTED_SLACK * expected_s``."""
        _require_id(prefill_instance_id, "prefill_instance_id")
        layout.validate()
        _check_expected(expected_s)
        h = self._lookup(request_id)
        if h.state is not HandoffState.RESERVED:
            aborted = h.state is HandoffState.ABORTED
            code = ErrorCode.ABORTED if aborted else ErrorCode.FAILED_PRECONDITION
            raise _state_error(h, "resolve", HandoffState.RESERVED, code)
        assert h.layout is not None  # only tombstones lack a layout, and they are terminal
        h.prefill_instance_id = prefill_instance_id
        diffs = layout.mismatches(h.layout)
        if diffs:
            message = "KV layout mismatch: " + "; ".join(diffs)
            # Refused before prefill saw any page: it cannot write, so decode may reuse them.
            cause = HandoffCause.LAYOUT_MISMATCH
            t = self._finish(h, HandoffState.FAILED, message, now, cause, released=True)
            raise HandoffError(ErrorCode.FAILED_PRECONDITION, message, [t])
        h.deadline = now  # the reservation's wait is over: the work's own time starts now
        _extend(h, now, expected_s)
        return self._move(h, HandoffState.TRANSFERRING)

    def progress(
        self,
        request_id: str,
        tokens_written: int,
        bytes_written: int,
        now: float | None = None,
        expected_s: float = 0.0,
    ) -> Handoff:
        """Cumulative progress while TRANSFERRING (never decreases); in any other state the
        record is returned unchanged, so the writer learns that it should stop. With ``now``
        the report also keeps the deadline at least ``timeout + EXPECTED_SLACK *
        expected_s`` ahead (it never moves it closer)."""
        h = self._lookup(request_id)
        if tokens_written < 0:
            raise _invalid(f"tokens_written must not be negative, got {tokens_written}")
        if bytes_written < 0:
            raise _invalid(f"bytes_written must not be negative, got {bytes_written}")
        _check_expected(expected_s)
        if h.state is HandoffState.TRANSFERRING:
            if tokens_written > h.num_tokens:
                raise _invalid(f"tokens_written={tokens_written} exceeds num_tokens={h.num_tokens}")
            h.tokens_written = max(h.tokens_written, tokens_written)
            h.bytes_written = max(h.bytes_written, bytes_written)
            if now is not None:
                _extend(h, now, expected_s)
        return h.snapshot()

    def commit(
        self,
        request_id: str,
        first_token_id: int,
        bytes_written: int,
        now: float,
        first_token_logprobs: bytes | None = None,
        draft_token_ids: Sequence[int] = (),
    ) -> Transition:
        """All KV is written and the first token sampled (and, when speculating, the tokens
        drafted after it): TRANSFERRING -> DONE."""
        if first_token_id < 0:
            raise _invalid(f"first_token_id must not be negative, got {first_token_id}")
        if any(t < 0 for t in draft_token_ids):
            raise _invalid(f"draft_token_ids must not be negative, got {list(draft_token_ids)}")
        if bytes_written < 0:
            raise _invalid(f"bytes_written must not be negative, got {bytes_written}")
        h = self._lookup(request_id)
        if h.state is not HandoffState.TRANSFERRING:
            raise _state_error(
                h, "commit", HandoffState.TRANSFERRING, ErrorCode.FAILED_PRECONDITION
            )
        h.first_token_id = first_token_id
        h.first_token_logprobs = first_token_logprobs
        h.draft_token_ids = tuple(draft_token_ids)
        h.tokens_written = h.num_tokens
        h.bytes_written = max(h.bytes_written, bytes_written)
        return self._finish(h, HandoffState.DONE, "", now, HandoffCause.UNSPECIFIED, True)

    # -- either side, or the gateway -------------------------------------------------------

    def fail(
        self,
        request_id: str,
        reason: str,
        now: float,
        cause: HandoffCause = HandoffCause.UNSPECIFIED,
    ) -> Transition:
        """Non-terminal -> FAILED for ``cause``; a terminal record is returned unchanged; an
        unknown request gets a FAILED tombstone. The gateway fails a request whose prefill
        it cannot reach before it cancels decode's call, and decode may not have reserved
        yet: the tombstone refuses its late reserve, and decode's abort, when its call is
        cancelled, leaves the handoff FAILED for ``cause`` rather than ABORTED."""
        _require_id(request_id, "request_id")
        reason = reason or "failed (no reason given)"
        h = self._handoffs.get(request_id)
        if h is None:
            return self._tombstone(request_id, HandoffState.FAILED, reason, now, cause)
        if h.state.terminal:
            return _unchanged(h)
        return self._finish(h, HandoffState.FAILED, reason, now, cause)

    def abort(self, request_id: str, now: float) -> Transition:
        """Non-terminal -> ABORTED; terminal records are returned unchanged; an unknown
        request gets an ABORTED tombstone so that its late reserve/resolve fails fast."""
        _require_id(request_id, "request_id")
        message = "request was aborted"
        h = self._handoffs.get(request_id)
        if h is None:
            cause = HandoffCause.CLIENT_ABORTED
            return self._tombstone(request_id, HandoffState.ABORTED, message, now, cause)
        if h.state.terminal:
            return _unchanged(h)
        return self._finish(h, HandoffState.ABORTED, message, now, HandoffCause.CLIENT_ABORTED)

    def release(self, request_id: str) -> Transition:
        """Prefill has no write into this handoff's pages queued or in flight any more, and
        will issue none: decode may reuse them once the handoff is terminal. Idempotent; the
        state does not change. Without a resolving prefill there is nothing to release."""
        h = self._lookup(request_id)
        if not h.prefill_instance_id:
            return _unchanged(h)
        return self._move(h, h.state, released=True)

    # -- housekeeping ------------------------------------------------------------------

    def instance_lost(self, instance_id: str, now: float) -> list[Transition]:
        """An instance vanished: every live handoff it takes part in -> FAILED. A lost
        prefill also releases the pages of its finished handoffs (it writes no more)."""
        out = []
        for h in self._handoffs.values():
            if h.prefill_instance_id == instance_id:
                if not h.state.terminal:
                    message = f"prefill instance {instance_id} is gone"
                    cause = HandoffCause.PREFILL_LOST
                    out.append(self._finish(h, HandoffState.FAILED, message, now, cause, True))
                elif not h.prefill_released:
                    out.append(self._move(h, h.state, released=True))
            elif h.decode_instance_id == instance_id and not h.state.terminal:
                message = f"decode instance {instance_id} is gone"
                cause = HandoffCause.DECODE_LOST
                out.append(self._finish(h, HandoffState.FAILED, message, now, cause))
        return out

    def expire(self, now: float) -> list[Transition]:
        """Live handoffs past their deadline -> TIMED_OUT."""
        out = []
        for h in self._handoffs.values():
            if not h.state.terminal and now >= h.deadline:
                message = f"handoff timed out after {h.allowed_s:g} s in {h.state.name}"
                if h.expected_s > 0:
                    message += f" (prefill expected to commit within {h.expected_s:g} s)"
                cause = HandoffCause.TIMED_OUT
                out.append(self._finish(h, HandoffState.TIMED_OUT, message, now, cause))
        return out

    def gc(self, now: float, ttl_s: float = DEFAULT_TERMINAL_TTL_S) -> list[str]:
        """Forget terminal records (and tombstones) older than ``ttl_s``; returns their ids."""
        dropped = [
            rid
            for rid, h in self._handoffs.items()
            if h.terminal_at is not None and now - h.terminal_at >= ttl_s
        ]
        for rid in dropped:
            del self._handoffs[rid]
        return dropped

    # -- internals ---------------------------------------------------------------------

    def _lookup(self, request_id: str) -> Handoff:
        _require_id(request_id, "request_id")
        h = self._handoffs.get(request_id)
        if h is None:
            raise HandoffError(ErrorCode.NOT_FOUND, f"no handoff for request {request_id!r}")
        return h

    def _tombstone(
        self,
        request_id: str,
        state: HandoffState,
        message: str,
        now: float,
        cause: HandoffCause,
    ) -> Transition:
        """A terminal record for a request that decode has not reserved: no pages, no parties,
        nothing for a prefill to write."""
        h = Handoff(
            request_id=request_id,
            state=state,
            decode_instance_id="",
            layout=None,
            pool=None,
            page_ids=(),
            num_tokens=0,
            timeout_s=0.0,
            deadline=now,
            message=message,
            cause=cause,
            terminal_at=now,
            prefill_released=True,
        )
        self._handoffs[request_id] = h
        return Transition(h.snapshot(), None)

    def _move(self, h: Handoff, state: HandoffState, released: bool = False) -> Transition:
        old_state, old_released = h.state, h.prefill_released
        h.state = state
        # Once terminal, a handoff no prefill resolved can never be written.
        unresolved_end = state.terminal and not h.prefill_instance_id
        h.prefill_released = old_released or released or unresolved_end
        return Transition(h.snapshot(), old_state, old_released)

    def _finish(
        self,
        h: Handoff,
        state: HandoffState,
        message: str,
        now: float,
        cause: HandoffCause,
        released: bool = False,
    ) -> Transition:
        h.message = message
        h.cause = cause
        h.terminal_at = now
        return self._move(h, state, released)


def _check_expected(expected_s: float) -> None:
    if not expected_s >= 0:  # NaN too
        raise _invalid(f"expected time must not be negative, got {expected_s}")


def _extend(h: Handoff, now: float, expected_s: float) -> None:
    """Keep the deadline ``timeout + EXPECTED_SLACK * expected_s`` ahead of ``now``."""
    allowed = h.timeout_s + EXPECTED_SLACK * expected_s
    if now + allowed > h.deadline:
        h.deadline = now + allowed
        h.allowed_s = allowed
        h.expected_s = expected_s


def _unchanged(h: Handoff) -> Transition:
    return Transition(h.snapshot(), h.state, h.prefill_released)


def _state_error(h: Handoff, verb: str, wanted: HandoffState, code: ErrorCode) -> HandoffError:
    text = f"cannot {verb} request {h.request_id!r}: handoff is {h.state.name}"
    if h.state.terminal and h.message:
        text += f" ({h.message})"
    else:
        text += f", not {wanted.name}"
    return HandoffError(code, text)
