"""A prefill instance: engine + transfer engine + gRPC server + kv_broker link."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from dsmesh.broker_link import BrokerLink
from dsmesh.ep_group import RankSpec
from dsmesh.grpc_server import set_channel_defaults, start_server
from dsmesh.instance import TransferConfig, build_instance, new_instance_id, serve_attached
from dsmesh.kv_layout import layout_of
from dsmesh.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from dsmesh.service_metrics import InstanceMetrics
from dsmesh.telemetry import tracing
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import prefill_pb2_grpc
from engine.llm_engine import EngineConfig
from prefill_svc.servicer import PrefillLimits, PrefillServicer
from prefill_svc.transfer_queue import TransferQueue

log = logging.getLogger(__name__)
SERVICE = "dsmesh.v1.Prefill"


@dataclass(frozen=True)
class PrefillConfig:
    broker_address: str
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(prefix_cache=True))
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = "127.0.0.1"
    port: int = 0
    instance_id: str = ""
    metrics_port: int = 0  # Prometheus /metrics port; 0 = off
    resolve_wait_s: float = 30.0
    max_queued_tokens: int = 262144
    max_transfer_backlog_s: float = 1.0
    tls: TLSConfig = TLSConfig()  # every gRPC server and channel of the process; off by default
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ep_rank: RankSpec | None = None  # set on each rank of an expert-parallel group


async def serve(
    config: PrefillConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None = None
) -> None:
    async with tracing("prefill"):  # before any channel or server: they pick their interceptors
        await _serve(config, stop, ready)


async def _serve(
    config: PrefillConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None
) -> None:
    set_channel_defaults(config.tls, config.max_message_bytes)  # before the broker channel
    # Prefill runs no decode step (it samples each first token in the prompt's last chunk):
    # no decode graphs to capture, no memory or start-up time spent on them.
    engine = dataclasses.replace(config.engine, cuda_graphs=False)
    parts = await build_instance(engine, config.transfer, config.ep_rank)
    instance_id = config.instance_id or new_instance_id("prefill")
    instance = kb.Instance(
        instance_id=instance_id, role=kb.ROLE_PREFILL, transfer_session=parts.pool.session
    )
    broker = BrokerLink(config.broker_address, instance)
    servicer = PrefillServicer(
        parts.worker,
        broker,
        layout=layout_of(parts.engine, parts.transport.signature),
        transfers=None,
        limits=PrefillLimits(
            instance_id,
            resolve_wait_s=config.resolve_wait_s,
            max_queued_tokens=config.max_queued_tokens,
            max_transfer_backlog_s=config.max_transfer_backlog_s,
        ),
    )
    broker.on_event = servicer.on_broker_event
    transfers = TransferQueue(parts.transport, parts.engine.kv_pool, servicer.callbacks())
    servicer.transfers = transfers
    servicer.loop = asyncio.get_running_loop()
    transfers.start()
    server = await start_server(
        lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
        [SERVICE],
        config.host,
        config.port,
        tls=config.tls,
        max_message_bytes=config.max_message_bytes,
    )
    instance.grpc_address = f"{config.host}:{server.port}"
    if config.metrics_port:
        metrics = InstanceMetrics(
            parts.engine, "prefill", lambda: len(parts.engine.scheduler.waiting)
        )
        servicer.metrics = metrics
        transfers.metrics = metrics
        port = metrics.serve(config.metrics_port, config.host)
        log.info("prefill metrics on http://%s:%d/metrics", config.host, port)
    try:
        await serve_attached(
            "prefill",
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
        transfers.stop()
        parts.transport.close()
