"""FIFO threads that write finished prefill chunks into decode's pages, one per decode peer.

FIFO matters: a page half-filled by chunk k is re-sent with chunk k+1, so the later write
must land last; all of a request's jobs go to its peer's lane, in order. One lane per peer
keeps a dead or stalled decode instance (a transfer can block for up to the transfer
engine's timeout) from holding up the requests of every other decode instance.

A request's jobs end with either a *final* job (all its KV was written) or
a *release* job (it was aborted: nothing of it is in flight any more), after which its
local pages may be reused and the broker is told.

Ordering with the GPU: a chunk job carries an event recorded after the forward that wrote its
pages (``ready``); the lane waits on it before the write, since the transfer engine copies on
its own stream and would otherwise read pages the forward is still writing.

Backpressure: the queue counts the bytes queued and not yet written (:attr:`pending_bytes`)
and measures the write rate, so prefill can hold new prompts while the lanes are behind
(:meth:`backlog_s`).

Each job carries its request's trace context: the job runs (and calls back) inside it, and a
chunk's write is recorded as a ``kv.transfer`` span.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from opentelemetry.context import Context

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.prefill_svc.estimate import RateMeter
from dsmesh.runtime import telemetry
from dsmesh.runtime.transfer import (
    KVTransport,
    LayoutMismatch,
    RemotePool,
    TransferError,
    page_runs,
)
from dsmesh.v1 import kv_broker_pb2 as kb

if TYPE_CHECKING:
    from dsmesh.instance.metrics import InstanceMetrics

log = logging.getLogger(__name__)
_DEAD_CAP = 100_000


class Fence(Protocol):
    """Passes once the forward that wrote a chunk's pages has finished (torch.cuda.Event)."""

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class ChunkJob:
    request_id: str
    local_pages: list[int]
    remote_pages: list[int]
    remote: RemotePool
    tokens_done: int
    trace_context: Context | None = None
    ready: Fence | None = None  # None: the pages are already written (host pools)


@dataclass(frozen=True)
class FinalJob:
    request_id: str
    first_token: int
    trace_context: Context | None = None


@dataclass(frozen=True)
class ReleaseJob:
    request_id: str
    trace_context: Context | None = None


Job = ChunkJob | FinalJob | ReleaseJob


@dataclass
class TransferCallbacks:
    """Called on the transfer thread; implementations hop to the event loop themselves."""

    on_chunk: Callable[[str, int, int], None]  # request_id, tokens_done, bytes so far
    # request_id, first_token, total bytes, seconds spent writing them
    on_final: Callable[[str, int, int, float], None]
    on_error: Callable[[str, int, str], None]  # request_id, kb.HandoffCause, message
    on_release: Callable[[str], None]  # request_id


def num_runs(local_pages: list[int], remote_pages: list[int]) -> int:
    """Runs of pages consecutive on both sides; the transport sends one segment per run per
    layer (see :func:`dsmesh.runtime.transfer.page_segments`)."""
    return sum(
        1
        for i in range(len(local_pages))
        if i == 0
        or local_pages[i] != local_pages[i - 1] + 1
        or remote_pages[i] != remote_pages[i - 1] + 1
    )


