"""KV transfer between processes: an engine-neutral interface and its implementations.

Pick the implementation once at start-up with :func:`make_transport`; everything else
depends only on :class:`KVTransport`.
"""

from __future__ import annotations

from collections.abc import Callable

from dsmesh.runtime.transfer.base import (
    KVTransport,
    LayoutMismatch,
    RemotePool,
    TransferError,
    page_runs,
    page_segments,
    pool_segments,
)
from dsmesh.runtime.transfer.protocol import PROTOCOLS, rdma_devices, resolve_protocol

__all__ = [
    "PROTOCOLS",
    "KVTransport",
    "LayoutMismatch",
    "RemotePool",
    "TransferError",
    "make_transport",
    "page_runs",
    "page_segments",
    "pool_segments",
    "rdma_devices",
    "resolve_protocol",
]


def _mooncake(**kwargs: object) -> KVTransport:
    from dsmesh.runtime.transfer.mooncake import MooncakeTransport, check_build

    check_build(str(kwargs.get("protocol", "tcp")))
    return MooncakeTransport(**kwargs)  # type: ignore[arg-type]


# Implementations import their engine lazily, so listing one here costs nothing.
_TRANSPORTS: dict[str, Callable[..., KVTransport]] = {"mooncake": _mooncake}


def make_transport(kind: str = "mooncake", **kwargs: object) -> KVTransport:
    """Build the KV transport named ``kind`` with its keyword arguments (for "mooncake":
    ``hostname``, ``protocol`` as :func:`resolve_protocol` chose it, ``device_name``; see
    MooncakeTransport). A Mooncake build that cannot serve the protocol (e.g. the non-CUDA
    build for ``nvlink_intra``) is refused with the extra to install."""
    factory = _TRANSPORTS.get(kind)
    if factory is None:
        raise ValueError(f"unknown KV transport {kind!r}; known: {', '.join(_TRANSPORTS)}")
    return factory(**kwargs)
