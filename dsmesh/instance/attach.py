"""What a prefill or decode instance sets up besides its servicer: the engine on its
thread, the KV pool registered with the transfer engine, and health that follows the
kv_broker link."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from dsmesh.clients.broker import BrokerLink
from dsmesh.engine.ep.runtime import EP_GROUP, EPConfig
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.startup import StartupClock, process_age_s
from dsmesh.instance.ep_group import RankSpec
from dsmesh.instance.layout import layout_of
from dsmesh.instance.worker import EngineWorker
from dsmesh.options.fields import REQUIRED, nested, option
from dsmesh.runtime.address import LOOPBACK, advertise_host, host_port
from dsmesh.runtime.drain import Drain
from dsmesh.runtime.grpc_server import RunningServer, method_paths, start_server
from dsmesh.runtime.heap import freeze_startup_heap
from dsmesh.runtime.lifecycle import STOP_GRACE_S, ServiceConfig, serve_until_stopped
from dsmesh.runtime.server_options import ServerOptions, metrics_port_option, port_option
from dsmesh.runtime.transfer import (
    PROTOCOLS,
    KVTransport,
    RemotePool,
    make_transport,
    rdma_devices,
    resolve_protocol,
)
from dsmesh.v1 import kv_broker_pb2 as kb

log = logging.getLogger(__name__)


TRANSFER_GROUP = "KV transfer (Mooncake Transfer Engine)"
ENGINE_GROUP = "engine (docs/OPTIONS.md)"


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "mooncake"
    protocol: str = option(
        "auto",
        "how KV bytes move: auto = tcp for a CPU pool, nvlink_intra (CUDA IPC) for a GPU pool "
        "whose peers are on this host (--transfer-hostname on loopback), else rdma (GPUDirect "
        "RDMA, needs an RDMA NIC); tcp refuses a GPU pool (docs/PD.md, "
        "dsmesh/runtime/transfer/protocol.py)",
        flag="--transfer-protocol",
        choices=PROTOCOLS,
    )
    hostname: str = option(
        LOOPBACK,
        "address peers use to reach this process's transfer engine",
        flag="--transfer-hostname",
        metavar="HOST",
        cli_default="",  # the CLI puts the advertised host
        default_text="the advertised host, --advertise-host",
    )
    device_name: str = option("", 'RDMA devices, e.g. "mlx5_0,mlx5_1"', flag="--transfer-device")


@dataclass(frozen=True, kw_only=True)
class InstanceConfig(ServerOptions):
    """What every prefill, decode and unified instance is told at start-up; each role's
    config adds its own fields (keyword-only). Each option is a flag of the instance's
    command (dsmesh/options/fields.py)."""

    broker_address: str = option(REQUIRED, "kv_broker address HOST:PORT", flag="--broker")
    engine: EngineConfig = nested(EngineConfig, group=ENGINE_GROUP)
    port: int = port_option()
    instance_id: str = option("", "instance name", default_text="role-host-pid-rand")
    metrics_port: int = metrics_port_option()


@dataclass(frozen=True, kw_only=True)
class PDInstanceConfig(InstanceConfig):
    """What prefill and decode instances share: the prefix cache on, the transfer engine
    that moves KV between them, and the expert-parallel group each may run as."""

    # decode's prefix cache keeps finished requests' KV, so a follow-up turn receives only
    # the pages the instance does not hold already
    engine: EngineConfig = nested(
        EngineConfig, group=ENGINE_GROUP, default_factory=lambda: EngineConfig(prefix_cache=True)
    )
    transfer: TransferConfig = nested(TransferConfig, group=TRANSFER_GROUP)
    ep: EPConfig = nested(EPConfig, group=EP_GROUP)  # ep_size 1: one process
    eplb_address: str = option(
        "",
        "eplb_svc address: stream expert load to it and apply its placements live "
        "(docs/EPLB.md); needs --ep-size > 1 or redundant experts",
        flag="--eplb",
        metavar="HOST:PORT",
        group=EP_GROUP,
    )
    eplb_report_interval_s: float = option(
        1.0, "seconds between expert-load reports to eplb_svc", group=EP_GROUP
    )
    ep_rank: RankSpec | None = None  # set on each rank of an expert-parallel group


@dataclass
class InstanceParts:
    engine: LLMEngine
    worker: EngineWorker
    transport: KVTransport
    pool: RemotePool
    eplb_link: object | None = None  # dsmesh.clients.eplb.EPLBLink on rank 0 of an EPLB group
    group_hook: object | None = None  # dsmesh.engine.ep.eplb_hook.GroupEPLB on each rank

    def member(self, instance_id: str, role: kb.Role.ValueType) -> kb.Instance:
        """This instance as kv_broker lists it (its gRPC address is set once it serves)."""
        return kb.Instance(instance_id=instance_id, role=role, transfer_session=self.pool.session)

    def layout(self) -> kb.KVLayout:
        """The KV layout signature that kv_broker compares at the handshake."""
        return layout_of(self.engine, self.transport.signature)

    async def close_eplb(self) -> None:
        """After the worker stopped: end the eplb link and the staging thread."""
        if self.eplb_link is not None:
            await self.eplb_link.close()  # type: ignore[attr-defined]
        if self.group_hook is not None:
            self.group_hook.close()  # type: ignore[attr-defined]


def started_clock() -> StartupClock:
    """A start-up clock for an engine about to be built, holding ``imports``: the seconds
    from the process's start until now (interpreter, imports, and an expert-parallel
    group's rendezvous)."""
    clock = StartupClock()
    clock.add("imports", process_age_s())
    return clock


