"""dsmesh.v1.Prefill: run the prompt in chunks, write each chunk's KV into decode's pages,
commit the first token through kv_broker."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry.context import Context

from dsmesh import telemetry
from dsmesh.background import BackgroundTasks
from dsmesh.broker_link import BrokerLink
from dsmesh.convert import require_request_id, sampling_from_proto
from dsmesh.engine_worker import EngineWorker
from dsmesh.transfer import RemotePool
from dsmesh.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from engine.errors import InvalidRequestError
from engine.kv_cache import pages_for
from engine.llm_engine import LLMEngine, StepOutput
from prefill_svc.estimate import Backlog, StepRate
from prefill_svc.transfer_queue import ChunkJob, FinalJob, TransferCallbacks, TransferQueue

log = logging.getLogger(__name__)

_TERMINAL = (kb.HANDOFF_FAILED, kb.HANDOFF_ABORTED, kb.HANDOFF_TIMED_OUT)


class PrefillFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class PrefillLimits:
    instance_id: str
    resolve_wait_s: float = 30.0  # how long to wait for decode's reservation
    max_queued_tokens: int = 262144  # prompt tokens admitted and not finished, at most
    broker_rpc_timeout_s: float = 5.0
    # new prompts wait while the KV writes queued would take longer than this to drain
    max_transfer_backlog_s: float = 1.0


@dataclass
class _Job:
    request_id: str
    prompt_len: int
    done: asyncio.Future[tuple[int, int]]
    remote: RemotePool | None = None
    remote_pages: list[int] = field(default_factory=list)
    next_page: int = 0  # first request page not yet (fully) sent
    aborted: bool = False
    cached_tokens: int = 0
    trace_context: Context | None = None  # the Prefill RPC's, for spans made on other threads
    last_forward_ns: int = 0  # monotonic end of the forward that sampled the first token
    write_s: float = 0.0  # time the transfer lane spent writing this request's KV
    # Engine thread only: when the request was queued, the end of its last traced interval
    # (submit, then each chunk), and whether its prefill.queue span is still due.
    submit_ns: int = 0
    mark_ns: int = 0
    queued: bool = False


class _StepClock:
    """Engine thread: the time span of the step whose outputs are being delivered.

    Listeners run after a step, so its end is "now"; its start is taken as the end of the
    previous step (the worker steps back to back while there is work). Callers clamp it to
    the request's own last mark, which covers an engine that was idle before the step.
    """

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self._step = 0
        self._start_ns = 0
        self._end_ns = 0

    def bounds(self) -> tuple[int, int]:
        step = self.worker.num_steps
        if step != self._step:
            consecutive = step == self._step + 1
            self._start_ns = self._end_ns if consecutive else 0
            self._end_ns = time.time_ns()
            self._step = step
        return self._start_ns, self._end_ns


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        worker: EngineWorker,
        broker: BrokerLink,
        layout: kb.KVLayout,
        transfers: TransferQueue | None,
        limits: PrefillLimits,
    ) -> None:
        self.worker = worker
        self.broker = broker
        self.layout = layout
        self.limits = limits
        self.page_size = worker.engine.config.page_size
        self.jobs: dict[str, _Job] = {}
        self.metrics = None  # dsmesh.service_metrics.InstanceMetrics, when served
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transfers = transfers
        self._background = BackgroundTasks()
        self._steps = _StepClock(worker)
        self._token_rate = StepRate()  # prompt tokens per second of the forwards
        self._drained = asyncio.Event()  # a KV write finished: the backlog shrank
        # Engine thread: one CUDA event per step, recorded after its forward (GPU pools)
        self._fence: tuple[int, torch.cuda.Event] | None = None
        self._on_gpu = worker.engine.kv_pool.buffer.is_cuda
        broker.on_lost.append(self.on_broker_lost)

    def callbacks(self) -> TransferCallbacks:
        """Transfer-thread callbacks, bounced onto the event loop in the job's (trace)
        context, so the RPCs they start belong to the request's trace."""

        def hop(fn, *args) -> None:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(fn, *args, context=contextvars.copy_context())

        return TransferCallbacks(
            on_chunk=lambda rid, tokens, nbytes: hop(self._on_chunk, rid, tokens, nbytes),
            on_final=lambda rid, tok, nbytes, secs: hop(self._on_final, rid, tok, nbytes, secs),
            on_error=lambda rid, msg: hop(self._on_transfer_error, rid, msg),
            on_release=lambda rid: hop(self._on_release, rid),
        )

    # ---- Prefill --------------------------------------------------------------------------

    async def Prefill(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        rid = request.request_id
        try:
            require_request_id(rid)
            params = sampling_from_proto(request.sampling)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if rid in self.jobs:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already active")
        self.loop = asyncio.get_running_loop()
        prompt = list(request.input_ids)
        queued = sum(j.prompt_len for j in self.jobs.values())
        if queued + len(prompt) > self.limits.max_queued_tokens and self.jobs:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prefill is full: {queued} prompt tokens queued "
                f"(limit {self.limits.max_queued_tokens}); retry later",
            )
        job = _Job(
            rid, len(prompt), self.loop.create_future(), trace_context=telemetry.current_context()
        )
        self.jobs[rid] = job
        try:
            await self._resolve(job)
            await self._transfer_room()
            cached_pages = await self.worker.call(lambda e: self._submit(e, job, prompt, params))
            job.cached_tokens = cached_pages * self.page_size
            first_token, nbytes = await job.done
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(prompt))
                self.metrics.cached_tokens.inc(job.cached_tokens)
            with telemetry.tracer().start_as_current_span(
                "kv.commit", attributes={"dsmesh.request_id": rid, "dsmesh.kv.bytes": nbytes}
            ):
                handoff_s = await self._commit(job, first_token, nbytes)
            if self.metrics is not None:
                self.metrics.handoff_seconds.observe(handoff_s)
            return prefill_pb2.PrefillResponse(
                request_id=rid,
                first_token_id=first_token,
                prompt_tokens=len(prompt),
                cached_tokens=job.cached_tokens,
                kv_bytes=nbytes,
                kv_write_us=int(job.write_s * 1e6),
                handoff_us=int(handoff_s * 1e6),
            )
        except InvalidRequestError as exc:
            await self._fail(job, str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except PrefillFailed as exc:
            await context.abort(exc.code, str(exc))
        except asyncio.CancelledError:
            # The client went away: the request is aborted (decode answers CANCELLED), not failed.
            self._spawn(self._fail(job, "prefill call cancelled by its client", abort=True))
            raise
        finally:
            self.jobs.pop(rid, None)

    async def _resolve(self, job: _Job) -> None:
        req = kb.ResolveRequest(
            request_id=job.request_id,
            prefill_instance_id=self.limits.instance_id,
            layout=self.layout,
            wait_ms=int(self.limits.resolve_wait_s * 1000),
            expected_ms=self._expected_ms(job),
        )
        try:
            res = await self.broker.stub.Resolve(
                req, timeout=self.limits.resolve_wait_s + self.limits.broker_rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                code = grpc.StatusCode.UNAVAILABLE
            elif code == grpc.StatusCode.FAILED_PRECONDITION and await self._resolved_before(job):
                code = grpc.StatusCode.ALREADY_EXISTS  # a duplicate of a prefilled request
            raise PrefillFailed(code, f"cannot resolve the KV handoff: {exc.details()}") from exc
        needed = pages_for(job.prompt_len, self.page_size)
        if res.num_tokens != job.prompt_len or len(res.page_ids) < needed:
            message = (
                f"decode reserved {len(res.page_ids)} pages for {res.num_tokens} tokens; "
                f"this prompt has {job.prompt_len} tokens"
            )
            await self._broker_call(
                "Fail", kb.FailRequest(request_id=job.request_id, reason=message)
            )
            await self._release(job.request_id)  # nothing was written
            raise PrefillFailed(grpc.StatusCode.FAILED_PRECONDITION, message)
        job.remote = RemotePool(
            session=res.pool.transfer_session,
            base_ptr=res.pool.base_ptr,
            num_pages=res.pool.num_pages,
            page_bytes=res.pool.page_bytes,
            num_layers=self.layout.num_layers,
        )
        job.remote_pages = list(res.page_ids[:needed])

    def _expected_ms(self, job: _Job) -> int:
        """Time until ``job`` commits, at the measured rates: every prompt token admitted
        here (``job``'s included) still to compute, and every KV byte queued plus its own
        still to write (an over-estimate: kv_broker's deadline keeps ahead of it)."""
        queued = sum(j.prompt_len for j in self.jobs.values())
        pending = own = 0
        rate = 0.0
        if self.transfers is not None:
            pool = self.transfers.pool
            own = pages_for(job.prompt_len, self.page_size) * pool.page_bytes * pool.num_layers
            pending, rate = self.transfers.pending_bytes, self.transfers.write_rate.rate
        backlog = Backlog(queued, self._token_rate.rate, pending + own, rate)
        return int(backlog.seconds() * 1000)

    async def _transfer_room(self) -> None:
        """Hold a new prompt while the transfer lanes are more than
        ``max_transfer_backlog_s`` behind: prefill computes no more KV than they drain."""
        limit = self.limits.max_transfer_backlog_s
        while self.transfers is not None and self.transfers.backlog_s() > limit:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), 0.1)

    async def _resolved_before(self, job: _Job) -> bool:
        """Whether the handoff was already taken by a prefill (TRANSFERRING or DONE): the
        request id is then a duplicate, and the request must not run again."""
        status = await self._broker_call("Get", kb.HandoffRequest(request_id=job.request_id))
        return status is not None and status.state in (kb.HANDOFF_TRANSFERRING, kb.HANDOFF_DONE)

    def _submit(self, engine: LLMEngine, job: _Job, prompt: list[int], params) -> int:
        """On the engine thread: queue the prompt and route its outputs to the transfers."""
        if self.transfers is not None:
            self.transfers.begin(job.request_id)
        engine.add_request(prompt, params, request_id=job.request_id, prefill_only=True)
        job.submit_ns = job.mark_ns = time.time_ns()
        job.queued = True
        self.worker.listen(job.request_id, lambda out: self._on_output(engine, job, out))
        return engine.requests[job.request_id].num_cached_pages

    def _on_output(self, engine: LLMEngine, job: _Job, out: StepOutput) -> None:
        """Engine thread: a chunk's KV is in our pages; queue its write to decode."""
        req = engine.requests.get(job.request_id)
        if req is None or job.aborted or self.transfers is None:
            return
        if out.finished and out.finish_reason != "prefilled":
            assert self.loop is not None
            self.loop.call_soon_threadsafe(
                self._on_transfer_error, job.request_id, f"prefill failed: {out.finish_reason}"
            )
            return
        if telemetry.enabled():
            self._trace_chunk(job, out)
        start, end = out.computed
        self._token_rate.add(self.worker.num_steps, end - start, time.monotonic())
        if out.finished:
            job.last_forward_ns = time.monotonic_ns()
        last_page = pages_for(end, self.page_size)
        if last_page > job.next_page:
            assert job.remote is not None
            idx = range(job.next_page, last_page)
            self.transfers.put(
                ChunkJob(
                    job.request_id,
                    [req.pages[i] for i in idx],
                    [job.remote_pages[i] for i in idx],
                    job.remote,
                    end,
                    job.trace_context,
                    self._step_fence(),
                )
            )
            job.next_page = end // self.page_size  # a partial last page is re-sent later
        if out.finished:
            self.transfers.put(FinalJob(job.request_id, out.new_token_ids[0], job.trace_context))

    def _step_fence(self) -> torch.cuda.Event | None:
        """Engine thread: an event recorded after the current step's forward (one per step,
        shared by its chunks); None for a host pool, whose forward is done when it returns."""
        if not self._on_gpu:
            return None
        step = self.worker.num_steps
        if self._fence is None or self._fence[0] != step:
            event = torch.cuda.Event()
            event.record()
            self._fence = (step, event)
        return self._fence[1]

    def _trace_chunk(self, job: _Job, out: StepOutput) -> None:
        """Engine thread: record the forward that computed ``out`` as a ``prefill.chunk`` span,
        and the wait before the request's first forward as ``prefill.queue``."""
        start, end = out.computed
        if end <= start:
            return
        step_start_ns, step_end_ns = self._steps.bounds()
        chunk_start_ns = max(step_start_ns, job.mark_ns)
        if job.queued:
            job.queued = False
            telemetry.record_span(
                "prefill.queue",
                job.trace_context,
                job.submit_ns,
                chunk_start_ns,
                {"dsmesh.request_id": job.request_id, "dsmesh.cached_tokens": start},
            )
        telemetry.record_span(
            "prefill.chunk",
            job.trace_context,
            chunk_start_ns,
            step_end_ns,
            {
                "dsmesh.request_id": job.request_id,
                "dsmesh.chunk.tokens": end - start,
                "dsmesh.chunk.start": start,
                "dsmesh.chunk.end": end,
            },
        )
        job.mark_ns = step_end_ns

    def _abort_on_engine(self, engine: LLMEngine, job: _Job) -> bool:
        """Engine thread: stop the request; a request that never ran ends its queue span."""
        if job.queued:
            job.queued = False
            telemetry.record_span(
                "prefill.queue",
                job.trace_context,
                job.submit_ns,
                time.time_ns(),
                {"dsmesh.request_id": job.request_id},
                error="aborted before its first forward",
            )
        return engine.abort(job.request_id)

    async def _commit(self, job: _Job, first_token: int, nbytes: int) -> float:
        """Commit the first token, then free the pages; returns the seconds from the end of
        the last forward to the commit (what the handoff added to the request's TTFT)."""
        req = kb.CommitRequest(
            request_id=job.request_id, first_token_id=first_token, bytes_written=nbytes
        )
        try:
            await self.broker.stub.Commit(req, timeout=self.limits.broker_rpc_timeout_s)
            handoff_s = max(0, time.monotonic_ns() - job.last_forward_ns) / 1e9
        except grpc.aio.AioRpcError as exc:
            await self._fail(job, f"commit refused: {exc.details()}", tell_broker=False)
            raise PrefillFailed(
                grpc.StatusCode.ABORTED
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                else grpc.StatusCode.UNAVAILABLE,
                f"KV handoff could not be committed: {exc.details()}",
            ) from exc
        # Everything was written (the final job ran after every chunk): pages may be reused.
        await self.worker.call(lambda e: e.release(job.request_id))
        return handoff_s

    # ---- failure paths --------------------------------------------------------------------

    async def _fail(
        self, job: _Job, reason: str, tell_broker: bool = True, abort: bool = False
    ) -> None:
        """Stop the request here: drop queued writes, free pages once nothing is in flight.
        The broker is told the handoff FAILED, or ABORTED when ``abort`` (client gone)."""
        if job.aborted:
            return
        job.aborted = True
        if tell_broker and abort:
            await self._broker_call("Abort", kb.HandoffRequest(request_id=job.request_id))
        elif tell_broker:
            await self._broker_call(
                "Fail", kb.FailRequest(request_id=job.request_id, reason=reason)
            )
        await self.worker.call(lambda e: self._abort_on_engine(e, job))
        if self.transfers is not None and job.remote is not None:
            self.transfers.abort(job.request_id, job.trace_context)  # -> _on_release -> Release
        elif job.remote is not None:
            self._spawn(self._release(job.request_id))
        if not job.done.done():
            job.done.set_exception(PrefillFailed(grpc.StatusCode.ABORTED, reason))
            job.done.exception()  # retrieved: the Prefill call may be gone already

    def on_broker_event(self, event: kb.BrokerEvent) -> None:
        """Event loop: decode aborted, the handoff timed out or failed elsewhere."""
        job = self.jobs.get(event.request_id)
        if job is None or event.state not in _TERMINAL or job.aborted:
            return
        state = kb.HandoffState.Name(event.state)
        reason = f"KV handoff {state}: {event.message}".strip(": ")
        job.aborted = True
        self._spawn(self._stop_after_broker_end(job, reason, event.state))

    def on_broker_lost(self, why: str) -> None:
        """Event loop: the kv_broker stream dropped. Its handoff records may be gone (a
        restarted broker starts empty) and decode stops waiting when its own calls fail, so
        no live handoff can be committed: stop writing into decode's pages now rather than
        at the commit. Requests still resolving fail through their Resolve call."""
        for job in list(self.jobs.values()):
            if job.remote is None or job.aborted or job.done.done():
                continue
            job.aborted = True
            reason = f"{why}; the KV handoff cannot complete"
            self._spawn(self._stop_after_broker_end(job, reason, kb.HANDOFF_FAILED))

    async def _stop_after_broker_end(self, job: _Job, reason: str, state: int) -> None:
        await self.worker.call(lambda e: self._abort_on_engine(e, job))
        if self.transfers is not None and job.remote is not None:
            self.transfers.abort(job.request_id, job.trace_context)
        if not job.done.done():
            code = {
                kb.HANDOFF_ABORTED: grpc.StatusCode.CANCELLED,
                kb.HANDOFF_TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
            }.get(state, grpc.StatusCode.UNAVAILABLE)
            job.done.set_exception(PrefillFailed(code, reason))
            job.done.exception()  # retrieved: the Prefill call may be gone already

    def _on_chunk(self, rid: str, tokens: int, nbytes: int) -> None:
        self._drained.set()
        job = self.jobs.get(rid)
        if job is not None and not job.aborted:
            self._spawn(self._progress(rid, tokens, nbytes, self._expected_ms(job)))

    async def _progress(self, rid: str, tokens: int, nbytes: int, expected_ms: int) -> None:
        req = kb.ProgressRequest(
            request_id=rid, tokens_written=tokens, bytes_written=nbytes, expected_ms=expected_ms
        )
        status = await self._broker_call("Progress", req)
        if status is not None and status.state in _TERMINAL:
            event = kb.BrokerEvent(request_id=rid, state=status.state, message=status.message)
            self.on_broker_event(event)

    def _on_final(self, rid: str, first_token: int, nbytes: int, write_s: float) -> None:
        self._drained.set()
        job = self.jobs.get(rid)
        if job is not None and not job.done.done():
            job.write_s = write_s
            job.done.set_result((first_token, nbytes))

    def _on_transfer_error(self, rid: str, message: str) -> None:
        job = self.jobs.get(rid)
        if job is not None:
            self._spawn(self._fail(job, message))

    def _on_release(self, rid: str) -> None:
        self._spawn(self._release(rid))

    async def _release(self, rid: str) -> None:
        await self._broker_call("Release", kb.HandoffRequest(request_id=rid))

    async def _broker_call(self, method: str, request):
        try:
            return await getattr(self.broker.stub, method)(
                request, timeout=self.limits.broker_rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            log.info("kv_broker %s(%s) failed: %s", method, request.request_id, exc.details())
            return None

    def _spawn(self, coro) -> None:
        self._background.spawn(coro)

    async def drain(self) -> None:
        await self._background.drain()

    # ---- Abort / GetLoad ------------------------------------------------------------------

    async def Abort(  # noqa: N802
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        job = self.jobs.get(request.request_id)
        if job is None:
            return generation_pb2.AbortResponse(aborted=False)
        await self._fail(job, "aborted by the client", abort=True)
        return generation_pb2.AbortResponse(aborted=True)

    async def GetLoad(  # noqa: N802
        self, request: prefill_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillLoad:
        def load(e: LLMEngine) -> tuple[int, int, int, int]:
            waiting = sum(r.num_pending for r in e.scheduler.running if r.is_prefilling)
            waiting += sum(len(r.prompt_ids) for r in e.scheduler.waiting)
            return (
                waiting,
                len(e.scheduler.running) + len(e.scheduler.waiting),
                e.scheduler.num_pages_available,
                e.kv_pool.num_pages,
            )

        waiting, running, free, total = await self.worker.call(load)
        return prefill_pb2.PrefillLoad(
            instance_id=self.limits.instance_id,
            waiting_tokens=waiting,
            running_requests=running,
            free_pages=free,
            total_pages=total,
            max_queued_tokens=self.limits.max_queued_tokens,
        )
