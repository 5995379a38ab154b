"""dsmesh.v1.Prefill: run the prompt in chunks, write each chunk's KV into decode's pages,
commit the first token through kv_broker.

The handoff's rules live in dsmesh/prefill_svc/handoff.py as plain Python; this servicer converts
protos, calls kv_broker, the engine worker and the transfer lanes, and carries out what the
handoff decides. This module holds the request path (the RPCs, and on the engine thread the
prompt's chunks queued for writing, with their fences and trace spans); the transfer side
(the jobs in flight, the lanes' callbacks, progress reports, stops) is in handoff_jobs.py.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import torch

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.llm_engine import LLMEngine, StepOutput
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.instance.metrics import InstanceMetrics
from dsmesh.instance.prefixes import prefix_digest
from dsmesh.instance.rpc import parse_request, unary
from dsmesh.instance.worker import EngineWorker
from dsmesh.prefill_svc.handoff import (
    PrefillHandoff,
    check_admission,
    commit_failed,
    may_be_duplicate,
    resolve_failed,
    same_prefix,
)
from dsmesh.prefill_svc.handoff_jobs import HandoffJob, HandoffJobs
from dsmesh.prefill_svc.limits import PrefillLimits
from dsmesh.prefill_svc.transfer_queue import ChunkJob, FinalJob
from dsmesh.runtime import telemetry
from dsmesh.runtime.convert import logprobs_to_proto
from dsmesh.runtime.transfer import KVTransport, RemotePool
from dsmesh.v1 import generation_pb2, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

__all__ = ["PrefillLimits", "PrefillServicer"]  # PrefillLimits: re-exported for its callers


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
        self.handoffs = HandoffJobs(worker, broker, transport, limits, metrics)
        self.loop = asyncio.get_running_loop()
        self._steps = _StepClock(worker)
        # Engine thread: one CUDA event per step, recorded after its forward (GPU pools)
        self._fence: tuple[int, torch.cuda.Event] | None = None
        self._on_gpu = worker.engine.kv_pool.buffer.is_cuda

    @property
    def jobs(self) -> dict[str, HandoffJob]:
        """The Prefill calls in flight, by request id."""
        return self.handoffs.jobs

    async def drain(self) -> None:
        await self.handoffs.drain()

    def close(self) -> None:
        """After the engine thread stopped: stop the transfer lanes."""
        self.handoffs.close()

    def on_broker_event(self, event: kb.BrokerEvent) -> None:
        """Event loop: decode aborted, the handoff timed out or failed elsewhere."""
        self.handoffs.on_broker_event(event)

    def on_broker_lost(self, why: str) -> None:
        """Event loop: the kv_broker stream dropped; no handoff being written can commit."""
        self.handoffs.on_broker_lost(why)

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
        job = HandoffJob(handoff, self.loop.create_future(), telemetry.current_context())
        self.jobs[rid] = job
        try:
            await self._resolve(job, prompt)
            await self.handoffs.transfer_room(job)
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
            self.handoffs.spawn_stop(
                job, handoff.client_gone("prefill call cancelled by its client")
            )
            raise
        finally:
            self.jobs.pop(rid, None)

    async def _resolve(self, job: HandoffJob, prompt: list[int]) -> None:
        """Decode's pages for the prompt, through kv_broker (waiting for the reservation),
        less the leading ones decode holds already."""
        req = kb.ResolveRequest(
            request_id=job.request_id,
            prefill_instance_id=self.limits.instance_id,
            layout=self.layout,
            wait_ms=int(self.limits.resolve_wait_s * 1000),
            expected_ms=self.handoffs.expected_ms(job),
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
            await self.handoffs.stop(job, stop)
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
        status = await self.handoffs.broker_call("Get", kb.HandoffRequest(request_id=rid))
        return status is not None and status.state in (kb.HANDOFF_TRANSFERRING, kb.HANDOFF_DONE)

    async def _submit(self, job: HandoffJob, prompt: list[int], params: SamplingParams) -> None:
        job.handoff.submit()  # a request stopped meanwhile fails here, before the engine
        try:
            await self.worker.call(lambda e: self._start(e, job, prompt, params))
        except InvalidRequestError as exc:
            await self.handoffs.stop(job, job.handoff.fail(kb.CAUSE_INVALID_REQUEST, str(exc)))
            raise

    def _start(
        self, engine: LLMEngine, job: HandoffJob, prompt: list[int], params: SamplingParams
    ) -> None:
        """Engine thread: queue the prompt and route its outputs to the transfer lanes."""
        self.handoffs.transfers.begin(job.request_id)
        engine.add_request(prompt, params, request_id=job.request_id, prefill_only=True)
        job.submit_ns = job.mark_ns = time.time_ns()
        job.queued = True
        self.worker.listen(job.request_id, lambda out: self._on_output(engine, job, out))

    def _on_output(self, engine: LLMEngine, job: HandoffJob, out: StepOutput) -> None:
        """Engine thread: a chunk's KV is in our pages; queue its write to decode."""
        handoff = job.handoff
        req = engine.requests.get(job.request_id)
        if req is None or handoff.stopped:
            return
        if out.finished and out.finish_reason != "prefilled":
            reason = f"prefill failed: {out.finish_reason}"
            self.loop.call_soon_threadsafe(
                self.handoffs.on_failed, job.request_id, kb.CAUSE_PREFILL_FAILED, reason
            )
            return
        if telemetry.enabled():
            self._trace_chunk(job, out)
        job.prompt_logprobs += out.prompt_logprobs or ()
        start, end = out.computed
        self.handoffs.token_rate.add(self.worker.num_steps, end - start, time.monotonic())
        if out.finished:
            handoff.prefilled(time.monotonic())
            job.first_logprobs = out.logprobs[0] if out.logprobs else None
            job.draft_token_ids = engine.handoff_drafts(job.request_id)
            job.cached_tokens = req.num_cached_prompt_tokens or 0
        pages = handoff.pages_to_send(end)
        if pages:
            assert job.remote is not None
            self.handoffs.transfers.put(
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
            self.handoffs.transfers.put(
                FinalJob(job.request_id, out.new_token_ids[0], job.trace_context)
            )

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

    def _trace_chunk(self, job: HandoffJob, out: StepOutput) -> None:
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

    async def _commit(self, job: HandoffJob, first_token: int, nbytes: int) -> float:
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
            await self.handoffs.stop(job, job.handoff.commit_refused(failure))
            raise failure from exc
        handoff_s = job.handoff.committed(time.monotonic())
        # Everything was written (the final job ran after every chunk): pages may be reused.
        await self.worker.call(lambda e: e.release(job.request_id))
        return handoff_s

    # ---- Abort / GetLoad ------------------------------------------------------------------

    @unary
    async def Abort(  # noqa: N802
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        job = self.jobs.get(request.request_id)
        if job is None:
            return generation_pb2.AbortResponse(aborted=False)
        await self.handoffs.stop(job, job.handoff.client_gone("aborted by the client"))
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
