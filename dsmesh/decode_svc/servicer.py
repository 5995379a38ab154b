"""dsmesh.v1.Decode: reserve pages, wait for prefill's KV through kv_broker, stream tokens.

The handoff's rules live in dsmesh/decode_svc/handoff.py as plain Python; this servicer converts
protos, calls kv_broker and the engine worker, and carries out what the handoff decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Status, StatusCode

from dsmesh.decode_svc.handoff import (
    DecodeHandoff,
    DecodeHandoffs,
    HandoffEnd,
    Release,
    Reservation,
    broker_unreachable,
)
from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.kv.pool import OutOfPagesError
from dsmesh.engine.llm_engine import LLMEngine, StepOutput
from dsmesh.engine.request import RequestStatus
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.instance.metrics import InstanceMetrics
from dsmesh.instance.prefixes import prefix_digest
from dsmesh.instance.rpc import parse_request, server_stream, unary
from dsmesh.instance.worker import EngineWorker, drain_outputs
from dsmesh.runtime import telemetry
from dsmesh.runtime.background import BackgroundTasks
from dsmesh.runtime.convert import logprobs_from_proto, logprobs_to_proto, spec_to_proto
from dsmesh.runtime.transfer import RemotePool
from dsmesh.runtime.waits import wait_set
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, generation_pb2, prefill_pb2
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

log = logging.getLogger(__name__)

AWAIT_WAIT_MS = 10_000  # one long poll of kv_broker's Await
RELEASE_POLL_S = 0.05  # how often to ask kv_broker whether prefill released a failed handoff


@dataclass(frozen=True)
class DecodeLimits:
    instance_id: str
    handoff_timeout_s: float = 30.0
    broker_rpc_timeout_s: float = 5.0


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Construct inside the running event loop. ``handoffs`` holds the reserve wait and the
    release quarantine; ``broker`` is a stub on the kv_broker link's channel."""

    def __init__(
        self,
        worker: EngineWorker,
        broker: kb_grpc.KVBrokerStub,
        layout: kb.KVLayout,
        pool: RemotePool,
        limits: DecodeLimits,
        handoffs: DecodeHandoffs,
        metrics: InstanceMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker = worker
        self.broker = broker
        self.layout = layout
        self.pool = pool
        self.limits = limits
        self.handoffs = handoffs
        self.metrics = metrics
        self._clock = clock
        self._room_freed = asyncio.Event()  # pages or a slot may have come free
        # requests in line for pages, and the reservations made for them (_reserve_line)
        self._asks: dict[str, _Ask] = {}
        self._granted: dict[str, Reservation | InvalidRequestError] = {}
        self._background = BackgroundTasks()

    # ---- Decode ---------------------------------------------------------------------------

    @server_stream
    async def Decode(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        rid, params = parse_request(request)
        # Opened before the first await, so a concurrent duplicate is refused.
        handoff = self.handoffs.open(rid, self._clock())
        prompt = list(request.input_ids)
        timeout_s = self.limits.handoff_timeout_s
        if request.handoff_timeout_ms > 0:
            timeout_s = request.handoff_timeout_ms / 1000
        cancelled = False
        try:
            reservation = await self._reserve(handoff, prompt, params)
            end = await self._handoff(handoff, prompt, reservation, timeout_s)
            stream = self._generate(handoff, len(prompt), end)
            async with contextlib.aclosing(stream) as messages:  # its span ends with the call
                async for message in messages:
                    yield message
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            release = handoff.call_ended(cancelled)
            if release is Release.NONE:
                self.handoffs.close(handoff)
            else:  # the id stays taken until the pages are back
                self._background.spawn(self._give_back(handoff, release))

    async def _reserve(
        self, handoff: DecodeHandoff, prompt: list[int], params: SamplingParams
    ) -> Reservation:
        """Pages (and a running slot) for the request, once every request before it has
        them; RESOURCE_EXHAUSTED when none come within the reserve wait. The first in line
        reserves for the whole line in one engine command (:meth:`_reserve_line`): requests
        that arrive together are not reserved one engine step apart."""
        rid = handoff.request_id
        self._asks[rid] = _Ask(handoff, prompt, params)
        try:
            while True:
                why = None
                if (
                    rid not in self._granted
                    and not handoff.engine_reserving  # a command is reserving for it now
                    and self.handoffs.first_in_line(handoff)
                ):
                    why = await self._reserve_line()
                granted = self._granted.pop(rid, None)
                if isinstance(granted, InvalidRequestError):
                    raise granted
                if granted is not None:
                    handoff.reserved()
                    return granted
                wait_s = self.handoffs.wait_for_room(handoff, why, self._clock())
                self._room_freed.clear()
                await wait_set(self._room_freed, wait_s)
        finally:
            # A grant not picked up (the call was cancelled or failed first): the handoff is
            # still RESERVING, so its end frees the pages with a command after the reserving
            # one (DecodeHandoff.call_ended).
            self._asks.pop(rid, None)
            self._granted.pop(rid, None)
            self.handoffs.leave_line(handoff)
            self._room_freed.set()  # the next in line tries now

    async def _reserve_line(self) -> str | None:
        """Reserve for the requests in line, in order, in one engine command, up to the
        first that finds no room: why it found none (None when every one got its pages).
        Each request picks up its grant in :meth:`_reserve` and leaves the line now, so that
        the next batch does not reserve for it again. The grants go out even if the caller
        is cancelled meanwhile (the others' pages are taken by then)."""
        # A request an engine command is reserving for already (its first in line was
        # cancelled meanwhile) waits for that command's answer: never reserved twice.
        line = [
            self._asks[h.request_id]
            for h in self.handoffs.line
            if h.request_id in self._asks and not h.engine_reserving
        ]
        for ask in line:
            ask.handoff.reserving()
        return await asyncio.shield(asyncio.ensure_future(self._grant(line)))

    async def _grant(self, line: list[_Ask]) -> str | None:
        try:
            granted, why = await self.worker.call(lambda e: _try_reserve_line(e, line))
        finally:
            for ask in line:
                ask.handoff.reserve_answered()
        for ask, result in zip(line, granted, strict=False):
            if self._asks.get(ask.request_id) is not ask:
                continue  # its call ended meanwhile: its end frees the pages after this
            self._granted[ask.request_id] = result
            self.handoffs.leave_line(ask.handoff)
        if granted:
            self._room_freed.set()
        return why

    async def _handoff(
        self,
        handoff: DecodeHandoff,
        prompt: list[int],
        reservation: Reservation,
        timeout_s: float,
    ) -> HandoffEnd:
        """Register the reservation with kv_broker and wait for the handoff's end, inside a
        ``decode.wait_kv`` span (the Reserve and Await calls are its children); returns the
        DONE handoff (its first token), or raises the call's failure."""
        rid = handoff.request_id
        num_prompt = len(prompt)
        attributes = {
            "dsmesh.request_id": rid,
            "dsmesh.kv.pages": len(reservation.page_ids),
            "dsmesh.kv.cached_pages": reservation.cached_pages,
        }
        with telemetry.tracer().start_as_current_span(
            "decode.wait_kv", attributes=attributes
        ) as span:
            await self._register(handoff, prompt, reservation, timeout_s)
            end = await self._await_end(rid)
            state = kb.HandoffState.Name(end.state)
            span.set_attributes(
                {
                    # as kv-broker's kv.handoff span has it
                    "dsmesh.handoff.state": state.removeprefix("HANDOFF_"),
                    "dsmesh.kv.bytes": end.bytes_written,
                    "dsmesh.prefill_instance_id": end.prefill_instance_id,
                }
            )
            if end.state != kb.HANDOFF_DONE:
                span.set_status(Status(StatusCode.ERROR, end.message))
        if self.metrics is not None:
            self.metrics.handoffs.labels(state).inc()
            if end.state == kb.HANDOFF_DONE:
                self.metrics.prompt_tokens.inc(num_prompt)
                skipped = reservation.cached_pages
                self.metrics.skipped_pages.inc(skipped)
                self.metrics.skipped_bytes.inc(
                    skipped * self.pool.page_bytes * self.pool.num_layers
                )
        handoff.ended(end)
        return end

    async def _register(
        self,
        handoff: DecodeHandoff,
        prompt: list[int],
        reservation: Reservation,
        timeout_s: float,
    ) -> None:
        reserve = kb.ReserveRequest(
            request_id=handoff.request_id,
            decode_instance_id=self.limits.instance_id,
            layout=self.layout,
            pool=kb.RemotePool(
                transfer_session=self.pool.session,
                base_ptr=self.pool.base_ptr,
                num_pages=self.pool.num_pages,
                page_bytes=self.pool.page_bytes,
            ),
            page_ids=reservation.page_ids,
            num_tokens=len(prompt),
            timeout_ms=int(timeout_s * 1000),
            cached_pages=reservation.cached_pages,
            cached_prefix=reservation.cached_prefix(prompt, self.layout.page_size),
        )
        try:
            await self.broker.Reserve(reserve, timeout=self.limits.broker_rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise handoff.refused(exc.code().name, exc.details() or "") from None
        handoff.registered()

    async def _await_end(self, rid: str) -> HandoffEnd:
        """Long-poll kv_broker until the handoff is terminal. kv_broker owns its deadline,
        which follows prefill's work (docs/PD.md); the call's own deadline bounds this too."""
        try:
            while True:
                status = await self.broker.Await(
                    kb.AwaitRequest(request_id=rid, wait_ms=AWAIT_WAIT_MS),
                    timeout=AWAIT_WAIT_MS / 1000 + self.limits.broker_rpc_timeout_s,
                )
                end = _end_of(status)
                if end.terminal:
                    return end
        except grpc.aio.AioRpcError as exc:
            return broker_unreachable(exc.code().name)

    async def _generate(
        self, handoff: DecodeHandoff, num_prompt: int, end: HandoffEnd
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """Join the running batch from the handoff's first token and stream the tokens,
        inside a ``decode.generate`` span."""
        rid = handoff.request_id
        span = telemetry.tracer().start_span(
            "decode.generate",
            attributes={"dsmesh.request_id": rid, "dsmesh.prompt_tokens": num_prompt},
        )
        completion = 0
        finished = False
        spec: tuple[int, int, int] | None = None  # speculation counts so far
        try:
            async for out in self._outputs(handoff, end):
                if not out.new_token_ids and not out.finished:
                    continue  # a recompute chunk after a retraction: no token yet
                finished = out.finished
                spec = out.spec_counts or spec
                completion += len(out.new_token_ids)
                if self.metrics is not None:
                    self.metrics.generated_tokens.inc(len(out.new_token_ids))
                if out.finished:
                    handoff.finished()
                    self._room_freed.set()  # its pages and slot are free
                    span.set_attribute("dsmesh.finish_reason", out.finish_reason or "")
                yield decode_pb2.DecodeResponse(
                    request_id=rid,
                    token_ids=out.new_token_ids,
                    finish_reason=out.finish_reason or "",
                    prompt_tokens=num_prompt,
                    completion_tokens=completion,
                    logprobs=[logprobs_to_proto(lp) for lp in out.logprobs or ()],
                    spec=spec_to_proto(spec),
                )
        finally:
            span.set_attribute("dsmesh.completion_tokens", completion)
            if not finished:
                span.set_status(Status(StatusCode.ERROR, "stream ended before the last token"))
            span.end()

    async def _outputs(self, handoff: DecodeHandoff, end: HandoffEnd) -> AsyncIterator[StepOutput]:
        """The request's step outputs from its activation (from the first token, its
        logprobs and the drafts after it, as the handoff ``end`` carries them) to its last
        token; only a finished "abort" output when decode's Abort came before the
        activation."""
        rid = handoff.request_id
        loop = asyncio.get_running_loop()
        streams: list[asyncio.Queue[StepOutput]] = []

        def activate(engine: LLMEngine) -> StepOutput:
            if handoff.aborted:  # the handoff is DONE: no prefill writes its pages any more
                engine.abort(rid)
                return StepOutput(rid, [], True, "abort")
            streams.append(self.worker.stream(rid, loop))
            out = engine.activate(
                rid, end.first_token_id, end.first_token_logprobs, end.draft_token_ids
            )
            if out.finished:
                self.worker.unlisten(rid)
            return out

        out = await self.worker.call(activate)
        while True:
            yield out
            if out.finished:
                return
            out = drain_outputs(await streams[0].get(), streams[0])

    # ---- giving pages back ----------------------------------------------------------------

    async def _give_back(self, handoff: DecodeHandoff, release: Release) -> None:
        """Free the pages of a call that ended early, as ``release`` says, then free its id."""
        rid = handoff.request_id
        try:
            if release is Release.ABORT_FIRST:
                answer = await self._broker_call("Abort", kb.HandoffRequest(request_id=rid))
                release = handoff.after_abort(None if answer is None else _end_of(answer))
            if release is Release.AFTER_PREFILL:
                await self._wait_prefill_release(handoff)
            elif release is Release.QUARANTINE:
                await asyncio.sleep(self.handoffs.release_quarantine_s)
        finally:
            try:
                await self.worker.call(lambda e: e.abort(rid))
            finally:
                self.handoffs.close(handoff)
                self._room_freed.set()

    async def _wait_prefill_release(self, handoff: DecodeHandoff) -> None:
        """Until kv_broker says prefill released the handoff, or the quarantine passes. A
        broker that cannot say (unreachable, or restarted without the record) proves nothing:
        prefill may still be writing, so that waits out the quarantine."""
        rid = handoff.request_id
        released = False
        while handoff.keep_waiting(self._clock(), released):
            status = await self._broker_call("Get", kb.HandoffRequest(request_id=rid))
            released = status is not None and status.prefill_released
            if not released:
                await asyncio.sleep(RELEASE_POLL_S)
        if not released:
            log.warning(
                "prefill never released handoff %s; reusing its pages after quarantine", rid
            )

    async def _broker_call(
        self, method: str, request: kb.HandoffRequest
    ) -> kb.HandoffStatus | None:
        """kv_broker's answer, or None when it gave none."""
        try:
            return await getattr(self.broker, method)(
                request, timeout=self.limits.broker_rpc_timeout_s
            )
        except grpc.aio.AioRpcError:
            return None

    async def drain(self) -> None:
        await self._background.drain()

    # ---- Abort / GetLoad ------------------------------------------------------------------

    @unary
    async def Abort(  # noqa: N802
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        rid = request.request_id
        # A call waiting for its handoff sees it ABORTED and frees safely; a running request
        # is stopped here, and its stream ends with finish_reason "abort".
        await self._broker_call("Abort", kb.HandoffRequest(request_id=rid))
        handoff = self.handoffs.get(rid)

        def stop(engine: LLMEngine) -> bool:
            req = engine.get(rid)
            if req is None or req.status is RequestStatus.FINISHED:
                return False
            if req.status is RequestStatus.RESERVED:
                # Not in the batch yet. Its handoff may have ended DONE before the Abort
                # reached kv_broker: then its activation, a later engine command, ends it.
                if handoff is None:
                    return False
                handoff.abort_before_start()
                return True
            # running, or retracted and waiting to recompute
            return self.worker.abort_request(engine, rid)

        aborted = await self.worker.call(stop)
        return generation_pb2.AbortResponse(aborted=aborted or rid in self.handoffs)

    @unary
    async def GetLoad(  # noqa: N802
        self, request: prefill_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.DecodeLoad:
        # with the changes of its prefix cache, so that a follow-up turn comes back here
        load, prefixes = await self.worker.call(lambda e: (e.load(), prefix_digest(e, request)))
        engine_config = self.worker.engine.config
        return decode_pb2.DecodeLoad(
            instance_id=self.limits.instance_id,
            free_pages=load.room_pages,  # retracted requests take theirs back first
            total_pages=load.total_pages,
            running_requests=load.num_running + load.num_waiting,  # with the retracted
            waiting_handoffs=self.handoffs.num_waiting + self.handoffs.num_in_line,
            page_size=engine_config.page_size,
            max_running_requests=engine_config.max_running_requests,
            prefixes=prefixes,
        )


def _end_of(status: kb.HandoffStatus) -> HandoffEnd:
    return HandoffEnd(
        state=status.state,
        cause=status.cause,
        message=status.message,
        first_token_id=status.first_token_id,
        first_token_logprobs=(
            logprobs_from_proto(status.first_token_logprobs)
            if status.HasField("first_token_logprobs")
            else None
        ),
        draft_token_ids=tuple(status.draft_token_ids),
        bytes_written=status.bytes_written,
        prefill_instance_id=status.prefill_instance_id,
        prefill_released=status.prefill_released,
    )


@dataclass(frozen=True)
class _Ask:
    """A request in line for pages: what reserving them takes."""

    handoff: DecodeHandoff
    prompt: list[int]
    params: SamplingParams

    @property
    def request_id(self) -> str:
        return self.handoff.request_id


def _try_reserve_line(
    engine: LLMEngine, line: list[_Ask]
) -> tuple[list[Reservation | InvalidRequestError], str | None]:
    """Engine thread: :func:`_try_reserve` for each request of ``line`` in order, up to the
    first that finds no room. Its results (an invalid request gets its error, and the line
    goes on past it), and why the line stopped (None: every request got its pages)."""
    results: list[Reservation | InvalidRequestError] = []
    for ask in line:
        try:
            got = _try_reserve(engine, ask.prompt, ask.params, ask.request_id)
        except InvalidRequestError as exc:
            results.append(exc)
            continue
        if isinstance(got, str):
            return results, got
        results.append(got)
    return results, None


def _try_reserve(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str
) -> Reservation | str:
    """Engine thread: the request's pages and a running slot now, or why not. A slot is held
    from the reservation on, so the running batch never outgrows ``max_running_requests``
    (the largest CUDA graph). The leading pages of the prompt that the prefix cache holds
    are shared, not written again. Invalid requests raise InvalidRequestError."""
    held = len(engine.requests)
    if held >= engine.config.max_running_requests:
        return f"all {held} request slots are taken (--max-running-requests)"
    try:
        req = engine.reserve(prompt, params, rid)
        return Reservation(list(req.pages), req.num_cached_pages)
    except OutOfPagesError as exc:
        return str(exc)