def new_instance_id(role: str) -> str:
    host = socket.gethostname().split(".")[0]
    return f"{role}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def build_instance(
    engine_config: EngineConfig, transfer: TransferConfig, ep_rank: RankSpec | None = None
) -> InstanceParts:
    """Load the model (off the event loop), register its KV pool, start the engine thread.

    With ``ep_rank`` this process is one rank of an expert-parallel group (its process group
    already joined): it loads only its experts and steps in lockstep with the other ranks.
    """
    hook = link = None
    startup = started_clock()
    if ep_rank is None:
        engine = await asyncio.to_thread(LLMEngine, engine_config, startup=startup)
        worker = EngineWorker(engine)
    else:
        from dsmesh.engine.ep.runtime import GroupVote, build_ep_engine
        from dsmesh.instance.ep_group import fatal_exit

        engine = await asyncio.to_thread(
            build_ep_engine, engine_config, ep_rank.ep, ep_rank.rank, startup
        )
        if ep_rank.eplb_address:
            hook, link = _eplb_parts(engine, engine_config, ep_rank)
        worker = EngineWorker(
            engine,
            name=f"engine-ep{ep_rank.rank}",
            group_vote=GroupVote(0 if hook is None else hook.NUM_FLAGS),
            on_fatal=fatal_exit,
            group_hook=hook,
        )
    protocol = resolve_protocol(
        transfer.protocol,
        engine.kv_pool.buffer.is_cuda,
        transfer.hostname,
        rdma_devices(),
        transfer.device_name,
    )
    with startup.phase("transfer"):
        transport = make_transport(
            transfer.backend,
            hostname=transfer.hostname,
            protocol=protocol,
            device_name=transfer.device_name,
        )
        pool = transport.register_pool(engine.kv_pool)
    buffer = engine.kv_pool.buffer
    log.info(
        "KV pool (%d pages, %.2f GB on %s) moves by %s at %s",
        engine.kv_pool.num_pages,
        buffer.numel() * buffer.element_size() / 1e9,
        buffer.device,
        transport.signature,
        transport.session_id,
    )
    worker.start()
    if link is not None:
        await link.start()
    return InstanceParts(engine, worker, transport, pool, link, hook)


