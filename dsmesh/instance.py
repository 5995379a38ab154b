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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from dsmesh.broker_link import BrokerLink
from dsmesh.engine_worker import EngineWorker
from dsmesh.ep_group import RankSpec
from dsmesh.grpc_server import RunningServer
from dsmesh.transfer import KVTransport, RemotePool, make_transport, rdma_devices, resolve_protocol
from engine.llm_engine import EngineConfig, LLMEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "mooncake"
    # "auto" (tcp for a host pool; nvlink_intra for a GPU pool reached on loopback, else
    # rdma), "tcp", "nvlink_intra" or "rdma": dsmesh/transfer/protocol.py
    protocol: str = "auto"
    hostname: str = "127.0.0.1"  # address peers use to reach this process's transfer engine
    device_name: str = ""  # RDMA devices, e.g. "mlx5_0,mlx5_1"


@dataclass
class InstanceParts:
    engine: LLMEngine
    worker: EngineWorker
    transport: KVTransport
    pool: RemotePool
    eplb_link: object | None = None  # eplb_svc.client.EPLBLink on rank 0 of an EPLB group
    group_hook: object | None = None  # engine.ep.eplb_hook.GroupEPLB on each rank

    async def close_eplb(self) -> None:
        """After the worker stopped: end the eplb link and the staging thread."""
        if self.eplb_link is not None:
            await self.eplb_link.close()  # type: ignore[attr-defined]
        if self.group_hook is not None:
            self.group_hook.close()  # type: ignore[attr-defined]


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
    if ep_rank is None:
        engine = await asyncio.to_thread(LLMEngine, engine_config)
        worker = EngineWorker(engine)
    else:
        from dsmesh.ep_group import fatal_exit
        from engine.ep.runtime import GroupVote, build_ep_engine

        engine = await asyncio.to_thread(build_ep_engine, engine_config, ep_rank.ep, ep_rank.rank)
        if ep_rank.eplb_address:
            hook, link = _eplb_parts(engine, engine_config, ep_rank)
        worker = EngineWorker(
            engine,
            name=f"engine-ep{ep_rank.rank}",
            group_vote=GroupVote(engine.device, 0 if hook is None else hook.NUM_FLAGS),
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
    from engine.ep.eplb_hook import GroupEPLB
    from engine.llm_engine import resolve_model_dir

    hook = GroupEPLB(
        engine.model, resolve_model_dir(engine_config.model), spec.eplb_report_interval_s
    )
    if spec.rank != 0:
        return hook, None
    from eplb_svc.client import EPLBLink, make_sample

    location = engine.model.expert_location
    num_groups = engine.model_config.moe.n_group
    link: EPLBLink | None = None

    def sample():
        report = hook.pop_report()
        if report is None:
            return None
        if hook.pending_reports() and link is not None:
            link.report_now()
        return make_sample(
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
    service: str,
    server: RunningServer,
    broker: BrokerLink,
    instance_id: str,
    host: str,
    stop: asyncio.Event,
    ready: Callable[[str, int], None] | None,
    drain: Callable[[], Awaitable[None]],
) -> None:
    """An instance's life once its server is up: attach to kv_broker, health that follows
    the link, announce the port, serve until ``stop``. Then health goes NOT_SERVING, the
    server stops (in-flight calls get 5 s), ``drain`` waits for the servicer's background
    work and the link closes; the caller stops its engine and transport after."""
    broker.start()
    health = asyncio.create_task(health_follows_broker(server, broker, (service,)))
    log.info("%s %s listening on %s:%d", role, instance_id, host, server.port)
    if ready is not None:
        ready(instance_id, server.port)
    try:
        await stop.wait()
    finally:
        await server.set_serving(False, ("", service))
        health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await health
        await server.server.stop(grace=5)
        await drain()
        await broker.close()
