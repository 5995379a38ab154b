"""Shared gRPC server plumbing: grpc.aio on uvloop, health, reflection, graceful stop, and
the one place where servers bind and channels dial (TLS, message size limits, keepalive).

Channels are made all over the code base with just an address, so their TLS and message size
come from a process-wide default that each service sets once at start-up, from its config
(:func:`set_channel_defaults`, before it makes any channel); explicit arguments to
:func:`channel` override it. Servers always get theirs explicitly.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dsmesh.runtime.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from dsmesh.runtime.telemetry import client_interceptors, server_interceptors

log = logging.getLogger(__name__)

# Keepalive, so that a peer that vanished without closing its sockets (a dead host, a pulled
# cable) is noticed within seconds, on servers and channels alike. Each side pings after
# KEEPALIVE_TIME_MS and closes the connection when the ack takes over KEEPALIVE_TIMEOUT_MS;
# gRPC also sets that timeout as the socket's TCP_USER_TIMEOUT, so data left unacknowledged
# that long closes it too. Every call on the connection then fails with UNAVAILABLE: within
# 3 s of the link going down when data was in flight, 8 s at most on an idle connection
# (docs/RELIABILITY.md, "A host goes dark"; measured in tests/multihost).
KEEPALIVE_TIME_MS = 5000
KEEPALIVE_TIMEOUT_MS = 3000
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # pings without data sent and accepted at most this often: below KEEPALIVE_TIME_MS, so
    # that a server never answers a peer's keepalive with GOAWAY "too many pings"
    ("grpc.http2.min_ping_interval_without_data_ms", 4000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
]


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Keepalive plus the message size limit, for servers and channels alike."""
    if max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
    return [
        *KEEPALIVE_OPTIONS,
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class ChannelDefaults:
    tls: TLSConfig = TLSConfig()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


_channel_defaults = ChannelDefaults()


def set_channel_defaults(
    tls: TLSConfig, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> None:
    """Set what :func:`channel` uses when not told: called once by each service at start-up,
    before it makes any channel (a channel keeps the settings it was made with)."""
    global _channel_defaults
    grpc_options(max_message_bytes)  # validates
    _channel_defaults = ChannelDefaults(tls, max_message_bytes)


def channel_defaults() -> ChannelDefaults:
    return _channel_defaults


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool, services: Sequence[str] = ("",)) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in services:
            await self.health.set(name, status)


def method_paths(service: ServiceDescriptor, *names: str) -> list[str]:
    """Full gRPC paths (``/dsmesh.v1.Decode/Decode``) of ``service``'s methods ``names``
    (all of them when none is named); a name the service lacks is an error."""
    known = {m.name for m in service.methods}
    if unknown := set(names) - known:
        raise ValueError(f"{service.full_name} has no method {sorted(unknown)}")
    return [f"/{service.full_name}/{name}" for name in names or sorted(known)]


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    tls: TLSConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> RunningServer:
    """Start a server with ``register``'s servicers plus health and reflection.

    ``service_names`` are full names (``dsmesh.v1.Decode``) reported by health and reflection;
    port 0 picks a free port, returned in :attr:`RunningServer.port`. With tracing on
    (:func:`dsmesh.runtime.telemetry.setup_tracing` called before), every RPC gets a server
    span that continues the caller's trace. ``tls`` enabled: the port speaks only TLS (mTLS with
    ``tls.client_auth``). Messages over ``max_message_bytes`` get RESOURCE_EXHAUSTED.
    ``interceptors`` run after the tracing ones.
    """
    server = grpc.aio.server(
        options=grpc_options(max_message_bytes),
        interceptors=[*server_interceptors(), *interceptors],
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    if tls is not None and tls.enabled:
        bound = server.add_secure_port(f"{host}:{port}", tls.server_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    running = RunningServer(server, bound, health_servicer)
    await running.set_serving(True, ("", *service_names))
    return running


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop_event)`` on uvloop; SIGINT/SIGTERM set the event for a graceful stop."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    runner(wrapper())


def channel(
    address: str, tls: TLSConfig | None = None, max_message_bytes: int | None = None
) -> grpc.aio.Channel:
    """Client channel with the same keepalive settings as the servers; ``tls`` and
    ``max_message_bytes`` default to the process-wide :func:`channel_defaults` (pass
    ``TLSConfig()`` for plaintext). With tracing on (set up before the channel is made), every
    call gets a client span, child of the caller's current span, whose context travels in the
    metadata."""
    defaults = _channel_defaults
    tls = defaults.tls if tls is None else tls
    options = grpc_options(max_message_bytes or defaults.max_message_bytes)
    if tls.enabled:
        return grpc.aio.secure_channel(
            address,
            tls.channel_credentials(),
            options=[*options, *tls.channel_options()],
            interceptors=client_interceptors(),
        )
    return grpc.aio.insecure_channel(address, options=options, interceptors=client_interceptors())


def sync_channel(address: str, tls: TLSConfig | None = None) -> grpc.Channel:
    """A blocking channel (probes, scripts) with the same TLS rule as :func:`channel`."""
    tls = _channel_defaults.tls if tls is None else tls
    if tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), tls.channel_options())
    return grpc.insecure_channel(address)