def _eplb_parts(engine: LLMEngine, engine_config: EngineConfig, spec: RankSpec):
    """Every rank: the lockstep EPLB hook (load recorder, rebalancer). Rank 0 also: the link
    that streams the group's load to eplb_svc and receives its placements."""
    from dsmesh.engine.ep.eplb_hook import GroupEPLB
    from dsmesh.engine.options import resolve_model_dir

    hook = GroupEPLB(
        engine.model, resolve_model_dir(engine_config.model), spec.eplb_report_interval_s
    )
    if spec.rank != 0:
        return hook, None
    from dsmesh.clients.eplb import EPLBLink, load_report

    location = engine.model.expert_location
    num_groups = engine.model_config.moe.n_group
    link: EPLBLink | None = None

    def sample():
        report = hook.pop_report()
        if report is None:
            return None
        if hook.pending_reports() and link is not None:
            link.report_now()
        return load_report(
            spec.group_id,
            report.physical_counts,
            report.num_steps,
            report.physical_to_logical,
            location.num_logical,
            spec.ep.ep_size,
            report.applied_version,
            report.last_swap_seconds,
            num_nodes=spec.ep.nnodes,
            num_groups=num_groups,
        )

    link = EPLBLink(
        spec.eplb_address,
        spec.group_id,
        sample=sample,
        on_placement=hook.offer_placement,
        report_interval_s=spec.eplb_report_interval_s,
    )
    return hook, link


async def health_follows_broker(
    server: RunningServer, broker: BrokerLink, services: tuple[str, ...]
) -> None:
    """SERVING only while attached to kv_broker (an instance without it cannot hand off)."""
    serving: bool | None = None
    while True:
        attached = broker.attached.is_set()
        if attached != serving:
            await server.set_serving(attached, ("", *services))
            serving = attached
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                broker.attached.wait() if not attached else asyncio.sleep(0.2), 0.2
            )


async def serve_attached(
    role: str,
    service: ServiceDescriptor,
    register: Callable[[grpc.aio.Server], None],
    config: ServiceConfig,
    instance: kb.Instance,
    broker: BrokerLink,
    stop: asyncio.Event,
    ready: Callable[[str, int], None] | None,
    refused: Sequence[str],
    background: Callable[[], Awaitable[None]],
    startup: StartupClock | None = None,
) -> None:
    """An instance's life once its servicer is built (dsmesh.runtime.lifecycle): start its
    server, attach to kv_broker, health that follows the link, announce the port (and log
    ``startup``'s phases, with ``server``: what followed the engine's), serve until
    ``stop``. Then drain: health goes NOT_SERVING, the ``refused`` methods (those that
    bring new work) get UNAVAILABLE, the calls in flight get ``config.drain_timeout_s``,
    ``background`` waits for the servicer's background work, the server stops and the link
    closes; the caller stops its engine and transport after."""
    name = service.full_name
    drain = Drain(method_paths(service, *refused))
    server = await start_server(
        register,
        [name],
        config.host,
        config.port,
        tls=config.tls,
        max_message_bytes=config.max_message_bytes,
        interceptors=[drain.interceptor()],
    )
    instance.grpc_address = host_port(
        advertise_host(config.host, config.advertise_host), server.port
    )
    broker.start()
    log.info(
        "%s %s listening on %s, registered as %s",
        role,
        instance.instance_id,
        host_port(config.host, server.port),
        instance.grpc_address,
    )
    freeze_startup_heap()  # engine, graphs and server built: out of the collector's way
    if startup is not None:
        startup.add("server", max(0.0, process_age_s() - startup.total))
        log.info(
            "%s %s ready %.1f s after its start: %s",
            role,
            instance.instance_id,
            startup.total,
            startup.summary(),
        )
    if ready is not None:
        ready(instance.instance_id, server.port)
    try:
        await serve_until_stopped(
            f"{role} {instance.instance_id}",
            server,
            (name,),
            drain,
            stop,
            config.drain_timeout_s,
            health=lambda: health_follows_broker(server, broker, (name,)),
            drained=background,
        )
    finally:
        await server.server.stop(STOP_GRACE_S)  # when serving never started
        await broker.close()
