"""dsmesh.v1.Prefill: run the prompt in chunks, write each chunk's KV into decode's pages,
commit the first token through kv_broker.

The handoff's rules live in dsmesh/prefill_svc/handoff.py as plain Python; this servicer converts
protos, calls kv_broker, the engine worker and the transfer lanes, and carries out what the
handoff decides.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field

import grpc
import torch
from opentelemetry.context import Context

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.kv.pool import pages_for
from dsmesh.engine.llm_engine import LLMEngine, StepOutput
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.instance.failures import CallFailed
from dsmesh.instance.metrics import InstanceMetrics
from dsmesh.instance.prefixes import prefix_digest
from dsmesh.instance.rpc import parse_request, unary
from dsmesh.instance.worker import EngineWorker
from dsmesh.prefill_svc.estimate import Backlog, StepRate
from dsmesh.prefill_svc.handoff import (
    Free,
    Notice,
    PrefillHandoff,
    Stop,
    check_admission,
    commit_failed,
    may_be_duplicate,
    resolve_failed,
    same_prefix,
)
from dsmesh.prefill_svc.transfer_queue import ChunkJob, FinalJob, TransferCallbacks, TransferQueue
from dsmesh.runtime import telemetry
from dsmesh.runtime.background import BackgroundTasks
from dsmesh.runtime.convert import logprobs_to_proto
from dsmesh.runtime.transfer import KVTransport, RemotePool
from dsmesh.runtime.waits import wait_set
from dsmesh.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillLimits:
    instance_id: str
    resolve_wait_s: float = 30.0  # how long to wait for decode's reservation
    max_queued_tokens: int = 262144  # prompt tokens admitted and not finished, at most
    broker_rpc_timeout_s: float = 5.0
    # new prompts wait while the KV writes queued would take longer than this to drain
    max_transfer_backlog_s: float = 1.0
    # while writes to a decode complete, a handoff waiting on them reports at this period:
    # its kv_broker deadline follows the lane's pace (docs/PD.md, "Deadlines")
    progress_refresh_s: float = 2.0


@dataclass
class _Job:
    handoff: PrefillHandoff
    done: asyncio.Future[tuple[int, int]]  # first token and KV bytes, once every write landed
    trace_context: Context | None = None  # the Prefill RPC's, for spans made on other threads
    remote: RemotePool | None = None  # decode's pool, once resolved
    cached_tokens: int = 0  # prompt tokens the prefix cache served (set when prefilled)
    write_s: float = 0.0  # time the transfer lane spent writing this request's KV
    tokens_written: int = 0  # reported to kv_broker with the bytes (cumulative)
    bytes_written: int = 0
    reported_at: float = 0.0  # monotonic time of the last deadline report (Resolve, Progress)
    # the first token's logprobs, when the request asks for them (set when prefilled)
    first_logprobs: TokenLogprobs | None = None
    # speculative decoding: the tokens drafted after the first one, for decode's first step
    # (set when prefilled)
    draft_token_ids: list[int] = field(default_factory=list)
    # engine thread: the prompt logprobs so far, when the request asks for them
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Engine thread only: when the request was queued, the end of its last traced interval
    # (submit, then each chunk), and whether its prefill.queue span is still due.
    submit_ns: int = 0
    mark_ns: int = 0
    queued: bool = False

    @property
    def request_id(self) -> str:
        return self.handoff.request_id

    def fail(self, error: CallFailed) -> None:
        """The call, if it still waits for its writes, fails with ``error``."""
        if not self.done.done():
            self.done.set_exception(error)
            self.done.exception()  # retrieved: the Prefill call may be gone already


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
    """Construct inside the running event loop: the transfer lanes it starts (one per decode
    peer, writing through ``transport``) call back onto that loop. ``broker`` is a stub on
    the kv_broker link's channel; the link delivers :meth:`on_broker_event` and
    :meth:`on_broker_lost`."""

    def __init__(
        self,
        worker: EngineWorker,
        broker: kb_grpc.KVBrokerStub,
        layout: kb.KVLayout,
        transport: KVTransport,
        limits: PrefillLimits,
        metrics: InstanceMetrics | None = None,
    ) -> None:
        self.worker = worker
        self.broker = broker
        self.layout = layout
        self.limits = limits
        self.metrics = metrics
        self.page_size = worker.engine.config.page_size
        self.jobs: dict[str, _Job] = {}
        self.loop = asyncio.get_running_loop()
        self.transfers = TransferQueue(transport, worker.engine.kv_pool, self._callbacks(), metrics)
        self._background = BackgroundTasks()
        self._steps = _StepClock(worker)
        self._token_rate = StepRate()  # prompt tokens per second of the forwards
        self._drained = asyncio.Event()  # a KV write finished: the backlog shrank
        # Engine thread: one CUDA event per step, recorded after its forward (GPU pools)
        self._fence: tuple[int, torch.cuda.Event] | None = None
        self._on_gpu = worker.engine.kv_pool.buffer.is_cuda

    def _callbacks(self) -> TransferCallbacks:
        """Transfer-thread callbacks, bounced onto the event loop in the job's (trace)
        context, so the RPCs they start belong to the request's trace."""

        def hop(fn, *args) -> None:
            self.loop.call_soon_threadsafe(fn, *args, context=contextvars.copy_context())

        return TransferCallbacks(
            on_chunk=lambda rid, tokens, nbytes: hop(self._on_chunk, rid, tokens, nbytes),
            on_final=lambda rid, tok, nbytes, secs: hop(self._on_final, rid, tok, nbytes, secs),
            on_error=lambda rid, cause, msg: hop(self._on_failed, rid, cause, msg),
            on_release=lambda rid: hop(self._on_release, rid),
        )

    async def drain(self) -> None:
        await self._background.drain()

    def close(self) -> None:
        """After the engine thread stopped: stop the transfer lanes."""
        self.transfers.stop()

    # ---- Prefill --------------------------------------------------------------------------

    @unary
    async def Prefill(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        rid, params = parse_request(request)
        prompt = list(request.input_ids)
        queued = {r: job.handoff.prompt_len for r, job in self.jobs.items()}
        check_admission(rid, len(prompt), queued, self.limits.max_queued_tokens)
        handoff = PrefillHandoff(rid, len(prompt), self.page_size)
        job = _Job(handoff, self.loop.create_future(), telemetry.current_context())
        self.jobs[rid] = job
        try:
            await self._resolve(job, prompt)
            await self._transfer_room(job)
            await self._submit(job, prompt, params)
            first_token, nbytes = await job.done
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(prompt))
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
                # complete: the engine thread added the last before the final write's job
                prompt_logprobs=[logprobs_to_proto(lp) for lp in job.prompt_logprobs],
            )
        except asyncio.CancelledError:
            # The client went away: the request is aborted (decode answers CANCELLED), not failed.
            self._spawn_stop(job, handoff.client_gone("prefill call cancelled by its client"))
            raise
        finally:
            self.jobs.pop(rid, None)

    async def _resolve(self, job: _Job, prompt: list[int]) -> None:
        """Decode's pages for the prompt, through kv_broker (waiting for the reservation),
        less the leading ones decode holds already."""
        req = kb.ResolveRequest(
            request_id=job.request_id,
            prefill_instance_id=self.limits.instance_id,
            layout=self.layout,
            wait_ms=int(self.limits.resolve_wait_s * 1000),
            expected_ms=self._expected_ms(job),
        )
        try:
            job.reported_at = time.monotonic()
            res = await self.broker.Resolve(
                req, timeout=self.limits.resolve_wait_s + self.limits.broker_rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            taken = may_be_duplicate(code) and await self._resolved_before(job.request_id)
            raise resolve_failed(code, exc.details() or "", taken) from exc
        same = same_prefix(prompt, res.cached_pages, res.cached_prefix, self.page_size)
        stop = job.handoff.resolved(res.num_tokens, list(res.page_ids), res.cached_pages, same)
        if stop is not None:
            await self._stop(job, stop)
            raise stop.error
        job.remote = RemotePool(
            session=res.pool.transfer_session,
            base_ptr=res.pool.base_ptr,
            num_pages=res.pool.num_pages,
            page_bytes=res.pool.page_bytes,
            num_layers=self.layout.num_layers,
        )

    async def _resolved_before(self, rid: str) -> bool:
        """Whether a prefill took the handoff already (TRANSFERRING or DONE): the request id
        is then a duplicate, and the request must not run again."""
        status = await self._broker_call("Get", kb.HandoffRequest(request_id=rid))
        return status is not None and status.state in (kb.HANDOFF_TRANSFERRING, kb.HANDOFF_DONE)

    def _expected_ms(self, job: _Job) -> int:
        """Time until ``job`` commits, at the measured rates: every prompt token admitted
        here (``job``'s included) still to compute, and every KV byte queued plus its own
        still to write (an over-estimate: kv_broker's deadline keeps ahead of it)."""
        queued = sum(j.handoff.prompt_len for j in self.jobs.values())
        pool = self.transfers.pool
        own_pages = pages_for(job.handoff.prompt_len, self.page_size) - job.handoff.cached_pages
        own = own_pages * pool.page_bytes * pool.num_layers
        pending, rate = self.transfers.pending_bytes, self.transfers.write_rate.rate
        backlog = Backlog(queued, self._token_rate.rate, pending + own, rate)
        return int(backlog.seconds() * 1000)

    async def _transfer_room(self, job: _Job) -> None:
        """Hold a new prompt while the transfer lanes are more than
        ``max_transfer_backlog_s`` behind: prefill computes no more KV than they drain."""
        limit = self.limits.max_transfer_backlog_s
        while not job.handoff.stopped and self.transfers.backlog_s() > limit:
            self._drained.clear()
            await wait_set(self._drained, 0.1)

    async def _submit(self, job: _Job, prompt: list[int], params: SamplingParams) -> None:
        job.handoff.submit()  # a request stopped meanwhile fails here, before the engine
        try:
            await self.worker.call(lambda e: self._start(e, job, prompt, params))
        except InvalidRequestError as exc:
            await self._stop(job, job.handoff.fail(kb.CAUSE_INVALID_REQUEST, str(exc)))
            raise

    def _start(
        self, engine: LLMEngine, job: _Job, prompt: list[int], params: SamplingParams
    ) -> None:
        """Engine thread: queue the prompt and route its outputs to the transfer lanes."""
        self.transfers.begin(job.request_id)
        engine.add_request(prompt, params, request_id=job.request_id, prefill_only=True)
        job.submit_ns = job.mark_ns = time.time_ns()
        job.queued = True
        self.worker.listen(job.request_id, lambda out: self._on_output(engine, job, out))

    def _on_output(self, engine: LLMEngine, job: _Job, out: StepOutput) -> None:
        """Engine thread: a chunk's KV is in our pages; queue its write to decode."""
        handoff = job.handoff
        req = engine.requests.get(job.request_id)
        if req is None or handoff.stopped:
            return
        if out.finished and out.finish_reason != "prefilled":
            reason = f"prefill failed: {out.finish_reason}"
            self.loop.call_soon_threadsafe(
                self._on_failed, job.request_id, kb.CAUSE_PREFILL_FAILED, reason
            )
            return
        if telemetry.enabled():
            self._trace_chunk(job, out)
        job.prompt_logprobs += out.prompt_logprobs or ()
        start, end = out.computed
        self._token_rate.add(self.worker.num_steps, end - start, time.monotonic())
        if out.finished:
            handoff.prefilled(time.monotonic())
            job.first_logprobs = out.logprobs[0] if out.logprobs else None
            job.draft_token_ids = engine.handoff_drafts(job.request_id)
            job.cached_tokens = req.num_cached_prompt_tokens or 0
        pages = handoff.pages_to_send(end)
        if pages:
            assert job.remote is not None
            self.transfers.put(
                ChunkJob(
                    job.request_id,
                    [req.pages[i] for i in pages],
                    [handoff.remote_pages[i] for i in pages],
                    job.remote,
                    end,
                    job.trace_context,
                    self._step_fence(),
                )
            )
        if out.finished:
            self.transfers.put(FinalJob(job.request_id, out.new_token_ids[0], job.trace_context))

    # ---- engine thread: fences and traces --------------------------------------------------

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
        if job.first_logprobs is not None:  # set on the engine thread before the final write
            req.first_token_logprobs.CopyFrom(logprobs_to_proto(job.first_logprobs))
        req.draft_token_ids.extend(job.draft_token_ids)  # set with first_logprobs
        try:
            await self.broker.Commit(req, timeout=self.limits.broker_rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            failure = commit_failed(exc.code().name, exc.details() or "")
            await self._stop(job, job.handoff.commit_refused(failure))
            raise failure from exc
        handoff_s = job.handoff.committed(time.monotonic())
        # Everything was written (the final job ran after every chunk): pages may be reused.
        await self.worker.call(lambda e: e.release(job.request_id))
        return handoff_s

    # ---- stops ----------------------------------------------------------------------------

    async def _stop(self, job: _Job, stop: Stop | None) -> None:
        """Carry out ``stop``: tell kv_broker, abort the prompt in the engine, give decode's
        pages back, and fail the call if it still waits for its writes."""
        if stop is None:
            return
        rid = job.request_id
        if stop.notice is Notice.FAIL:
            fail = kb.FailRequest(request_id=rid, reason=stop.reason, cause=stop.cause)
            await self._broker_call("Fail", fail)
        elif stop.notice is Notice.ABORT:
            await self._broker_call("Abort", kb.HandoffRequest(request_id=rid))
        if stop.in_engine:
            await self.worker.call(lambda e: self._abort_on_engine(e, job))
        if stop.free is Free.LANES:
            self.transfers.abort(rid, job.trace_context)  # -> _on_release -> Release
        elif stop.free is Free.RELEASE:
            await self._release(rid)
        job.fail(stop.error)

    def _spawn_stop(self, job: _Job, stop: Stop | None) -> None:
        if stop is not None:
            self._background.spawn(self._stop(job, stop))

    def on_broker_event(self, event: kb.BrokerEvent) -> None:
        """Event loop: decode aborted, the handoff timed out or failed elsewhere."""
        job = self.jobs.get(event.request_id)
        if job is not None:
            stop = job.handoff.broker_ended(event.state, event.cause, event.message)
            self._spawn_stop(job, stop)

    def on_broker_lost(self, why: str) -> None:
        """Event loop: the kv_broker stream dropped; no handoff being written can commit."""
        for job in list(self.jobs.values()):
            self._spawn_stop(job, job.handoff.broker_lost(why))

    # ---- transfer lanes' callbacks, on the event loop -------------------------------------

    def _on_chunk(self, rid: str, tokens: int, nbytes: int) -> None:
        self._drained.set()
        job = self.jobs.get(rid)
        if job is None or job.handoff.stopped:
            return
        job.tokens_written, job.bytes_written = tokens, nbytes
        self._report(job, time.monotonic())
        if job.remote is not None:
            self._refresh_waiting(job.remote.session)

    def _refresh_waiting(self, session: str) -> None:
        """A write to ``session`` landed: the handoffs still waiting for their writes to it
        (in the engine, behind other writes, or for room in the lanes) report again, at most
        once per ``progress_refresh_s``, so their deadlines follow the lane's measured pace.
        A lane that makes no progress (its peer gone dark) extends no deadline."""
        now = time.monotonic()
        for job in self.jobs.values():
            if (
                job.remote is not None
                and job.remote.session == session
                and not job.handoff.stopped
                and not job.done.done()
                and now - job.reported_at >= self.limits.progress_refresh_s
            ):
                self._report(job, now)

    def _report(self, job: _Job, now: float) -> None:
        job.reported_at = now
        self._background.spawn(
            self._progress(job, job.tokens_written, job.bytes_written, self._expected_ms(job))
        )

    async def _progress(self, job: _Job, tokens: int, nbytes: int, expected_ms: int) -> None:
        req = kb.ProgressRequest(
            request_id=job.request_id,
            tokens_written=tokens,
            bytes_written=nbytes,
            expected_ms=expected_ms,
        )
        status = await self._broker_call("Progress", req)
        if status is not None:  # the handoff may have ended: then stop writing
            self._spawn_stop(
                job, job.handoff.broker_ended(status.state, status.cause, status.message)
            )

    def _on_final(self, rid: str, first_token: int, nbytes: int, write_s: float) -> None:
        self._drained.set()
        job = self.jobs.get(rid)
        if job is not None and job.handoff.written():
            job.write_s = write_s
            job.done.set_result((first_token, nbytes))

    def _on_failed(self, rid: str, cause: int, message: str) -> None:
        job = self.jobs.get(rid)
        if job is not None:
            self._spawn_stop(job, job.handoff.fail(cause, message))

    def _on_release(self, rid: str) -> None:
        self._background.spawn(self._release(rid))

    async def _release(self, rid: str) -> None:
        await self._broker_call("Release", kb.HandoffRequest(request_id=rid))

    async def _broker_call(self, method: str, request):
        try:
            return await getattr(self.broker, method)(
                request, timeout=self.limits.broker_rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            log.info("kv_broker %s(%s) failed: %s", method, request.request_id, exc.details())
            return None

    # ---- Abort / GetLoad ------------------------------------------------------------------

    @unary
    async def Abort(  # noqa: N802
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        job = self.jobs.get(request.request_id)
        if job is None:
            return generation_pb2.AbortResponse(aborted=False)
        await self._stop(job, job.handoff.client_gone("aborted by the client"))
        return generation_pb2.AbortResponse(aborted=True)

    @unary
    async def GetLoad(  # noqa: N802
        self, request: prefill_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillLoad:
        load, prefixes = await self.worker.call(lambda e: (e.load(), prefix_digest(e, request)))
        return prefill_pb2.PrefillLoad(
            instance_id=self.limits.instance_id,
            waiting_tokens=load.pending_prompt_tokens,
            running_requests=load.num_running + load.num_waiting,
            free_pages=load.free_pages,
            total_pages=load.total_pages,
            max_queued_tokens=self.limits.max_queued_tokens,
            prefixes=prefixes,
        )
