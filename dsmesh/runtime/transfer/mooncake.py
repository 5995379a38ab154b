"""KV transport over the Mooncake Transfer Engine: TCP on a laptop/CI, CUDA IPC between the
GPUs of one host (``nvlink_intra``), GPUDirect RDMA across hosts (``rdma``).

The engine runs in P2P-handshake mode: no metadata server; a peer is addressed by the
"host:port" of its engine's RPC listener, which is our :attr:`session_id`.

Engine facts this module relies on (mooncake-transfer-engine 0.3.13):
- The transfer calls release the GIL, and the engine is safe to drive from several threads
  (its segment cache is mutex-guarded; each call gets its own batch id).
- Each call returns 0 on success and -1 on any failure; a sync batch returns at the FIRST
  failed segment while the others may still be in flight.
- The TCP transport queues at most 1024 segments per peer (plus 1024 waiting up to 1 s for
  admission; ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` and friends raise that) and fails
  whatever overflows, so we send at most ``max_segments_per_batch`` segments per call and
  keep at most ``max_batches_per_peer`` calls in flight per peer.
- A blocked peer is given up on after the engine's own timeouts: about 60 s for a
  handshake that gets no answer, ``MC_TRANSFER_TIMEOUT`` (default 30 s, + 1 s per GiB) for
  a transfer, and, on TCP, ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (default 30 s) for a
  connection that makes no progress, which it then closes. The kernel would still deliver
  what the closed socket held once the peer's link came back, into pages the peer may have
  reused: :class:`~dsmesh.runtime.transfer.stall.StallGuard` has the kernel abort a stalled
  connection instead, ``stall_timeout_s`` after its bytes were sent (the write fails then),
  and the progress timeout defaults to twice that, as a backstop.
- ``nvlink_intra`` (0.3.14, CUDA builds) is installed by ``MC_INTRANODE_NVLINK`` at
  initialize. Registering a GPU buffer calls the CUDA driver (``cuMemGetAddressRange``,
  ``cudaIpcGetMemHandle`` on the buffer's whole ``cudaMalloc`` segment), so the calling
  thread needs the device's context current: we bind it on every thread that registers or
  writes. Peers open that IPC handle at their first write. A write copies on the engine's
  own stream after syncing the calling thread's per-thread stream only, so it does NOT wait
  for our forward: callers order writes after the forward themselves (a CUDA event).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING, Any

from dsmesh.runtime.transfer.base import KVTransport, RemotePool, TransferError, pool_segments
from dsmesh.runtime.transfer.protocol import intranode_env
from dsmesh.runtime.transfer.stall import StallGuard

if TYPE_CHECKING:
    from dsmesh.engine.kv.pool import MLAKVPool

P2P_HANDSHAKE = "P2PHANDSHAKE"
_bound = threading.local()  # the CUDA device this thread has made current for the engine


def bind_cuda_device(device: Any) -> None:
    """Make ``device``'s primary context current on the calling thread (once per thread):
    the engine's driver calls fail with CUDA_ERROR_INVALID_CONTEXT (201) without one, and
    ``torch.cuda.set_device`` alone skips the runtime call when the index already matches."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if getattr(_bound, "index", None) == index:
        return
    torch.cuda.set_device(index)
    torch.cuda.synchronize(index)  # any runtime call binds the primary context
    _bound.index = index


def _import_transfer_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        hint = (
            "the Mooncake Transfer Engine is needed for KV transfer: "
            "`pip install mooncake-transfer-engine-non-cuda` (CPU, TCP) or "
            "`pip install mooncake-transfer-engine` (CUDA/RDMA)"
        )
        if "libibverbs" in str(e) or "libnuma" in str(e):
            hint += "; its RDMA libraries are missing: `apt-get install libibverbs1 libnuma1`"
        raise ImportError(f"{hint} ({e})") from e
    return TransferEngine


def check_build(protocol: str) -> None:
    """Refuse a Mooncake build that cannot move GPU memory for ``protocol`` (ImportError
    naming the extra to install), before the engine fails in some less clear way."""
    import torch

    from dsmesh.runtime.transfer.protocol import cuda_build_problem, installed_mooncake_builds

    problem = cuda_build_problem(installed_mooncake_builds(), torch.version.cuda, protocol)
    if problem is not None:
        raise ImportError(problem)


