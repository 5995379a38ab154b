"""dsmesh.v1.Decode: reserve pages, wait for prefill's KV through kv_broker, stream tokens."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Status, StatusCode

from dsmesh import telemetry
from dsmesh.background import BackgroundTasks
from dsmesh.broker_link import BrokerLink
from dsmesh.convert import require_request_id, sampling_from_proto
from dsmesh.engine_worker import EngineWorker, drain_outputs
from dsmesh.transfer import RemotePool
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, generation_pb2, prefill_pb2
from dsmesh.v1 import kv_broker_pb2 as kb
from engine.errors import InvalidRequestError
from engine.kv_cache import OutOfPagesError
from engine.llm_engine import LLMEngine, StepOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_FAILED_STATES = {
    kb.HANDOFF_FAILED: grpc.StatusCode.UNAVAILABLE,
    kb.HANDOFF_TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    kb.HANDOFF_ABORTED: grpc.StatusCode.CANCELLED,
}


@dataclass(frozen=True)
class DecodeLimits:
    instance_id: str
    handoff_timeout_s: float = 30.0
    release_quarantine_s: float = 10.0  # longest wait for prefill's release before page reuse
    broker_rpc_timeout_s: float = 5.0
    # a request waits this long (in arrival order) for pages and a running slot; then
    # RESOURCE_EXHAUSTED. Routers that follow GetLoad rarely make it wait at all.
    reserve_wait_s: float = 10.0


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        worker: EngineWorker,
        broker: BrokerLink,
        layout: kb.KVLayout,
        pool: RemotePool,
        limits: DecodeLimits,
    ) -> None:
        self.worker = worker
        self.broker = broker
        self.layout = layout
        self.pool = pool
        self.limits = limits
        self.active: set[str] = set()
        self.waiting_handoffs = 0
        self._room_queue: deque[object] = deque()  # requests waiting for pages, oldest first
        self._room_freed = asyncio.Event()  # pages or a slot may have come free
        self.metrics = None  # dsmesh.service_metrics.InstanceMetrics, when served
        self._background = BackgroundTasks()

    # ---- Decode ---------------------------------------------------------------------------

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        rid = request.request_id
        try:
            require_request_id(rid)
            params = sampling_from_proto(request.sampling)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if rid in self.active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already active")
        # Claimed before the first await, so a concurrent duplicate is refused above.
        self.active.add(rid)
        prompt = list(request.input_ids)
        timeout_s = (
            request.handoff_timeout_ms / 1000
            if request.handoff_timeout_ms > 0
            else self.limits.handoff_timeout_s
        )
        try:
            pages = await self._reserve(rid, prompt, params)
        except InvalidRequestError as exc:
            self.active.discard(rid)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OutOfPagesError as exc:
            self.active.discard(rid)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode is full: {exc}")
        except asyncio.CancelledError:
            # The engine may still take the pages: free them after it (its commands are FIFO).
            self._spawn(self._forget_after(rid, self.worker.call(lambda e: e.abort(rid))))
            raise
        except BaseException:
            self.active.discard(rid)
            raise
        settled = False  # pages freed or handed to the running batch, nothing left to clean
        prefill_may_write = False
        freeing: Coroutine[None, None, None] | None = None  # frees the pages after the stream
        try:
            try:
                status = await self._handoff(rid, prompt, pages, timeout_s, context)
            except _Refused as exc:
                # kv_broker refused the reservation: the handoff (if any) is not ours to
                # abort - it may be a live duplicate's. Our pages are already free.
                settled = True
                await context.abort(exc.code, exc.message)
            if self.metrics is not None:
                self.metrics.handoffs.labels(kb.HandoffState.Name(status.state)).inc()
                if status.state == kb.HANDOFF_DONE:
                    self.metrics.prompt_tokens.inc(len(prompt))
            if status.state != kb.HANDOFF_DONE:
                code = _FAILED_STATES.get(status.state, grpc.StatusCode.UNAVAILABLE)
                if "layout mismatch" in status.message:
                    code = grpc.StatusCode.FAILED_PRECONDITION
                state = kb.HandoffState.Name(status.state)
                # End the stream now; the pages follow once prefill can no longer write them.
                freeing = self._release_after_prefill(rid, status)
                settled = True
                await context.abort(code, f"KV handoff {state}: {status.message}".strip(": "))
            span = telemetry.tracer().start_span(
                "decode.generate",
                attributes={"dsmesh.request_id": rid, "dsmesh.prompt_tokens": len(prompt)},
            )
            completion_tokens = 0
            try:
                async for out in self._decode_stream(rid, status.first_token_id):
                    settled = out.finished
                    completion_tokens = out.completion_tokens
                    if out.finished:
                        span.set_attribute("dsmesh.finish_reason", out.finish_reason or "")
                    yield decode_pb2.DecodeResponse(
                        request_id=rid,
                        token_ids=out.new_token_ids,
                        finish_reason=out.finish_reason or "",
                        prompt_tokens=len(prompt),
                        completion_tokens=out.completion_tokens,
                    )
            finally:
                span.set_attribute("dsmesh.completion_tokens", completion_tokens)
                if not settled:
                    span.set_status(Status(StatusCode.ERROR, "stream ended before the last token"))
                span.end()
        except asyncio.CancelledError:
            prefill_may_write = True  # cancelled mid-handoff: prefill may be writing
            raise
        finally:
            if not settled:
                freeing = self._cleanup(rid, prefill_may_write)
            if freeing is None:
                self.active.discard(rid)
            else:  # the id stays taken until its pages are free
                self._spawn(self._forget_after(rid, freeing))

    async def _reserve(self, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        """Pages (and a running slot) for the request: at once, or when enough come free, in
        arrival order, for up to ``reserve_wait_s``; OutOfPagesError after that."""
        ticket = object()
        self._room_queue.append(ticket)
        deadline = time.monotonic() + self.limits.reserve_wait_s
        try:
            while True:
                if self._room_queue[0] is ticket:
                    got = await self.worker.call(lambda e: _try_reserve(e, prompt, params, rid))
                    if isinstance(got, list):
                        return got
                    why = got
                else:
                    why = "requests before it are still waiting for room"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise OutOfPagesError(f"{why} (waited {self.limits.reserve_wait_s:g} s)")
                self._room_freed.clear()
                with contextlib.suppress(TimeoutError):  # also catches frees we do not see
                    await asyncio.wait_for(self._room_freed.wait(), min(remaining, 0.05))
        finally:
            self._room_queue.remove(ticket)
            self._room_freed.set()  # the next in line tries now

    async def _handoff(
        self,
        rid: str,
        prompt: list[int],
        pages: list[int],
        timeout_s: float,
        context: grpc.aio.ServicerContext,
    ) -> kb.HandoffStatus:
        """Register the reservation with kv_broker and wait until the handoff ends, inside a
        ``decode.wait_kv`` span (the Reserve and Await RPCs are its children)."""
        with telemetry.tracer().start_as_current_span(
            "decode.wait_kv", attributes={"dsmesh.request_id": rid, "dsmesh.kv.pages": len(pages)}
        ) as span:
            status = await self._reserve_and_wait(rid, prompt, pages, timeout_s, context)
            state = kb.HandoffState.Name(status.state).removeprefix("HANDOFF_")
            span.set_attributes(
                {
                    "dsmesh.handoff.state": state,  # as kv-broker's kv.handoff span has it
                    "dsmesh.kv.bytes": status.bytes_written,
                    "dsmesh.prefill_instance_id": status.prefill_instance_id,
                }
            )
            if status.state != kb.HANDOFF_DONE:
                span.set_status(Status(StatusCode.ERROR, status.message))
            return status

    async def _reserve_and_wait(
        self,
        rid: str,
        prompt: list[int],
        pages: list[int],
        timeout_s: float,
        context: grpc.aio.ServicerContext,
    ) -> kb.HandoffStatus:
        stub = self.broker.stub
        reserve = kb.ReserveRequest(
            request_id=rid,
            decode_instance_id=self.limits.instance_id,
            layout=self.layout,
            pool=kb.RemotePool(
                transfer_session=self.pool.session,
                base_ptr=self.pool.base_ptr,
                num_pages=self.pool.num_pages,
                page_bytes=self.pool.page_bytes,
            ),
            page_ids=pages,
            num_tokens=len(prompt),
            timeout_ms=int(timeout_s * 1000),
        )
        try:
            await stub.Reserve(reserve, timeout=self.limits.broker_rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.INVALID_ARGUMENT):
                # Certainly not registered: no prefill can write into these pages.
                await self.worker.call(lambda e: e.abort(rid))
                message = f"kv_broker refused the reservation: {exc.details()}"
                raise _Refused(code, message) from None
            if code == grpc.StatusCode.ABORTED:
                code = grpc.StatusCode.CANCELLED  # the request was aborted before we got here
            else:
                code = grpc.StatusCode.UNAVAILABLE
            # The reservation may have reached the broker (a lost answer): the cleanup aborts
            # it there and frees the pages only once no prefill can be writing them.
            await context.abort(code, f"kv_broker refused the reservation: {exc.details()}")
        self.waiting_handoffs += 1
        try:
            # kv_broker owns the deadline, which follows prefill's work (docs/PD.md); the
            # call's own deadline (the client's) bounds this loop too.
            wait_ms = 10_000
            while True:
                status = await stub.Await(
                    kb.AwaitRequest(request_id=rid, wait_ms=wait_ms),
                    timeout=wait_ms / 1000 + self.limits.broker_rpc_timeout_s,
                )
                if status.state not in (kb.HANDOFF_RESERVED, kb.HANDOFF_TRANSFERRING):
                    return status
        except grpc.aio.AioRpcError as exc:
            return kb.HandoffStatus(
                request_id=rid,
                state=kb.HANDOFF_FAILED,
                message=f"kv_broker unreachable: {exc.code().name}",
                prefill_instance_id="unknown",  # cannot tell whether prefill is writing
            )
        finally:
            self.waiting_handoffs -= 1

    async def _decode_stream(self, rid: str, first_token: int) -> AsyncIterator[_Out]:
        loop = asyncio.get_running_loop()
        streams: list[asyncio.Queue[StepOutput]] = []
        count = 0

        def activate(engine: LLMEngine) -> StepOutput:
            streams.append(self.worker.stream(rid, loop))
            out = engine.activate(rid, first_token)
            if out.finished:
                self.worker.unlisten(rid)
            return out

        out = await self.worker.call(activate)
        outputs = streams[0]
        while True:
            count += len(out.new_token_ids)
            if self.metrics is not None:
                self.metrics.generated_tokens.inc(len(out.new_token_ids))
            if out.finished:
                self._room_freed.set()  # its pages and slot are free
            yield _Out(out.new_token_ids, out.finished, out.finish_reason, count)
            if out.finished:
                return
            out = drain_outputs(await outputs.get(), outputs)

    # ---- cleanup --------------------------------------------------------------------------

    async def _release_after_prefill(self, rid: str, status: kb.HandoffStatus) -> None:
        """Free a failed handoff's pages, but only once prefill can no longer write them."""
        if status.prefill_instance_id and not status.prefill_released:
            await self._wait_prefill_release(rid)
        await self.worker.call(lambda e: e.abort(rid))

    async def _wait_prefill_release(self, rid: str) -> None:
        """Until kv_broker says prefill released the handoff, or the quarantine passes. A
        broker that cannot say (unreachable, or restarted and without the record) proves
        nothing: prefill may still be writing, so that waits out the quarantine."""
        deadline = time.monotonic() + self.limits.release_quarantine_s
        while time.monotonic() < deadline:
            try:
                status = await self.broker.stub.Get(
                    kb.HandoffRequest(request_id=rid), timeout=self.limits.broker_rpc_timeout_s
                )
                if status.prefill_released:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.05)
        log.warning("prefill never released handoff %s; reusing its pages after quarantine", rid)

    async def _forget_after(self, rid: str, freeing: Coroutine[None, None, None]) -> None:
        try:
            await freeing
        finally:
            self.active.discard(rid)
            self._room_freed.set()

    async def _cleanup(self, rid: str, prefill_may_write: bool) -> None:
        """Client went away or the stream failed: abort on both sides, free pages safely."""
        try:
            status = await self.broker.stub.Abort(
                kb.HandoffRequest(request_id=rid), timeout=self.limits.broker_rpc_timeout_s
            )
            writing = prefill_may_write or bool(status.prefill_instance_id)
            if writing and not status.prefill_released and status.state != kb.HANDOFF_DONE:
                await self._wait_prefill_release(rid)
        except grpc.aio.AioRpcError:
            if prefill_may_write:
                await asyncio.sleep(self.limits.release_quarantine_s)
        finally:
            await self.worker.call(lambda e: e.abort(rid))

    def _spawn(self, coro) -> None:
        self._background.spawn(coro)

    async def drain(self) -> None:
        await self._background.drain()

    # ---- Abort / GetLoad ------------------------------------------------------------------

    async def Abort(  # noqa: N802
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        rid = request.request_id
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.broker.stub.Abort(
                kb.HandoffRequest(request_id=rid), timeout=self.limits.broker_rpc_timeout_s
            )
        # A waiting Decode call sees the ABORTED handoff and frees safely; a running one is
        # stopped here.
        running = await self.worker.call(
            lambda e: (r := e.get(rid)) is not None and r.status is RequestStatus.RUNNING
        )
        aborted = False
        if running:
            aborted = await self.worker.call(lambda e: self.worker.abort_request(e, rid))
        return generation_pb2.AbortResponse(aborted=aborted or rid in self.active)

    async def GetLoad(  # noqa: N802
        self, request: prefill_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.DecodeLoad:
        def load(e: LLMEngine) -> tuple[int, int, int]:
            return (
                e.scheduler.num_pages_available,
                e.kv_pool.num_pages,
                len(e.scheduler.running),
            )

        free, total, running = await self.worker.call(load)
        engine_config = self.worker.engine.config
        return decode_pb2.DecodeLoad(
            instance_id=self.limits.instance_id,
            free_pages=free,
            total_pages=total,
            running_requests=running,
            waiting_handoffs=self.waiting_handoffs + len(self._room_queue),
            page_size=engine_config.page_size,
            max_running_requests=engine_config.max_running_requests,
        )


def _try_reserve(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str
) -> list[int] | str:
    """Engine thread: the request's pages and a running slot now, or why not. A slot is held
    from the reservation on, so the running batch never outgrows ``max_running_requests``
    (the largest CUDA graph). Invalid requests raise InvalidRequestError."""
    held = len(engine.requests)
    if held >= engine.config.max_running_requests:
        return f"all {held} request slots are taken (--max-running-requests)"
    try:
        return list(engine.reserve(prompt, params, rid).pages)
    except OutOfPagesError as exc:
        return str(exc)


class _Refused(Exception):
    """kv_broker refused the reservation outright; our pages were freed."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class _Out:
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    completion_tokens: int
