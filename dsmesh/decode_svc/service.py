"""A decode instance: engine + registered KV pool + gRPC server + kv_broker link."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from dsmesh.clients.broker import BrokerLink
from dsmesh.decode_svc.handoff import DecodeHandoffs
from dsmesh.decode_svc.servicer import DecodeLimits, DecodeServicer
from dsmesh.instance.attach import (
    PDInstanceConfig,
    build_instance,
    new_instance_id,
    serve_attached,
)
from dsmesh.instance.metrics import start_metrics
from dsmesh.options import parse as argtypes
from dsmesh.options.fields import option
from dsmesh.runtime.grpc_server import channel, set_channel_defaults
from dsmesh.runtime.telemetry import tracing
from dsmesh.v1 import decode_pb2, decode_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

log = logging.getLogger(__name__)
_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"]
SERVICE = _SERVICE.full_name


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(PDInstanceConfig):
    """Each option is a flag of ``dsmesh decode`` (dsmesh/options/fields.py)."""

    handoff_timeout_s: float = option(
        30.0, "seconds a request may wait for its prompt KV", parse=argtypes.seconds, up=True
    )
    release_quarantine_s: float = option(
        10.0,
        "longest wait for prefill to release a failed handoff before its pages are reused",
        parse=argtypes.seconds,
        up=True,
    )
    reserve_wait_s: float = option(
        10.0,
        "seconds a request may wait, in arrival order, for KV pages and a running slot before "
        "RESOURCE_EXHAUSTED",
        parse=argtypes.seconds,
    )


async def serve(
    config: DecodeConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None = None
) -> None:
    async with tracing("decode"):  # before any channel or server: they pick their interceptors
        await _serve(config, stop, ready)


async def _serve(
    config: DecodeConfig, stop: asyncio.Event, ready: Callable[[str, int], None] | None
) -> None:
    set_channel_defaults(config.tls, config.max_message_bytes)  # before the broker channel
    # prefill copies a prompt's KV into the pages reserved here, a run of pages per layer:
    # keep them in runs (the prefix cache of finished requests evicts for it)
    engine = dataclasses.replace(config.engine, contiguous_prompts=True, role="decode")
    parts = await build_instance(engine, config.transfer, config.ep_rank)
    instance = parts.member(config.instance_id or new_instance_id("decode"), kb.ROLE_DECODE)
    handoffs = DecodeHandoffs(config.reserve_wait_s, config.release_quarantine_s)
    metrics = start_metrics(  # waiting: for their KV, or retracted to recompute
        parts.engine,
        "decode",
        config.metrics_port,
        config.host,
        lambda load: handoffs.num_waiting + load.num_waiting,
        in_line=lambda: handoffs.num_in_line,
    )
    broker_channel = channel(config.broker_address)
    servicer = DecodeServicer(
        parts.worker,
        kb_grpc.KVBrokerStub(broker_channel),
        parts.layout(),
        parts.pool,
        DecodeLimits(instance.instance_id, handoff_timeout_s=config.handoff_timeout_s),
        handoffs,
        metrics,
    )
    broker = BrokerLink(config.broker_address, instance, channel=broker_channel)
    try:
        await serve_attached(
            "decode",
            _SERVICE,
            lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(servicer, s),
            config,
            instance,
            broker,
            stop,
            ready,
            refused=("Decode", "GetLoad"),
            background=servicer.drain,
            startup=parts.engine.startup,
        )
    finally:
        parts.worker.stop()
        await parts.close_eplb()
        parts.transport.close()
