"""Prefill's handoffs in flight, on the event loop: the transfer side of the Prefill servicer
(dsmesh/prefill_svc/servicer.py holds the request path).

Each Prefill call has a :class:`HandoffJob` here: its handoff (whose rules live in handoff.py),
the future the call waits on until every KV write landed, and what the transfer lanes wrote.
:class:`HandoffJobs` holds the job table and the transfer lanes (transfer_queue.py), takes
their callbacks, reports progress and the expected time to commit to kv_broker, and carries
out a handoff's stops: tell kv_broker, abort the prompt in the engine, give decode's pages
back, fail the call.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context

from dsmesh.engine.kv.pool import pages_for
from dsmesh.engine.llm_engine import LLMEngine
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.instance.failures import CallFailed
from dsmesh.instance.metrics import InstanceMetrics
from dsmesh.instance.worker import EngineWorker
from dsmesh.prefill_svc.estimate import Backlog, StepRate
from dsmesh.prefill_svc.handoff import Free, Notice, PrefillHandoff, Stop
from dsmesh.prefill_svc.limits import PrefillLimits
from dsmesh.prefill_svc.transfer_queue import TransferCallbacks, TransferQueue
from dsmesh.runtime import telemetry
from dsmesh.runtime.background import BackgroundTasks
from dsmesh.runtime.transfer import KVTransport, RemotePool
from dsmesh.runtime.waits import wait_set
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

log = logging.getLogger(__name__)


@dataclass
class HandoffJob:
    """One Prefill call's handoff, from its arrival to its commit or stop."""

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


