"""The kv_broker process: its config and :func:`serve`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dsmesh.kv_broker.config import BrokerConfig
from dsmesh.kv_broker.metrics import BrokerMetrics
from dsmesh.kv_broker.servicer import KVBrokerServicer
from dsmesh.runtime.drain import Drain
from dsmesh.runtime.grpc_server import method_paths
from dsmesh.runtime.lifecycle import (
    serve_control_plane,
)
from dsmesh.runtime.telemetry import tracing
from dsmesh.v1 import kv_broker_pb2, kv_broker_pb2_grpc

_SERVICE = kv_broker_pb2.DESCRIPTOR.services_by_name["KVBroker"]
SERVICE_NAME = _SERVICE.full_name


async def serve(
    config: BrokerConfig,
    stop: asyncio.Event,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve ``dsmesh.v1.KVBroker`` (plus health and reflection) until ``stop`` is set.

    ``ready(port)`` is called once the server accepts calls, with the bound port. On stop
    (dsmesh.runtime.lifecycle): health goes NOT_SERVING, new ``Reserve`` calls get
    UNAVAILABLE, the live handoffs get ``config.drain_timeout_s`` to end; then Attach streams
    end with OK and waiting calls are answered. Traces go wherever the ``OTEL_*`` environment says
    (service name ``kv-broker``); off by default.
    """
    metrics = BrokerMetrics()
    servicer = KVBrokerServicer(config, metrics)
    async with tracing("kv-broker"):  # before the server: it picks its interceptors
        await serve_control_plane(
            "kv-broker",
            SERVICE_NAME,
            lambda server: kv_broker_pb2_grpc.add_KVBrokerServicer_to_server(servicer, server),
            servicer,
            metrics.registry,
            config,
            stop,
            Drain(method_paths(_SERVICE, "Reserve"), untracked=method_paths(_SERVICE, "Attach")),
            ready,
            busy=servicer.live_handoffs,
        )
