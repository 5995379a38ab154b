"""A decode instance: engine + registered KV pool + gRPC server + kv_broker link."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from decode_svc.servicer import DecodeLimits, DecodeServicer
from dsmesh.broker_link import BrokerLink
from dsmesh.ep_group import RankSpec
from dsmesh.grpc_server import set_channel_defaults, start_server
from dsmesh.instance import TransferConfig, build_instance, new_instance_id, serve_attached
from dsmesh.kv_layout import layout_of
from dsmesh.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from dsmesh.service_metrics import InstanceMetrics
from dsmesh.telemetry import tracing
from dsmesh.v1 import decode_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from engine.llm_engine import EngineConfig

log = logging.getLogger(__name__)
SERVICE = "dsmesh.v1.Decode"


@dataclass(frozen=True)
class DecodeConfig:
    broker_address: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = "127.0.0.1"
    port: int = 0
    instance_id: str = ""
    metrics_port: int = 0  # Prometheus /metrics port; 0 = off
    handoff_timeout_s: float = 30.0
    release_quarantine_s: float = 10.0
    reserve_wait_s: float = 10.0
    tls: TLSConfig = TLSConfig()  # every gRPC server and channel of the process; off by default
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ep_rank: RankSpec | None = None  # set on each rank of an expert-parallel group


async def serve(
    config: DecodeConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None = None
) -> None:
    async with tracing("decode"):  # before any channel or server: they pick their interceptors
        await _serve(config, stop, ready)


async def _serve(
    config: DecodeConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None
) -> None:
    set_channel_defaults(config.tls, config.max_message_bytes)  # before the broker channel
    parts = await build_instance(config.engine, config.transfer, config.ep_rank)
    instance_id = config.instance_id or new_instance_id("decode")
    limits = DecodeLimits(
        instance_id,
        handoff_timeout_s=config.handoff_timeout_s,
        release_quarantine_s=config.release_quarantine_s,
        reserve_wait_s=config.reserve_wait_s,
    )
    instance = kb.Instance(
        instance_id=instance_id, role=kb.ROLE_DECODE, transfer_session=parts.pool.session
    )
    broker = BrokerLink(config.broker_address, instance)
    servicer = DecodeServicer(
        parts.worker, broker, layout_of(parts.engine, parts.transport.signature), parts.pool, limits
    )
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
        metrics = InstanceMetrics(parts.engine, "decode", lambda: servicer.waiting_handoffs)
        servicer.metrics = metrics
        port = metrics.serve(config.metrics_port, config.host)
        log.info("decode metrics on http://%s:%d/metrics", config.host, port)
    try:
        await serve_attached(
            "decode",
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
        parts.worker.stop()
        await parts.close_eplb()
        parts.transport.close()