class HandoffJobs:
    """The handoffs of the Prefill calls in flight, by request id (``jobs``). Construct inside
    the running event loop: the transfer lanes it starts (one per decode peer, writing through
    ``transport``) call back onto that loop. ``broker`` is a stub on the kv_broker link's
    channel. Event loop only, but for ``token_rate``, which the engine thread adds to."""

    def __init__(
        self,
        worker: EngineWorker,
        broker: kb_grpc.KVBrokerStub,
        transport: KVTransport,
        limits: PrefillLimits,
        metrics: InstanceMetrics | None = None,
    ) -> None:
        self.worker = worker
        self.broker = broker
        self.limits = limits
        self.page_size = worker.engine.config.page_size
        self.jobs: dict[str, HandoffJob] = {}
        self.loop = asyncio.get_running_loop()
        self.transfers = TransferQueue(transport, worker.engine.kv_pool, self._callbacks(), metrics)
        self._background = BackgroundTasks()
        self.token_rate = StepRate()  # prompt tokens per second of the forwards
        self._drained = asyncio.Event()  # a KV write finished: the backlog shrank

    def _callbacks(self) -> TransferCallbacks:
        """Transfer-thread callbacks, bounced onto the event loop in the job's (trace)
        context, so the RPCs they start belong to the request's trace."""

        def hop(fn, *args) -> None:
            self.loop.call_soon_threadsafe(fn, *args, context=contextvars.copy_context())

        return TransferCallbacks(
            on_chunk=lambda rid, tokens, nbytes: hop(self._on_chunk, rid, tokens, nbytes),
            on_final=lambda rid, tok, nbytes, secs: hop(self._on_final, rid, tok, nbytes, secs),
            on_error=lambda rid, cause, msg: hop(self.on_failed, rid, cause, msg),
            on_release=lambda rid: hop(self._on_release, rid),
        )

    async def drain(self) -> None:
        await self._background.drain()

    def close(self) -> None:
        """After the engine thread stopped: stop the transfer lanes."""
        self.transfers.stop()

    def expected_ms(self, job: HandoffJob) -> int:
        """Time until ``job`` commits, at the measured rates: every prompt token admitted
        here (``job``'s included) still to compute, and every KV byte queued plus its own
        still to write (an over-estimate: kv_broker's deadline keeps ahead of it)."""
        queued = sum(j.handoff.prompt_len for j in self.jobs.values())
        pool = self.transfers.pool
        own_pages = pages_for(job.handoff.prompt_len, self.page_size) - job.handoff.cached_pages
        own = own_pages * pool.page_bytes * pool.num_layers
        pending, rate = self.transfers.pending_bytes, self.transfers.write_rate.rate
        backlog = Backlog(queued, self.token_rate.rate, pending + own, rate)
        return int(backlog.seconds() * 1000)

    async def transfer_room(self, job: HandoffJob) -> None:
        """Hold a new prompt while the transfer lanes are more than
        ``max_transfer_backlog_s`` behind: prefill computes no more KV than they drain."""
        limit = self.limits.max_transfer_backlog_s
        while not job.handoff.stopped and self.transfers.backlog_s() > limit:
            self._drained.clear()
            await wait_set(self._drained, 0.1)

    async def stop(self, job: HandoffJob, stop: Stop | None) -> None:
        """Carry out ``stop``: tell kv_broker, abort the prompt in the engine, give decode's
        pages back, and fail the call if it still waits for its writes."""
        if stop is None:
            return
        rid = job.request_id
        if stop.notice is Notice.FAIL:
            fail = kb.FailRequest(request_id=rid, reason=stop.reason, cause=stop.cause)
            await self.broker_call("Fail", fail)
        elif stop.notice is Notice.ABORT:
            await self.broker_call("Abort", kb.HandoffRequest(request_id=rid))
        if stop.in_engine:
            await self.worker.call(lambda e: abort_on_engine(e, job))
        if stop.free is Free.LANES:
            self.transfers.abort(rid, job.trace_context)  # -> _on_release -> Release
        elif stop.free is Free.RELEASE:
            await self.release(rid)
        job.fail(stop.error)

    def spawn_stop(self, job: HandoffJob, stop: Stop | None) -> None:
        """:meth:`stop` in the background (from a callback, or a call being cancelled)."""
        if stop is not None:
            self._background.spawn(self.stop(job, stop))

    def on_broker_event(self, event: kb.BrokerEvent) -> None:
        """Event loop: decode aborted, the handoff timed out or failed elsewhere."""
        job = self.jobs.get(event.request_id)
        if job is not None:
            stop = job.handoff.broker_ended(event.state, event.cause, event.message)
            self.spawn_stop(job, stop)

    def on_broker_lost(self, why: str) -> None:
        """Event loop: the kv_broker stream dropped; no handoff being written can commit."""
        for job in list(self.jobs.values()):
            self.spawn_stop(job, job.handoff.broker_lost(why))

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

    def _report(self, job: HandoffJob, now: float) -> None:
        job.reported_at = now
        self._background.spawn(
            self._progress(job, job.tokens_written, job.bytes_written, self.expected_ms(job))
        )

    async def _progress(self, job: HandoffJob, tokens: int, nbytes: int, expected_ms: int) -> None:
        req = kb.ProgressRequest(
            request_id=job.request_id,
            tokens_written=tokens,
            bytes_written=nbytes,
            expected_ms=expected_ms,
        )
        status = await self.broker_call("Progress", req)
        if status is not None:  # the handoff may have ended: then stop writing
            self.spawn_stop(
                job, job.handoff.broker_ended(status.state, status.cause, status.message)
            )

    def _on_final(self, rid: str, first_token: int, nbytes: int, write_s: float) -> None:
        self._drained.set()
        job = self.jobs.get(rid)
        if job is not None and job.handoff.written():
            job.write_s = write_s
            job.done.set_result((first_token, nbytes))

    def on_failed(self, rid: str, cause: int, message: str) -> None:
        """Event loop: the request's prefill or one of its writes failed."""
        job = self.jobs.get(rid)
        if job is not None:
            self.spawn_stop(job, job.handoff.fail(cause, message))

    def _on_release(self, rid: str) -> None:
        self._background.spawn(self.release(rid))

    async def release(self, rid: str) -> None:
        """Give decode's pages for ``rid`` back (kv_broker's Release)."""
        await self.broker_call("Release", kb.HandoffRequest(request_id=rid))

    async def broker_call(self, method: str, request):
        """kv_broker's ``method``; None when the call failed (logged, not raised)."""
        try:
            return await getattr(self.broker, method)(
                request, timeout=self.limits.broker_rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            log.info("kv_broker %s(%s) failed: %s", method, request.request_id, exc.details())
            return None


def abort_on_engine(engine: LLMEngine, job: HandoffJob) -> bool:
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
