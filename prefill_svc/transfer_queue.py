"""One FIFO thread that writes finished prefill chunks into decode's pages.

FIFO matters: a page half-filled by chunk k is re-sent with chunk k+1, so the later write
must land last. A request's jobs end with either a *final* job (all its KV was written) or
a *release* job (it was aborted: nothing of it is in flight any more), after which its
local pages may be reused and the broker is told.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class FinalJob:
    request_id: str
    first_token: int


@dataclass(frozen=True)
class ReleaseJob:
    request_id: str


Job = ChunkJob | FinalJob | ReleaseJob


@dataclass
class TransferCallbacks:
    """Called on the transfer thread; implementations hop to the event loop themselves."""

    on_chunk: Callable[[str, int, int], None]  # request_id, tokens_done, bytes so far
    on_final: Callable[[str, int, int], None]  # request_id, first_token, total bytes
    on_error: Callable[[str, str], None]  # request_id, message
    on_release: Callable[[str], None]  # request_id


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

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    def abort(self, request_id: str) -> None:
        """Drop the request's queued writes; a release job follows the one in flight."""
        with self._lock:
            self._dead.add(request_id)
        self._jobs.put(ReleaseJob(request_id))

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            rid = job.request_id
            with self._lock:
                dead = rid in self._dead
            if isinstance(job, ReleaseJob):
                with self._lock:
                    self._dead.discard(rid)
                self._bytes.pop(rid, None)
                self.callbacks.on_release(rid)
            elif dead:
                continue
            elif isinstance(job, ChunkJob):
                try:
                    n = self.transport.write_pages(
                        self.pool, job.remote, job.local_pages, job.remote_pages
                    )
                except (TransferError, ValueError) as exc:
                    with self._lock:
                        self._dead.add(rid)
                    log.warning("KV transfer for %s failed: %s", rid, exc)
                    self.callbacks.on_error(rid, f"KV transfer failed: {exc}")
                    continue
                self.total_bytes += n
                self._bytes[rid] = self._bytes.get(rid, 0) + n
                self.callbacks.on_chunk(rid, job.tokens_done, self._bytes[rid])
            else:
                self.callbacks.on_final(rid, job.first_token, self._bytes.pop(rid, 0))