class MooncakeTransport(KVTransport):
    """:class:`KVTransport` on one Mooncake ``TransferEngine``.

    ``hostname`` is the address peers reach this process at (also the local bind address);
    ``protocol`` is "tcp", "nvlink_intra" or "rdma" (resolved already:
    :func:`dsmesh.runtime.transfer.protocol.resolve_protocol`); ``device_name`` lists RDMA devices
    ("mlx5_0,mlx5_1"), empty otherwise. Thread-safe: any number of threads may call
    :meth:`write_pages` at once. A registered pool is referenced by the transport until
    :meth:`close`. ``stall_timeout_s``: a TCP write whose bytes stay unacknowledged that long
    fails, and none of its bytes land later (see the module's notes).
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        *,
        max_segments_per_batch: int = 512,
        max_batches_per_peer: int = 2,
        stall_timeout_s: float = 5.0,
    ) -> None:
        if max_segments_per_batch <= 0 or max_batches_per_peer <= 0:
            raise ValueError(
                "max_segments_per_batch and max_batches_per_peer must be > 0, got "
                f"{max_segments_per_batch} and {max_batches_per_peer}"
            )
        engine_cls = _import_transfer_engine()
        if protocol == "nvlink_intra":
            os.environ.update(intranode_env())  # read by initialize, once per process
        # read by the TCP transport per connection; the environment's value wins
        os.environ.setdefault(
            "MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, round(2 * stall_timeout_s)))
        )
        # TCP only: RDMA and CUDA IPC writes do not go through the kernel's sockets
        self._stall = StallGuard(stall_timeout_s) if protocol == "tcp" else None
        engine = engine_cls()
        rc = engine.initialize(hostname, P2P_HANDSHAKE, protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake TransferEngine.initialize({hostname!r}, {P2P_HANDSHAKE!r}, "
                f"{protocol!r}, {device_name!r}) failed (rc={rc})"
            )
        self._engine: Any = engine
        self._session_id = f"{hostname}:{engine.get_rpc_port()}"
        self._protocol = protocol
        self._max_segments_per_batch = max_segments_per_batch
        self._max_batches_per_peer = max_batches_per_peer
        # Guards the dicts below and the open/closed state; never held during a transfer.
        self._lock = threading.Lock()
        # base ptr -> (pool, desc). Holding the pool keeps its registered memory alive: were
        # it freed, the engine would still accept writes into whatever reuses the addresses.
        self._pools: dict[int, tuple[MLAKVPool, RemotePool]] = {}
        self._peer_slots: dict[str, threading.BoundedSemaphore] = {}

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def signature(self) -> str:
        return f"mooncake/{self._protocol}"

    @property
    def engine(self) -> Any:
        """The underlying ``mooncake.engine.TransferEngine`` (benchmarks, diagnostics)."""
        return self._open_engine()

    def register_pool(self, pool: MLAKVPool) -> RemotePool:
        buffer = pool.buffer
        if not buffer.is_contiguous():
            raise ValueError("the pool buffer must be contiguous")
        ptr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        if buffer.is_cuda:
            bind_cuda_device(buffer.device)
        with self._lock:
            engine = self._open_engine()
            if ptr in self._pools:
                registered, desc = self._pools[ptr]
                if registered is not pool:
                    raise ValueError(f"another pool is already registered at {ptr:#x}")
                return desc
            rc = engine.register_memory(ptr, nbytes)
            if rc != 0:
                raise TransferError(
                    f"Mooncake register_memory({ptr:#x}, {nbytes}) failed (rc={rc})"
                )
            desc = RemotePool(
                session=self._session_id,
                base_ptr=ptr,
                num_pages=pool.num_pages,
                page_bytes=pool.page_bytes,
                num_layers=pool.num_layers,
            )
            self._pools[ptr] = (pool, desc)
            return desc

    def write_pages(
        self,
        pool: MLAKVPool,
        remote: RemotePool,
        local_pages: list[int],
        remote_pages: list[int],
    ) -> int:
        segments = pool_segments(pool, remote, local_pages, remote_pages)
        if pool.buffer.is_cuda:
            bind_cuda_device(pool.buffer.device)
        with self._lock:
            engine = self._open_engine()
            registered = self._pools.get(pool.buffer.data_ptr())
            if registered is None or registered[0] is not pool:
                raise ValueError("register_pool(pool) before writing its pages")
            slots = self._peer_slots.get(remote.session)
            if slots is None:
                slots = threading.BoundedSemaphore(self._max_batches_per_peer)
                self._peer_slots[remote.session] = slots

        written = 0
        step = self._max_segments_per_batch
        peer_host = remote.session.rsplit(":", 1)[0]
        for start in range(0, len(segments), step):
            chunk = segments[start : start + step]
            local_ptrs = [s[0] for s in chunk]
            remote_ptrs = [s[1] for s in chunk]
            lengths = [s[2] for s in chunk]
            stall = self._stall.writing(peer_host) if self._stall else contextlib.nullcontext()
            with slots, stall:  # a stalled call that fails quiesces before it raises
                rc = engine.batch_transfer_sync_write(
                    remote.session, local_ptrs, remote_ptrs, lengths
                )
                if rc != 0:
                    raise TransferError(
                        f"Mooncake batch_transfer_sync_write to {remote.session} failed "
                        f"(rc={rc}) on segments [{start}, {start + len(chunk)}) of "
                        f"{len(segments)}; {written} bytes written before it"
                    )
            written += sum(lengths)
        return written

    def close(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            pools, self._pools = self._pools, {}
            for ptr in pools:
                engine.unregister_memory(ptr)
        if self._stall is not None:
            self._stall.close()
        # A write in flight holds its own reference; the engine goes when the last one does.
        del engine

    def _open_engine(self) -> Any:
        if self._engine is None:
            raise TransferError(f"transport {self._session_id} is closed")
        return self._engine
