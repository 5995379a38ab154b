"""The KV transport interface: write a request's KV pages into another process's pool.

A process's KV cache is one contiguous tensor ``[num_layers, num_pages, page_size, kv_dim]``
(``dsmesh.engine.kv.pool.MLAKVPool.buffer``), so page ``p`` of layer ``l`` lives at
``base + (l * num_pages + p) * page_bytes``. Two pools that hold the same model agree on
``num_layers`` and ``page_bytes`` but usually not on ``num_pages``, which is the layer stride.
Moving a request's KV is therefore a list of ``(local_ptr, remote_ptr, nbytes)`` segments:
one per layer per run of pages that are consecutive on both sides (:func:`page_segments`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsmesh.engine.kv.pool import MLAKVPool


@dataclass(frozen=True)
class RemotePool:
    """Where a registered pool lives, as its peers see it (proto ``dsmesh.v1.RemotePool``).

    ``session`` is the owning transport's :attr:`KVTransport.session_id` ("host:port");
    ``base_ptr`` the address of ``buffer[0, 0, 0, 0]`` in the owner's address space;
    ``num_pages`` the pages per layer (the layer stride); ``page_bytes`` the bytes of one page
    of one layer; ``num_layers`` the layers of the pool.
    """

    session: str
    base_ptr: int
    num_pages: int
    page_bytes: int
    num_layers: int


class TransferError(RuntimeError):
    """The transfer engine failed to move KV bytes (peer gone, address rejected, timeout)."""


class LayoutMismatch(ValueError):
    """The local and the remote pool differ in page bytes or layers: nothing was sent."""


def _check_page_ids(name: str, page_ids: list[int], num_pages: int) -> None:
    for i, p in enumerate(page_ids):
        if not 0 <= p < num_pages:
            raise ValueError(f"{name}[{i}] = {p} is out of range [0, {num_pages})")


def page_segments(
    local_base: int,
    local_num_pages: int,
    remote: RemotePool,
    local_pages: list[int],
    remote_pages: list[int],
    layers: range | None = None,
) -> list[tuple[int, int, int]]:
    """Byte segments ``(local_ptr, remote_ptr, nbytes)`` that copy ``local_pages[i]`` of the
    local pool onto ``remote_pages[i]`` of ``remote``, for every layer in ``layers``
    (default: all ``remote.num_layers``).

    Both pools must share ``remote.page_bytes`` and the layer count. Pages are coalesced into
    one segment per layer wherever the local AND the remote page ids both run consecutively;
    segments are ordered layer-major, then in page order. Pure: touches no memory.
    Raises ValueError naming the offending argument.
    """
    if len(local_pages) != len(remote_pages):
        raise ValueError(
            f"local_pages has {len(local_pages)} ids but remote_pages has {len(remote_pages)}"
        )
    if local_num_pages <= 0 or remote.num_pages <= 0:
        raise ValueError(
            f"num_pages must be > 0 (local {local_num_pages}, remote {remote.num_pages})"
        )
    if remote.page_bytes <= 0:
        raise ValueError(f"remote.page_bytes must be > 0, got {remote.page_bytes}")
    _check_page_ids("local_pages", local_pages, local_num_pages)
    _check_page_ids("remote_pages", remote_pages, remote.num_pages)
    if layers is None:
        layers = range(remote.num_layers)
    elif len(layers) and (min(layers) < 0 or max(layers) >= remote.num_layers):
        raise ValueError(f"layers {layers} exceed the pool's {remote.num_layers} layers")

    runs = page_runs(local_pages, remote_pages)
    page_bytes = remote.page_bytes
    segments: list[tuple[int, int, int]] = []
    for layer in layers:
        local_layer = local_base + layer * local_num_pages * page_bytes
        remote_layer = remote.base_ptr + layer * remote.num_pages * page_bytes
        for l0, r0, n in runs:
            segments.append(
                (local_layer + l0 * page_bytes, remote_layer + r0 * page_bytes, n * page_bytes)
            )
    return segments


def page_runs(local_pages: list[int], remote_pages: list[int]) -> list[tuple[int, int, int]]:
    """Runs ``(local_start, remote_start, num_pages)`` of the pairs ``(local_pages[i],
    remote_pages[i])`` that are consecutive on both sides, in order: each run is one copy
    per layer. Pure."""
    runs: list[tuple[int, int, int]] = []
    for lp, rp in zip(local_pages, remote_pages, strict=True):
        if runs:
            l0, r0, n = runs[-1]
            if lp == l0 + n and rp == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lp, rp, 1))
    return runs


def pool_segments(
    pool: MLAKVPool, remote: RemotePool, local_pages: list[int], remote_pages: list[int]
) -> list[tuple[int, int, int]]:
    """:func:`page_segments` for every layer of ``pool``, after checking that ``pool`` and
    ``remote`` share a layout (same ``page_bytes`` and ``num_layers``; LayoutMismatch, a
    ValueError, if not)."""
    if pool.page_bytes != remote.page_bytes or pool.num_layers != remote.num_layers:
        raise LayoutMismatch(
            f"KV layout mismatch: local pool has {pool.num_layers} layers of "
            f"{pool.page_bytes}-byte pages, remote pool {remote.num_layers} layers of "
            f"{remote.page_bytes}-byte pages"
        )
    if not pool.buffer.is_contiguous():
        raise ValueError("the pool buffer must be contiguous")
    return page_segments(pool.buffer.data_ptr(), pool.num_pages, remote, local_pages, remote_pages)


class KVTransport(ABC):
    """Moves KV pages one way: from a pool of this process into a registered pool of a peer.

    One transport per process, picked once at start-up
    (:func:`dsmesh.runtime.transfer.make_transport`).
    The process's pool is registered once (:meth:`register_pool`) and stays registered until
    :meth:`close`; the transport holds a reference to the pool until then, so the registered
    memory cannot be freed and reused under the engine. Peers learn each other's
    :class:`RemotePool` through kv_broker (gRPC); only the transfer engine moves KV bytes.

    Threading: :meth:`write_pages` blocks for the whole transfer and may be called from
    several threads at once (implementations guarantee it, adding a lock where their engine
    is not thread-safe). Async callers run it off the event loop:
    ``await asyncio.to_thread(transport.write_pages, ...)``.
    """

    @property
    @abstractmethod
    def session_id(self) -> str:
        """The "host:port" that peers use to reach this transport."""

    @property
    @abstractmethod
    def signature(self) -> str:
        """Engine and protocol, e.g. "mooncake/nvlink_intra": two transports move bytes
        between each other only when their signatures are equal (part of the KV layout
        signature that kv_broker compares at the handshake)."""

    @abstractmethod
    def register_pool(self, pool: MLAKVPool) -> RemotePool:
        """Register ``pool.buffer`` (the whole tensor) with the engine so peers can write into
        it, and return its description for them. Idempotent for the same pool.
        Raises TransferError if the engine refuses."""

    @abstractmethod
    def write_pages(
        self,
        pool: MLAKVPool,
        remote: RemotePool,
        local_pages: list[int],
        remote_pages: list[int],
    ) -> int:
        """Write, for every layer, ``local_pages[i]`` of ``pool`` into ``remote_pages[i]`` of
        ``remote``; blocks until done and returns the bytes written
        (``len(local_pages) * page_bytes * num_layers``).

        ``pool`` must be registered with this transport. Raises ValueError for a page id out
        of range, LayoutMismatch (a ValueError) for pools that differ (nothing is sent in
        either case), TransferError when the engine fails, with its return code in the
        message. After a TransferError the target pages hold undefined bytes, and segments
        of the failed call may still be landing for a short while (Mooncake returns at the
        first failed segment): their owner should not hand those pages to another request
        straight away.
        """

    @abstractmethod
    def close(self) -> None:
        """Unregister every pool and release the engine. Idempotent; afterwards the other
        methods raise TransferError."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
