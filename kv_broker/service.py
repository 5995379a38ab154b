"""The kv_broker process: its config and :func:`serve`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from dsmesh.grpc_server import set_channel_defaults, start_server
from dsmesh.metrics_http import metrics_endpoint
from dsmesh.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from dsmesh.telemetry import tracing
from dsmesh.v1 import kv_broker_pb2, kv_broker_pb2_grpc
from kv_broker.metrics import BrokerMetrics
from kv_broker.servicer import KVBrokerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = kv_broker_pb2.DESCRIPTOR.services_by_name["KVBroker"].full_name
DEFAULT_PORT = 50054  # the CLI's default; BrokerConfig's 0 picks any free port


@dataclass(frozen=True)
class BrokerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (reported through ``ready``)
    handoff_timeout_s: float = 30.0  # whole-handoff deadline when Reserve gives none
    heartbeat_interval_s: float = 1.0  # heartbeat events on idle Attach streams
    liveness_grace_s: float = 2.0  # time to re-attach before an instance counts as lost
    terminal_ttl_s: float = 60.0  # how long finished handoffs stay readable (Get, Await)
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0 = off
    shutdown_grace_s: float = 5.0  # in-flight RPCs get this long after a stop
    tls: TLSConfig = TLSConfig()  # TLS / mTLS on the server; off by default
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        for name in ("handoff_timeout_s", "heartbeat_interval_s", "terminal_ttl_s"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("liveness_grace_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")


async def serve(
    config: BrokerConfig,
    stop: asyncio.Event,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve ``dsmesh.v1.KVBroker`` (plus health and reflection) until ``stop`` is set.

    ``ready(port)`` is called once the server accepts calls, with the bound port. On stop:
    health goes NOT_SERVING, Attach streams end with OK, in-flight calls get
    ``config.shutdown_grace_s`` to finish. Traces go wherever the ``OTEL_*`` environment says
    (service name ``kv-broker``); off by default.
    """
    async with tracing("kv-broker"):  # before the server: it picks its interceptors
        await _serve(config, stop, ready)


async def _serve(
    config: BrokerConfig, stop: asyncio.Event, ready: Callable[[int], None] | None
) -> None:
    set_channel_defaults(config.tls, config.max_message_bytes)
    metrics = BrokerMetrics()
    servicer = KVBrokerServicer(config, metrics)
    running = await start_server(
        lambda server: kv_broker_pb2_grpc.add_KVBrokerServicer_to_server(servicer, server),
        (SERVICE_NAME,),
        config.host,
        config.port,
        tls=config.tls,
        max_message_bytes=config.max_message_bytes,
    )
    servicer.start()
    try:
        async with metrics_endpoint(
            metrics.registry, config.metrics_port, config.host, "kv-broker"
        ):
            log.info("kv-broker listening on %s:%d", config.host, running.port)
            if ready is not None:
                ready(running.port)
            await stop.wait()
    finally:
        log.info("kv-broker stopping")
        await running.set_serving(False, ("", SERVICE_NAME))
        await servicer.close()
        await running.server.stop(config.shutdown_grace_s)