class TransferQueue:
    def __init__(
        self,
        transport: KVTransport,
        pool: MLAKVPool,
        callbacks: TransferCallbacks,
        metrics: InstanceMetrics | None = None,
    ) -> None:
        self.transport = transport
        self.pool = pool
        self.callbacks = callbacks
        # aborted or failed: skip their jobs, also one the engine thread queues after the
        # release (a race the lock cannot close); oldest entries are forgotten past the cap
        self._dead: OrderedDict[str, None] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._write_s: dict[str, float] = {}
        self._lock = threading.Lock()
        self._lanes: dict[str, tuple[queue.SimpleQueue[Job | None], threading.Thread]] = {}
        self._lane_of: dict[str, str] = {}  # request id -> its peer's lane
        self._stopped = False
        self.total_bytes = 0
        self.pending_bytes = 0  # queued or in flight, not yet written
        self.write_rate = RateMeter()  # bytes per second of the writes
        self.metrics = metrics

    def start(self) -> None:
        """Lanes start on demand, one per decode peer."""

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            lanes = list(self._lanes.values())
        for jobs, _ in lanes:
            jobs.put(None)
        for _, thread in lanes:
            thread.join(5)

    def _lane(self, key: str) -> queue.SimpleQueue[Job | None]:
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._main, args=(jobs,), name=f"kv-transfer-{key}", daemon=True
                )
                lane = self._lanes[key] = (jobs, thread)
                thread.start()
            return lane[0]

    def job_bytes(self, job: ChunkJob) -> int:
        return len(job.local_pages) * self.pool.page_bytes * self.pool.num_layers

    def backlog_s(self) -> float:
        """Seconds of writes queued at the measured rate (0 while nothing was timed yet)."""
        rate = self.write_rate.rate
        return self.pending_bytes / rate if rate > 0 else 0.0

    def put(self, job: Job) -> None:
        rid = job.request_id
        with self._lock:
            if isinstance(job, ChunkJob):
                key = self._lane_of.setdefault(rid, job.remote.session)
                self.pending_bytes += self.job_bytes(job)
            else:  # after its chunks, on the same lane; kept until it ran (see _run)
                key = self._lane_of.get(rid, "")
        self._lane(key).put(job)

    def begin(self, request_id: str) -> None:
        """A new request with this id starts (ids may be reused once their handoff ended)."""
        with self._lock:
            self._dead.pop(request_id, None)
            self._lane_of.pop(request_id, None)  # a dead chunk queued after the last release

    def abort(self, request_id: str, trace_context: Context | None = None) -> None:
        """Drop the request's queued writes; a release job follows the one in flight."""
        with self._lock:
            self._dead[request_id] = None
            while len(self._dead) > _DEAD_CAP:
                self._dead.popitem(last=False)
        self.put(ReleaseJob(request_id, trace_context))

    def _main(self, jobs: queue.SimpleQueue[Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            with telemetry.attached(job.trace_context):
                self._run(job)

    def _run(self, job: Job) -> None:
        rid = job.request_id
        with self._lock:
            dead = rid in self._dead
            if dead and isinstance(job, ChunkJob):
                self.pending_bytes -= self.job_bytes(job)
            elif not isinstance(job, ChunkJob):
                # Every write of the request has ended: a release queued after this one (an
                # abort after the final job) may run on any lane. Popped when queued, a
                # release that followed the final job would run at once on another lane,
                # while a write to a dark peer was still in flight.
                self._lane_of.pop(rid, None)
        if isinstance(job, ReleaseJob):
            with self._lock:
                self._bytes.pop(rid, None)
                self._write_s.pop(rid, None)
            self.callbacks.on_release(rid)
        elif dead:
            return
        elif isinstance(job, ChunkJob):
            self._write(job)
        else:
            with self._lock:
                nbytes = self._bytes.pop(rid, 0)
                write_s = self._write_s.pop(rid, 0.0)
            self.callbacks.on_final(rid, job.first_token, nbytes, write_s)

    def _write(self, job: ChunkJob) -> None:
        rid = job.request_id
        if job.ready is not None:
            job.ready.synchronize()  # the forward that wrote these pages has finished
        start_ns = time.time_ns()
        try:
            n = self.transport.write_pages(self.pool, job.remote, job.local_pages, job.remote_pages)
        except (TransferError, ValueError) as exc:
            self._trace_write(job, start_ns, 0, error=str(exc))
            with self._lock:
                self._dead[rid] = None
                self.pending_bytes -= self.job_bytes(job)
            log.warning("KV transfer for %s failed: %s", rid, exc)
            mismatch = isinstance(exc, LayoutMismatch)
            cause = kb.CAUSE_LAYOUT_MISMATCH if mismatch else kb.CAUSE_TRANSFER_FAILED
            self.callbacks.on_error(rid, cause, f"KV transfer failed: {exc}")
            return
        seconds = (time.time_ns() - start_ns) / 1e9
        self._trace_write(job, start_ns, n)
        if self.metrics is not None:
            self.metrics.transfer_bytes.inc(n)
            self.metrics.transfer_seconds.observe(seconds)
            self.metrics.transfer_pages.inc(len(job.local_pages))
            self.metrics.transfer_page_runs.inc(len(page_runs(job.local_pages, job.remote_pages)))
        with self._lock:
            self.total_bytes += n
            self.pending_bytes -= self.job_bytes(job)
            self.write_rate.observe(n, seconds)
            self._bytes[rid] = sent = self._bytes.get(rid, 0) + n
            self._write_s[rid] = self._write_s.get(rid, 0.0) + seconds
        self.callbacks.on_chunk(rid, job.tokens_done, sent)

    def _trace_write(
        self, job: ChunkJob, start_ns: int, nbytes: int, error: str | None = None
    ) -> None:
        if not telemetry.enabled():
            return
        attributes = {
            "dsmesh.request_id": job.request_id,
            "dsmesh.kv.bytes": nbytes,
            "dsmesh.kv.pages": len(job.local_pages),
            "dsmesh.kv.segments": num_runs(job.local_pages, job.remote_pages)
            * job.remote.num_layers,
            "dsmesh.kv.tokens_done": job.tokens_done,
        }
        telemetry.record_span(
            "kv.transfer", job.trace_context, start_ns, time.time_ns(), attributes, error
        )
