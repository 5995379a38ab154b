"""One FIFO thread that writes finished prefill chunks into decode's pages.

FIFO matters: a page half-filled by chunk k is re-sent with chunk k+1, so the later write
must land last. A request's jobs end with either a *final* job (all its KV was written) or
a *release* job (it was aborted: nothing of it is in flight any more), after which its
local pages may be reused and the broker is told.

Each job carries its request's trace context: the job runs (and calls back) inside it, and a
chunk's write is recorded as a ``kv.transfer`` span.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.context import Context

from dsmesh import telemetry
from dsmesh.transfer import KVTransport, RemotePool, TransferError
from engine.kv_cache import MLAKVPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkJob:
    request_id: str
    local_pages: list[int]
    remote_pages: list[int]
    remote: RemotePool
    tokens_done: int
    trace_context: Context | None = None


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
    on_final: Callable[[str, int, int], None]  # request_id, first_token, total bytes
    on_error: Callable[[str, str], None]  # request_id, message
    on_release: Callable[[str], None]  # request_id


def num_runs(local_pages: list[int], remote_pages: list[int]) -> int:
    """Runs of pages consecutive on both sides; the transport sends one segment per run per
    layer (see :func:`dsmesh.transfer.page_segments`)."""
    return sum(
        1
        for i in range(len(local_pages))
        if i == 0
        or local_pages[i] != local_pages[i - 1] + 1
        or remote_pages[i] != remote_pages[i - 1] + 1
    )


class TransferQueue:
    def __init__(
        self, transport: KVTransport, pool: MLAKVPool, callbacks: TransferCallbacks
    ) -> None:
        self.transport = transport
        self.pool = pool
        self.callbacks = callbacks
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._dead: set[str] = set()  # aborted or failed: skip their remaining chunk jobs
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="kv-transfer", daemon=True)
        self.total_bytes = 0
        self.metrics = None  # dsmesh.service_metrics.InstanceMetrics, when served

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    def abort(self, request_id: str, trace_context: Context | None = None) -> None:
        """Drop the request's queued writes; a release job follows the one in flight."""
        with self._lock:
            self._dead.add(request_id)
        self._jobs.put(ReleaseJob(request_id, trace_context))

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with telemetry.attached(job.trace_context):
                self._run(job)

    def _run(self, job: Job) -> None:
        rid = job.request_id
        with self._lock:
            dead = rid in self._dead
        if isinstance(job, ReleaseJob):
            with self._lock:
                self._dead.discard(rid)
            self._bytes.pop(rid, None)
            self.callbacks.on_release(rid)
        elif dead:
            return
        elif isinstance(job, ChunkJob):
            self._write(job)
        else:
            self.callbacks.on_final(rid, job.first_token, self._bytes.pop(rid, 0))

    def _write(self, job: ChunkJob) -> None:
        rid = job.request_id
        start_ns = time.time_ns()
        try:
            n = self.transport.write_pages(self.pool, job.remote, job.local_pages, job.remote_pages)
        except (TransferError, ValueError) as exc:
            self._trace_write(job, start_ns, 0, error=str(exc))
            with self._lock:
                self._dead.add(rid)
            log.warning("KV transfer for %s failed: %s", rid, exc)
            self.callbacks.on_error(rid, f"KV transfer failed: {exc}")
            return
        self._trace_write(job, start_ns, n)
        if self.metrics is not None:
            self.metrics.transfer_bytes.inc(n)
            self.metrics.transfer_seconds.observe((time.time_ns() - start_ns) / 1e9)
        self.total_bytes += n
        self._bytes[rid] = self._bytes.get(rid, 0) + n
        self.callbacks.on_chunk(rid, job.tokens_done, self._bytes[rid])

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
