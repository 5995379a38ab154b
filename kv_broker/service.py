"""The kv_broker process: its config and :func:`serve`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from dsmesh.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from dsmesh.service_loop import serve_until_stopped
from dsmesh.telemetry import tracing
from dsmesh.v1 import kv_broker_pb2, kv_broker_pb2_grpc
from kv_broker.metrics import BrokerMetrics
from kv_broker.servicer import KVBrokerServicer

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
    metrics = BrokerMetrics()
    servicer = KVBrokerServicer(config, metrics)
    async with tracing("kv-broker"):  # before the server: it picks its interceptors
        await serve_until_stopped(
            "kv-broker",
            SERVICE_NAME,
            lambda server: kv_broker_pb2_grpc.add_KVBrokerServicer_to_server(servicer, server),
            servicer,
            metrics.registry,
            config,
            stop,
            ready,
        )
