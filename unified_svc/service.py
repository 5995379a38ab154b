"""A unified instance: engine + gRPC server (dsmesh.v1.Decode) + kv_broker link.

It takes whole requests, so it has no KV pool to register and no transfer engine; the broker
link is for discovery (the gateway finds it there) and liveness (health follows it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from dsmesh.broker_link import BrokerLink
from dsmesh.engine_worker import EngineWorker
from dsmesh.grpc_server import set_channel_defaults, start_server
from dsmesh.instance import new_instance_id, serve_attached
from dsmesh.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from dsmesh.service_metrics import InstanceMetrics
from dsmesh.telemetry import tracing
from dsmesh.v1 import decode_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from engine.llm_engine import EngineConfig, LLMEngine
from unified_svc.servicer import UnifiedServicer

log = logging.getLogger(__name__)
SERVICE = "dsmesh.v1.Decode"


@dataclass(frozen=True)
class UnifiedConfig:
    broker_address: str
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(prefix_cache=True))
    host: str = "127.0.0.1"
    port: int = 0
    instance_id: str = ""
    metrics_port: int = 0  # Prometheus /metrics port; 0 = off
    tls: TLSConfig = TLSConfig()  # every gRPC server and channel of the process; off by default
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


async def serve(
    config: UnifiedConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None = None
) -> None:
    async with tracing("unified"):  # before any channel or server: they pick their interceptors
        await _serve(config, stop, ready)


async def _serve(
    config: UnifiedConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None
) -> None:
    set_channel_defaults(config.tls, config.max_message_bytes)  # before the broker channel
    engine = await asyncio.to_thread(LLMEngine, config.engine)  # loads off the event loop
    worker = EngineWorker(engine)
    worker.start()
    instance_id = config.instance_id or new_instance_id("unified")
    instance = kb.Instance(instance_id=instance_id, role=kb.ROLE_UNIFIED)
    broker = BrokerLink(config.broker_address, instance)
    servicer = UnifiedServicer(worker, instance_id)
    server = await start_server(
        lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, s),
        [SERVICE],
        config.host,
        config.port,
        tls=config.tls,
        max_message_bytes=config.max_message_bytes,
    )
    instance.grpc_address = f"{config.host}:{server.port}"
    if config.metrics_port:
        metrics = InstanceMetrics(engine, "unified", lambda: len(engine.scheduler.waiting))
        servicer.metrics = metrics
        port = metrics.serve(config.metrics_port, config.host)
        log.info("unified metrics on http://%s:%d/metrics", config.host, port)
    try:
        await serve_attached(
            "unified",
            SERVICE,
            server,
            broker,
            instance_id,
            config.host,
            stop,
            ready,
            servicer.drain,
        )
    finally:
        worker.stop()
