"""The one life every dsmesh service leads: serve until told to stop, then drain.

:func:`serve_until_stopped` runs a service whose gRPC server is up. When ``stop`` is set
(SIGTERM or SIGINT, through :func:`dsmesh.runtime.grpc_server.run_until_signal`):

1. health goes NOT_SERVING (orchestrators and the gateway stop sending work);
2. the :class:`~dsmesh.runtime.drain.Drain` refuses new work with UNAVAILABLE, while calls
   that concern accepted work keep working;
3. the work in flight gets up to ``drain_timeout_s`` to finish;
4. the server stops, cancelling whatever is left after a short grace.

:func:`serve_control_plane` is that life for kv_broker and EPLB, with their Prometheus
endpoint; the instances (:func:`dsmesh.instance.attach.serve_attached`) and the gateway add
their own parts around the same call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import grpc
from prometheus_client import CollectorRegistry

from dsmesh.runtime.address import advertise_host, host_port
from dsmesh.runtime.drain import Drain
from dsmesh.runtime.grpc_server import RunningServer, set_channel_defaults, start_server
from dsmesh.runtime.metrics_http import metrics_endpoint
from dsmesh.runtime.security import TLSConfig

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
STOP_GRACE_S = 1.0  # after the drain: calls still running get this long, then are cancelled


def check_drain_timeout(value: float) -> None:
    if not value >= 0:
        raise ValueError(f"drain_timeout_s must not be negative, got {value}")


async def serve_until_stopped(
    label: str,
    server: RunningServer,
    services: Sequence[str],
    drain: Drain,
    stop: asyncio.Event,
    drain_timeout_s: float,
    busy: Callable[[], int] = lambda: 0,
    health: Callable[[], Awaitable[None]] | None = None,
    drained: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until ``stop``, then drain and stop ``server`` (see the module docstring).

    ``busy()`` counts accepted work that is not a call in flight (kv_broker's live handoffs);
    ``health``, when given, runs while serving and owns the serving status until the stop
    (an instance is SERVING only while attached to kv_broker); ``drained()`` runs after the
    drain, before the server stops (e.g. to end long-lived streams cleanly)."""
    watcher = asyncio.create_task(health()) if health is not None else None
    try:
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await server.set_serving(False, ("", *services))
        drain.start()
        start = time.monotonic()
        idle = await drain.wait_idle(drain_timeout_s, busy)
        waited = time.monotonic() - start
        if idle:
            log.info("%s drained in %.1f s; stopping", label, waited)
        else:
            log.warning(
                "%s: %d calls and %d other tasks still running after the %.0f s drain timeout;"
                " cancelling them",
                label,
                drain.in_flight,
                busy(),
                drain_timeout_s,
            )
        try:
            if drained is not None:
                await drained()
        finally:
            await server.server.stop(STOP_GRACE_S)


class ServiceConfig(Protocol):
    host: str
    advertise_host: str
    port: int
    metrics_port: int
    drain_timeout_s: float
    tls: TLSConfig
    max_message_bytes: int


class ControlPlaneServicer(Protocol):
    def start(self) -> None: ...

    async def close(self) -> None: ...


async def serve_control_plane(
    label: str,
    service_name: str,
    register: Callable[[grpc.aio.Server], None],
    servicer: ControlPlaneServicer,
    registry: CollectorRegistry,
    config: ServiceConfig,
    stop: asyncio.Event,
    drain: Drain,
    ready: Callable[[int], None] | None = None,
    busy: Callable[[], int] = lambda: 0,
) -> None:
    """kv_broker's and EPLB's life: their server (health, reflection, ``drain``'s
    interceptor), the Prometheus endpoint and :func:`serve_until_stopped`, which closes the
    servicer once drained. ``ready(port)`` once it accepts calls; ``label`` names it in logs."""
    set_channel_defaults(config.tls, config.max_message_bytes)
    running = await start_server(
        register,
        (service_name,),
        config.host,
        config.port,
        tls=config.tls,
        max_message_bytes=config.max_message_bytes,
        interceptors=[drain.interceptor()],
    )
    servicer.start()
    closed = False

    async def close() -> None:
        nonlocal closed
        closed = True
        await servicer.close()

    try:
        async with metrics_endpoint(registry, config.metrics_port, config.host, label):
            log.info(
                "%s listening on %s, advertised as %s",
                label,
                host_port(config.host, running.port),
                host_port(advertise_host(config.host, config.advertise_host), running.port),
            )
            if ready is not None:
                ready(running.port)
            await serve_until_stopped(
                label,
                running,
                (service_name,),
                drain,
                stop,
                config.drain_timeout_s,
                busy,
                drained=close,
            )
    finally:
        if not closed:  # serving never started
            await close()
        await running.server.stop(STOP_GRACE_S)
