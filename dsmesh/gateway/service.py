"""The gateway process: gRPC Generation + REST/OpenAI on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from dsmesh.engine.model.config import load_config
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.config import GatewayConfig
from dsmesh.gateway.core import CoreLimits, GenerationCore
from dsmesh.gateway.grpc_servicer import GenerationServicer
from dsmesh.gateway.http_app import build_app
from dsmesh.gateway.metrics import GatewayMetrics
from dsmesh.gateway.registry import InstanceRegistry
from dsmesh.runtime import telemetry
from dsmesh.runtime.address import advertise_host, host_port
from dsmesh.runtime.drain import Drain
from dsmesh.runtime.grpc_server import method_paths, set_channel_defaults, start_server
from dsmesh.runtime.heap import freeze_startup_heap
from dsmesh.runtime.lifecycle import STOP_GRACE_S, serve_until_stopped
from dsmesh.runtime.security import ApiKeyInterceptor
from dsmesh.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)
_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
SERVICE = _SERVICE.full_name
__all__ = ["SERVICE", "GatewayConfig", "serve"]


async def serve(
    config: GatewayConfig,
    stop: asyncio.Event,
    ready: Callable[[int, int], None] | None = None,
) -> None:
    tracing = telemetry.setup_tracing("gateway")  # before any channel or server exists
    set_channel_defaults(config.tls, config.max_message_bytes)  # ditto
    model_config = load_config(config.model_dir)
    tokenizer = Tokenizer.from_dir(config.model_dir)
    names = config.served_model_names or (Path(config.model_dir).resolve().name,)
    registry = InstanceRegistry(config.broker_address, follow_prefixes=config.kv_routing_weight > 0)
    registry.start()
    metrics = GatewayMetrics(registry.kv_pages)
    core = GenerationCore(
        registry,
        tokenizer,
        model_config,
        metrics,
        CoreLimits(
            config.request_timeout_s,
            config.handoff_timeout_s,
            max_inflight=config.max_inflight,
            max_queued=config.max_queued,
            kv_routing_weight=config.kv_routing_weight,
            migration_limit=config.migration_limit,
        ),
    )
    drain = Drain(method_paths(_SERVICE, "Generate"))  # Abort concerns accepted work
    grpc_server = await start_server(
        lambda s: generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(core), s),
        [SERVICE],
        config.host,
        config.grpc_port,
        tls=config.tls,
        max_message_bytes=config.max_message_bytes,
        interceptors=[
            *([ApiKeyInterceptor(config.api_keys)] if config.api_keys else []),
            drain.interceptor(),
        ],
    )
    runner = web.AppRunner(
        build_app(
            core,
            names,
            config.max_body_bytes,
            config.api_keys,
            drain,
            reasoning_parser=config.reasoning_parser,
            unknown_fields=config.unknown_fields,
        ),
        handler_cancellation=True,  # a client that disconnects cancels its request
        access_log=None,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.http_port)
    await site.start()
    http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    log.info(
        "gateway serving model %s: gRPC %s, HTTP %s (bound to %s)",
        ", ".join(map(repr, names)),
        host_port(advertise_host(config.host, config.advertise_host), grpc_server.port),
        host_port(advertise_host(config.host, config.advertise_host), http_port),
        config.host,
    )
    freeze_startup_heap()  # tokenizer, templates, servers built: out of the collector's way
    if ready is not None:
        ready(grpc_server.port, http_port)
    try:
        await serve_until_stopped(
            "gateway", grpc_server, (SERVICE,), drain, stop, config.drain_timeout_s
        )
    finally:
        await grpc_server.server.stop(STOP_GRACE_S)  # when serving never started
        with contextlib.suppress(Exception):
            await runner.cleanup()
        await registry.close()
        if tracing:
            telemetry.shutdown_tracing()
