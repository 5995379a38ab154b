"""Shared gRPC server plumbing: grpc.aio on uvloop, health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dsmesh.telemetry import client_interceptors, server_interceptors

log = logging.getLogger(__name__)

# Keepalive so that a peer that vanished (SIGKILL, cable) is noticed within seconds.
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 4000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 4000),
]


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


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
) -> RunningServer:
    """Start a server with ``register``'s servicers plus health and reflection.

    ``service_names`` are full names (``dsmesh.v1.Decode``) reported by health and reflection;
    port 0 picks a free port, returned in :attr:`RunningServer.port`. With tracing on
    (:func:`dsmesh.telemetry.setup_tracing` called before), every RPC gets a server span that
    continues the caller's trace.
    """
    server = grpc.aio.server(options=KEEPALIVE_OPTIONS, interceptors=server_interceptors())
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
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


def channel(address: str) -> grpc.aio.Channel:
    """Client channel with the same keepalive settings as the servers. With tracing on
    (set up before the channel is made), every call gets a client span, child of the caller's
    current span, whose context travels in the metadata."""
    return grpc.aio.insecure_channel(
        address, options=KEEPALIVE_OPTIONS, interceptors=client_interceptors()
    )
