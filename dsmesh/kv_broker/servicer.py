"""``dsmesh.v1.KVBroker`` over grpc.aio: converts protos, delegates to :class:`HandoffTable`,
pushes every transition to the parties' Attach streams and wakes waiting RPCs.

Liveness: an instance is attached while its Attach stream is open. When the stream ends it
has ``liveness_grace_s`` to re-attach (events meanwhile are buffered and replayed); after
that it is lost and its live handoffs fail. Waiting RPCs (Resolve, Await) sleep on a
per-request :class:`asyncio.Event` set on every transition of that request; nothing polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from opentelemetry import trace

from dsmesh.kv_broker.metrics import BrokerMetrics
from dsmesh.kv_broker.state import (
    ErrorCode,
    Handoff,
    HandoffCause,
    HandoffError,
    HandoffState,
    HandoffTable,
    KVLayout,
    RemotePool,
    Transition,
)
from dsmesh.runtime import telemetry
from dsmesh.runtime.waits import wait_set
from dsmesh.v1 import kv_broker_pb2 as pb
from dsmesh.v1 import kv_broker_pb2_grpc

if TYPE_CHECKING:
    from dsmesh.kv_broker.config import BrokerConfig

log = logging.getLogger(__name__)

EXPIRE_INTERVAL_S = 0.1  # how often deadlines are checked
GC_INTERVAL_S = 1.0

GRPC_CODES: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
}
ROLE_NAMES = {pb.ROLE_PREFILL: "prefill", pb.ROLE_DECODE: "decode", pb.ROLE_UNIFIED: "unified"}
HEARTBEAT = pb.BrokerEvent(heartbeat=True)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]


def _invalid(message: str) -> HandoffError:
    return HandoffError(ErrorCode.INVALID_ARGUMENT, message)


def _unary(method: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Map :class:`HandoffError` onto the gRPC status (after publishing the transitions it
    carries) and any other exception onto INTERNAL, so no request takes the server down."""

    @functools.wraps(method)
    async def handler(self: KVBrokerServicer, request: Req, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except HandoffError as exc:
            self._publish(exc.transitions)
            await context.abort(GRPC_CODES[exc.code], exc.message)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("%s failed", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"kv_broker internal error: {exc}")

    return handler


def _layout(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.dtype, msg.page_size, msg.kv_dim, msg.num_layers, msg.model, msg.transport)


def _pool(msg: pb.RemotePool) -> RemotePool:
    return RemotePool(msg.transfer_session, msg.base_ptr, msg.num_pages, msg.page_bytes)


def _pool_proto(pool: RemotePool | None) -> pb.RemotePool:
    if pool is None:
        return pb.RemotePool()
    return pb.RemotePool(
        transfer_session=pool.transfer_session,
        base_ptr=pool.base_ptr,
        num_pages=pool.num_pages,
        page_bytes=pool.page_bytes,
    )


def _status(h: Handoff) -> pb.HandoffStatus:
    status = pb.HandoffStatus(
        request_id=h.request_id,
        state=int(h.state),
        first_token_id=0 if h.first_token_id is None else h.first_token_id,
        message=h.message,
        decode_instance_id=h.decode_instance_id,
        prefill_instance_id=h.prefill_instance_id,
        bytes_written=h.bytes_written,
        prefill_released=h.prefill_released,
        cause=int(h.cause),
        draft_token_ids=h.draft_token_ids,
    )
    if h.first_token_logprobs is not None:
        status.first_token_logprobs.ParseFromString(h.first_token_logprobs)
    return status


def _event(h: Handoff) -> pb.BrokerEvent:
    return pb.BrokerEvent(
        request_id=h.request_id,
        state=int(h.state),
        first_token_id=0 if h.first_token_id is None else h.first_token_id,
        message=h.message,
        prefill_released=h.prefill_released,
        cause=int(h.cause),
    )


def _cause(value: int) -> HandoffCause:
    try:
        return HandoffCause(value)
    except ValueError:
        raise _invalid(f"cause {value} is not a dsmesh.v1.HandoffCause") from None


def _expected_s(expected_ms: int) -> float:
    if expected_ms < 0:
        raise _invalid(f"expected_ms must not be negative, got {expected_ms}")
    return expected_ms / 1000.0


def _wait_s(wait_ms: int) -> float:
    if wait_ms < 0:
        raise _invalid(f"wait_ms must not be negative, got {wait_ms}")
    return wait_ms / 1000.0


class _Stream:
    """One open Attach call; ``closed`` ends it (re-attach elsewhere, or shutdown)."""

    def __init__(self) -> None:
        self.wakeup = asyncio.Event()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.wakeup.set()


class _HandoffSpans:
    """One ``kv.handoff`` span per live handoff, from Reserve (child of that RPC's span, so in
    the request's trace) to its terminal state. Stays empty while tracing is off."""

    def __init__(self) -> None:
        self._open: dict[str, trace.Span] = {}
        self._closed = False

    def start(self, h: Handoff) -> None:
        if self._closed or not telemetry.enabled():
            return
        self._open[h.request_id] = telemetry.tracer().start_span(
            "kv.handoff",
            attributes={
                "dsmesh.request_id": h.request_id,
                "dsmesh.decode_instance_id": h.decode_instance_id,
                "dsmesh.kv.pages": len(h.page_ids),
                "dsmesh.kv.cached_pages": h.cached_pages,
                "dsmesh.prompt_tokens": h.num_tokens,
            },
        )

    def update(self, t: Transition) -> None:
        h = t.handoff
        span = self._open.get(h.request_id)
        if span is None or not t.state_changed:
            return
        if h.state is HandoffState.TRANSFERRING:
            span.add_event("resolved", {"dsmesh.prefill_instance_id": h.prefill_instance_id})
        if not h.state.terminal:
            return
        del self._open[h.request_id]
        span.set_attributes(
            {
                "dsmesh.handoff.state": h.state.name,
                "dsmesh.prefill_instance_id": h.prefill_instance_id,
                "dsmesh.kv.bytes": h.bytes_written,
            }
        )
        if h.state is not HandoffState.DONE:
            span.set_status(trace.Status(trace.StatusCode.ERROR, h.message or h.state.name))
        span.end()

    def end_all(self, reason: str) -> None:
        """Broker shutdown: end the spans of handoffs still live, so none is lost."""
        self._closed = True
        for span in self._open.values():
            span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
            span.end()
        self._open.clear()


@dataclass
class _Instance:
    info: pb.Instance
    stream: _Stream | None = None  # None while detached (within the grace period)
    pending: deque[pb.BrokerEvent] = field(default_factory=deque)  # not yet written
    lost_timer: asyncio.TimerHandle | None = None


class KVBrokerServicer(kv_broker_pb2_grpc.KVBrokerServicer):
    """Call :meth:`start` inside the running loop before serving, :meth:`close` to stop."""

    def __init__(
        self,
        config: BrokerConfig,
        metrics: BrokerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._table = HandoffTable(config.handoff_timeout_s)
        self._instances: dict[str, _Instance] = {}
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._housekeeping: asyncio.Task[None] | None = None
        self._closing = False
        self._spans = _HandoffSpans()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._housekeeping = asyncio.get_running_loop().create_task(self._housekeep())

    def live_handoffs(self) -> int:
        """Handoffs not yet in a terminal state (what a drain waits for)."""
        return self._table.active()

    async def close(self) -> None:
        """End every Attach stream cleanly, answer waiting calls now (Await with the current
        state, Resolve with UNAVAILABLE) and stop housekeeping; new Attach and Resolve calls
        get UNAVAILABLE. Handoff records stay readable until the server stops."""
        self._closing = True
        for waiters in self._watchers.values():
            for waiter in waiters:
                waiter.set()
        for inst in self._instances.values():
            if inst.lost_timer is not None:
                inst.lost_timer.cancel()
            if inst.stream is not None:
                inst.stream.close()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeping
        self._spans.end_all("kv_broker stopped before the handoff ended")

    async def _housekeep(self) -> None:
        next_gc = self._clock()
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            try:
                now = self._clock()
                self._publish(self._table.expire(now))
                if now >= next_gc:
                    self._table.gc(now, self._config.terminal_ttl_s)
                    next_gc = now + GC_INTERVAL_S
            except Exception:  # keep expiring whatever happened
                log.exception("kv_broker housekeeping failed")

    # -- notification --------------------------------------------------------------------

    def _publish(self, transitions: Iterable[Transition]) -> None:
        transitions = [t for t in transitions if t.changed]
        for t in transitions:
            self._spans.update(t)
            event = _event(t.handoff)
            for instance_id in t.party_ids:
                inst = self._instances.get(instance_id)
                if inst is not None:
                    inst.pending.append(event)
                    if inst.stream is not None:
                        inst.stream.wakeup.set()
            for waiter in self._watchers.get(t.handoff.request_id, ()):
                waiter.set()
        if transitions and self._metrics is not None:
            self._metrics.record(transitions, self._table.active())

    async def _wait_change(self, request_id: str, timeout_s: float) -> None:
        """Sleep until ``request_id`` changes state or ``timeout_s`` passes. Callers check
        and then call this without awaiting in between, so no transition is missed."""
        waiter = asyncio.Event()
        waiters = self._watchers.setdefault(request_id, set())
        waiters.add(waiter)
        try:
            await wait_set(waiter, timeout_s)
        finally:
            waiters.discard(waiter)
            if not waiters:
                self._watchers.pop(request_id, None)

    # -- instances -----------------------------------------------------------------------

    def _attach(self, info: pb.Instance, stream: _Stream) -> _Instance:
        inst = self._instances.get(info.instance_id)
        if inst is None:
            inst = self._instances[info.instance_id] = _Instance(info=info)
        else:  # re-attach: replaces a live stream, or comes back within the grace period
            if inst.stream is not None:
                inst.stream.close()
            if inst.lost_timer is not None:
                inst.lost_timer.cancel()
                inst.lost_timer = None
            inst.info = info
        inst.stream = stream
        self._update_attached()
        log.info("%s instance %s attached", ROLE_NAMES[info.role], info.instance_id)
        return inst

    def _detach(self, inst: _Instance, stream: _Stream) -> None:
        if inst.stream is not stream:  # replaced by a newer Attach
            return
        inst.stream = None
        self._update_attached()
        if self._closing:
            return
        log.info("instance %s detached", inst.info.instance_id)
        inst.lost_timer = asyncio.get_running_loop().call_later(
            self._config.liveness_grace_s, self._lose, inst
        )

    def _lose(self, inst: _Instance) -> None:
        instance_id = inst.info.instance_id
        if self._instances.get(instance_id) is not inst or inst.stream is not None:
            return
        del self._instances[instance_id]
        transitions = self._table.instance_lost(instance_id, self._clock())
        log.warning("instance %s lost; %d handoffs failed", instance_id, len(transitions))
        self._publish(transitions)

    def _update_attached(self) -> None:
        if self._metrics is None:
            return
        counts = dict.fromkeys(ROLE_NAMES.values(), 0)
        for inst in self._instances.values():
            if inst.stream is not None:
                counts[ROLE_NAMES[inst.info.role]] += 1
        self._metrics.set_attached(counts)

    def _require_attached(self, instance_id: str, role: pb.Role.ValueType, name: str) -> None:
        if not instance_id:
            raise _invalid(f"{name} is required")
        inst = self._instances.get(instance_id)
        if inst is None or inst.stream is None:
            raise HandoffError(
                ErrorCode.FAILED_PRECONDITION,
                f"{ROLE_NAMES[role]} instance {instance_id} is not attached",
            )
        if inst.info.role != role:
            raise HandoffError(
                ErrorCode.FAILED_PRECONDITION,
                f"instance {instance_id} is attached as {ROLE_NAMES[inst.info.role]}, "
                f"not {ROLE_NAMES[role]}",
            )

    # -- RPCs ----------------------------------------------------------------------------

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> None:
        info = request.instance
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "kv_broker is shutting down")
        if not request.HasField("instance"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "instance is required")
        if not info.instance_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "instance.instance_id is required"
            )
        if info.role not in ROLE_NAMES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "instance.role must be ROLE_PREFILL, ROLE_DECODE or ROLE_UNIFIED",
            )
        stream = _Stream()
        own = pb.Instance()
        own.CopyFrom(info)
        inst = self._attach(own, stream)
        try:
            await context.write(HEARTBEAT)  # the first message confirms the registration
            while not stream.closed:
                if inst.pending:
                    event = inst.pending[0]
                    await context.write(event)
                    # Drop it only once written; a replacing stream may have taken it already.
                    if inst.pending and inst.pending[0] is event:
                        inst.pending.popleft()
                    continue
                stream.wakeup.clear()
                try:
                    await asyncio.wait_for(stream.wakeup.wait(), self._config.heartbeat_interval_s)
                except TimeoutError:
                    await context.write(HEARTBEAT)
        finally:
            self._detach(inst, stream)

    @_unary
    async def Reserve(
        self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReserveResponse:
        if not request.HasField("layout"):
            raise _invalid("layout is required")
        if not request.HasField("pool"):
            raise _invalid("pool is required")
        if request.timeout_ms < 0:
            raise _invalid(f"timeout_ms must not be negative, got {request.timeout_ms}")
        args = dict(
            request_id=request.request_id,
            decode_instance_id=request.decode_instance_id,
            layout=_layout(request.layout),
            pool=_pool(request.pool),
            page_ids=list(request.page_ids),
            num_tokens=request.num_tokens,
            timeout_s=request.timeout_ms / 1000.0 if request.timeout_ms else None,
            cached_pages=request.cached_pages,
            cached_prefix=request.cached_prefix,
        )
        HandoffTable.validate_reservation(**args)  # bad input before state checks
        self._require_attached(request.decode_instance_id, pb.ROLE_DECODE, "decode_instance_id")
        t = self._table.reserve(**args, now=self._clock())
        self._spans.start(t.handoff)
        self._publish([t])
        return pb.ReserveResponse()

    @_unary
    async def Resolve(
        self, request: pb.ResolveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResolveResponse:
        if not request.request_id:
            raise _invalid("request_id is required")
        if not request.HasField("layout"):
            raise _invalid("layout is required")
        layout = _layout(request.layout)
        layout.validate()
        wait_s = _wait_s(request.wait_ms)
        self._require_attached(request.prefill_instance_id, pb.ROLE_PREFILL, "prefill_instance_id")
        deadline = self._clock() + wait_s
        while True:
            if self._closing:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "kv_broker is shutting down")
            try:
                t = self._table.resolve(
                    request.request_id,
                    request.prefill_instance_id,
                    layout,
                    self._clock(),
                    _expected_s(request.expected_ms),
                )
                break
            except HandoffError as exc:
                remaining = deadline - self._clock()
                if exc.code is not ErrorCode.NOT_FOUND:
                    raise
                if remaining <= 0:
                    raise HandoffError(
                        ErrorCode.NOT_FOUND,
                        f"no reservation for request {request.request_id!r} "
                        f"(waited {request.wait_ms} ms)",
                    ) from None
            await self._wait_change(request.request_id, remaining)
        self._publish([t])
        h = t.handoff
        return pb.ResolveResponse(
            decode_instance_id=h.decode_instance_id,
            pool=_pool_proto(h.pool),
            page_ids=h.page_ids,
            num_tokens=h.num_tokens,
            cached_pages=h.cached_pages,
            cached_prefix=h.cached_prefix,
        )

    @_unary
    async def Progress(
        self, request: pb.ProgressRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandoffStatus:
        h = self._table.progress(
            request.request_id,
            request.tokens_written,
            request.bytes_written,
            now=self._clock(),
            expected_s=_expected_s(request.expected_ms),
        )
        return _status(h)

    @_unary
    async def Commit(
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandoffStatus:
        logprobs = None
        if request.HasField("first_token_logprobs"):
            logprobs = request.first_token_logprobs.SerializeToString()
        t = self._table.commit(
            request.request_id,
            request.first_token_id,
            request.bytes_written,
            self._clock(),
            first_token_logprobs=logprobs,
            draft_token_ids=list(request.draft_token_ids),
        )
        self._publish([t])
        return _status(t.handoff)

    @_unary
    async def Fail(
        self, request: pb.FailRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandoffStatus:
        cause = _cause(request.cause)
        t = self._table.fail(request.request_id, request.reason, self._clock(), cause)
        self._publish([t])
        return _status(t.handoff)

    @_unary
    async def Abort(
        self, request: pb.HandoffRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandoffStatus:
        t = self._table.abort(request.request_id, self._clock())
        self._publish([t])
        return _status(t.handoff)

    @_unary
    async def Release(
        self, request: pb.HandoffRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandoffStatus:
        t = self._table.release(request.request_id)
        self._publish([t])
        return _status(t.handoff)

    @_unary
    async def Get(
        self, request: pb.HandoffRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandoffStatus:
        return _status(self._table.get(request.request_id))

    @_unary
    async def Await(
        self, request: pb.AwaitRequest, context: grpc.aio.ServicerContext
    ) -> pb.HandoffStatus:
        deadline = self._clock() + _wait_s(request.wait_ms)
        while True:
            h = self._table.get(request.request_id)
            remaining = deadline - self._clock()
            if h.state.terminal or remaining <= 0 or self._closing:
                return _status(h)
            await self._wait_change(request.request_id, remaining)

    @_unary
    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListInstancesResponse:
        live = [inst.info for inst in self._instances.values() if inst.stream is not None]
        return pb.ListInstancesResponse(instances=live)
