"""A unified instance: engine + gRPC server (dsmesh.v1.Decode) + kv_broker link.

It takes whole requests, so it has no KV pool to register and no transfer engine; the broker
link is for discovery (the gateway finds it there) and liveness (health follows it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from dsmesh.clients.broker import BrokerLink
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.instance.attach import (
    ENGINE_GROUP,
    InstanceConfig,
    new_instance_id,
    serve_attached,
    started_clock,
)
from dsmesh.instance.metrics import start_metrics
from dsmesh.instance.worker import EngineWorker
from dsmesh.options.fields import nested
from dsmesh.runtime.grpc_server import set_channel_defaults
from dsmesh.runtime.telemetry import tracing
from dsmesh.unified_svc.servicer import UnifiedServicer
from dsmesh.v1 import decode_pb2, decode_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb

log = logging.getLogger(__name__)
_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"]
SERVICE = _SERVICE.full_name


@dataclass(frozen=True, kw_only=True)
class UnifiedConfig(InstanceConfig):
    """Each option is a flag of ``dsmesh unified`` (dsmesh/options/fields.py)."""

    engine: EngineConfig = nested(
        EngineConfig, group=ENGINE_GROUP, default_factory=lambda: EngineConfig(role="unified")
    )


async def serve(
    config: UnifiedConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None = None
) -> None:
    async with tracing("unified"):  # before any channel or server: they pick their interceptors
        await _serve(config, stop, ready)


async def _serve(
    config: UnifiedConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None
) -> None:
    set_channel_defaults(config.tls, config.max_message_bytes)  # before the broker channel
    engine_config = dataclasses.replace(config.engine, role="unified")
    engine = await asyncio.to_thread(  # loads off the event loop
        LLMEngine, engine_config, startup=started_clock()
    )
    worker = EngineWorker(engine)
    worker.start()
    instance_id = config.instance_id or new_instance_id("unified")
    instance = kb.Instance(instance_id=instance_id, role=kb.ROLE_UNIFIED)
    broker = BrokerLink(config.broker_address, instance)
    metrics = start_metrics(engine, "unified", config.metrics_port, config.host)
    servicer = UnifiedServicer(worker, instance_id, metrics)
    try:
        await serve_attached(
            "unified",
            _SERVICE,
            lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, s),
            config,
            instance,
            broker,
            stop,
            ready,
            refused=("Decode", "GetLoad"),
            background=servicer.drain,
            startup=engine.startup,
        )
    finally:
        worker.stop()
