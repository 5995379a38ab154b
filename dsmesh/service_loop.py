"""The life of a standalone control-plane service (kv_broker, eplb): start its gRPC server
(with health and reflection) and its Prometheus endpoint, serve until told to stop, then go
NOT_SERVING, close the servicer and give in-flight calls their grace period."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry

from dsmesh.grpc_server import set_channel_defaults, start_server
from dsmesh.metrics_http import metrics_endpoint
from dsmesh.security import TLSConfig

log = logging.getLogger(__name__)


class ServiceConfig(Protocol):
    host: str
    port: int
    metrics_port: int
    shutdown_grace_s: float
    tls: TLSConfig
    max_message_bytes: int


class LifecycleServicer(Protocol):
    def start(self) -> None: ...

    async def close(self) -> None: ...


async def serve_until_stopped(
    label: str,
    service_name: str,
    register: Callable[[grpc.aio.Server], None],
    servicer: LifecycleServicer,
    registry: CollectorRegistry,
    config: ServiceConfig,
    stop: asyncio.Event,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve ``service_name`` (``register`` adds ``servicer`` to the server) until ``stop``
    is set; ``ready(port)`` once it accepts calls; ``label`` names it in logs."""
    set_channel_defaults(config.tls, config.max_message_bytes)
    running = await start_server(
        register,
        (service_name,),
        config.host,
        config.port,
        tls=config.tls,
        max_message_bytes=config.max_message_bytes,
    )
    servicer.start()
    try:
        async with metrics_endpoint(registry, config.metrics_port, config.host, label):
            log.info("%s listening on %s:%d", label, config.host, running.port)
            if ready is not None:
                ready(running.port)
            await stop.wait()
    finally:
        log.info("%s stopping", label)
        await running.set_serving(False, ("", service_name))
        await servicer.close()
        await running.server.stop(config.shutdown_grace_s)
