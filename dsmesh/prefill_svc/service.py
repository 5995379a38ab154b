"""A prefill instance: engine + transfer engine + gRPC server + kv_broker link."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from dsmesh.clients.broker import BrokerLink
from dsmesh.instance.attach import (
    PDInstanceConfig,
    build_instance,
    new_instance_id,
    serve_attached,
)
from dsmesh.instance.metrics import start_metrics
from dsmesh.options import parse as argtypes
from dsmesh.options.fields import option
from dsmesh.prefill_svc.servicer import PrefillLimits, PrefillServicer
from dsmesh.runtime.grpc_server import channel, set_channel_defaults
from dsmesh.runtime.telemetry import tracing
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc
from dsmesh.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"]
SERVICE = _SERVICE.full_name


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(PDInstanceConfig):
    """Each option is a flag of ``dsmesh prefill`` (dsmesh/options/fields.py)."""

    resolve_wait_s: float = option(
        30.0, "seconds to wait for decode's page reservation", parse=argtypes.seconds
    )
    max_queued_tokens: int = option(
        262144,
        "prompt tokens admitted and unfinished at most; beyond it RESOURCE_EXHAUSTED",
        parse=argtypes.count,
        up=True,
    )
    max_transfer_backlog_s: float = option(
        1.0,
        "new prompts wait while the queued KV writes would take longer than this many seconds "
        "at the measured transfer rate",
        parse=argtypes.seconds,
    )


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
    # no decode graphs to capture, no memory or start-up time spent on them. Its prompt
    # pages are copied to decode, a run of pages per layer: keep them in runs.
    engine = dataclasses.replace(
        config.engine, cuda_graphs=False, contiguous_prompts=True, role="prefill"
    )
    parts = await build_instance(engine, config.transfer, config.ep_rank)
    instance = parts.member(config.instance_id or new_instance_id("prefill"), kb.ROLE_PREFILL)
    metrics = start_metrics(parts.engine, "prefill", config.metrics_port, config.host)
    broker_channel = channel(config.broker_address)
    servicer = PrefillServicer(
        parts.worker,
        kb_grpc.KVBrokerStub(broker_channel),
        parts.layout(),
        parts.transport,
        PrefillLimits(
            instance.instance_id,
            resolve_wait_s=config.resolve_wait_s,
            max_queued_tokens=config.max_queued_tokens,
            max_transfer_backlog_s=config.max_transfer_backlog_s,
        ),
        metrics,
    )
    broker = BrokerLink(
        config.broker_address,
        instance,
        on_event=servicer.on_broker_event,
        on_lost=[servicer.on_broker_lost],
        channel=broker_channel,
    )
    try:
        await serve_attached(
            "prefill",
            _SERVICE,
            lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
            config,
            instance,
            broker,
            stop,
            ready,
            refused=("Prefill", "GetLoad"),
            background=servicer.drain,
            startup=parts.engine.startup,
        )
    finally:
        parts.worker.stop()
        await parts.close_eplb()
        servicer.close()
        parts.transport.close()
