"""The gateway's view of the mesh: instances discovered through kv_broker, and their load.

Prefill, decode and unified instances attach to kv_broker with their gRPC address, so the
gateway needs only the broker's address: it lists instances every second and polls each one's
``GetLoad`` a few times a second. An instance that stops answering is skipped by routing
until it answers again; one that leaves the broker's list is dropped. Listeners
(``on_update``) run after every poll round and every change of the list.

With ``follow_prefixes`` each poll of an instance also asks for the changes of its prefix
cache since the last one (prefill and unified instances cache prompts, decode instances the
KV of finished requests), kept in ``prefixes`` (dsmesh/gateway/prefix_index.py) for KV-aware
routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from dsmesh.engine.kv.prefix_hashes import PrefixChanges
from dsmesh.gateway.admission import MeshLoads
from dsmesh.gateway.prefix_index import PrefixIndex
from dsmesh.gateway.routing import DecodeLoad, PrefillLoad
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

log = logging.getLogger(__name__)


ROLES = (kb.ROLE_PREFILL, kb.ROLE_DECODE, kb.ROLE_UNIFIED)


@dataclass
class Instance:
    instance_id: str
    role: int
    address: str
    channel: grpc.aio.Channel
    stub: prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub
    load: PrefillLoad | DecodeLoad | None = None
    asked_at: float = 0.0  # monotonic time ``load`` was asked for
    healthy: bool = False


class InstanceRegistry:
    def __init__(
        self,
        broker_address: str,
        poll_interval_s: float = 0.25,
        rpc_timeout_s: float = 2.0,
        follow_prefixes: bool = True,
    ) -> None:
        self.broker_address = broker_address
        self.poll_interval_s = poll_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self.prefixes = PrefixIndex() if follow_prefixes else None
        self._broker_channel = channel(broker_address)
        self.broker = kb_grpc.KVBrokerStub(self._broker_channel)
        self.broker_ok = False
        self.instances: dict[str, Instance] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.on_update: list[Callable[[], None]] = []
        self._refreshing: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch_broker(), name="registry-broker"),
            asyncio.create_task(self._watch_loads(), name="registry-loads"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for inst in self.instances.values():
            await inst.channel.close()
        await self._broker_channel.close()

    # ---- views -----------------------------------------------------------------------------

    def healthy_of(self, role: int) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role and i.healthy]

    def is_healthy(self) -> bool:
        """Reaches kv_broker and can route: a unified instance, or a prefill and a decode."""
        return self.broker_ok and (
            bool(self.healthy_of(kb.ROLE_UNIFIED))
            or (bool(self.healthy_of(kb.ROLE_PREFILL)) and bool(self.healthy_of(kb.ROLE_DECODE)))
        )

    def kv_pages(self) -> tuple[int, int]:
        """(used, free) KV pages summed over healthy decode and unified instances."""
        used = free = 0
        for inst in self.healthy_of(kb.ROLE_DECODE) + self.healthy_of(kb.ROLE_UNIFIED):
            load = inst.load
            if isinstance(load, DecodeLoad):
                used += load.total_pages - load.free_pages
                free += load.free_pages
        return used, free

    def loads(self) -> MeshLoads:
        """The latest load of every healthy instance (none while kv_broker is unreachable)."""
        if not self.broker_ok:
            return MeshLoads()
        polled = [i for i in self.instances.values() if i.healthy and i.load is not None]

        def of(role: int) -> tuple:
            return tuple(i.load for i in polled if i.role == role)

        return MeshLoads(
            prefills=of(kb.ROLE_PREFILL),
            decodes=of(kb.ROLE_DECODE),
            unifieds=of(kb.ROLE_UNIFIED),
            asked_at={i.instance_id: i.asked_at for i in polled},
            prefixes=self.prefixes,
        )

    def _notify(self) -> None:
        for listener in list(self.on_update):
            try:
                listener()
            except Exception:  # a listener must never stop discovery or polling
                log.exception("registry listener failed")

    # ---- polling ---------------------------------------------------------------------------

    async def refresh(self) -> None:
        """List the instances now instead of at the next round: a caller that saw an instance
        lost (a request about to move) routes on a view taken after the loss, so a kv_broker
        that went away holds requests in the queue instead of failing each attempt. Callers
        at the same moment share one listing."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._list_once())
        await asyncio.shield(self._refreshing)

    async def _list_once(self) -> None:
        try:
            listing = await self.broker.ListInstances(
                kb.ListInstancesRequest(), timeout=self.rpc_timeout_s
            )
            self.broker_ok = True
            self._sync(listing.instances)
        except grpc.aio.AioRpcError as exc:
            if self.broker_ok:
                log.warning("kv_broker unreachable: %s", exc.code().name)
            self.broker_ok = False
        except Exception:  # never let discovery die
            log.exception("instance discovery failed")
            self.broker_ok = False
        self._notify()

    async def _watch_broker(self) -> None:
        while True:
            await self._list_once()
            await asyncio.sleep(1.0 if self.broker_ok else 0.25)

    def _sync(self, listed) -> None:
        seen = set()
        for desc in listed:
            if desc.role not in ROLES or not desc.grpc_address:
                continue
            seen.add(desc.instance_id)
            known = self.instances.get(desc.instance_id)
            if known is not None and known.address == desc.grpc_address:
                continue
            ch = channel(desc.grpc_address)
            stub = (
                prefill_pb2_grpc.PrefillStub(ch)
                if desc.role == kb.ROLE_PREFILL
                else decode_pb2_grpc.DecodeStub(ch)
            )
            self.instances[desc.instance_id] = Instance(
                desc.instance_id, desc.role, desc.grpc_address, ch, stub
            )
            log.info("discovered %s at %s", desc.instance_id, desc.grpc_address)
        for gone in set(self.instances) - seen:
            inst = self.instances.pop(gone)
            log.info("instance %s left", gone)
            asyncio.get_running_loop().create_task(inst.channel.close())
        if self.prefixes is not None:
            self.prefixes.retain(self.instances)

    async def _watch_loads(self) -> None:
        while True:
            insts = list(self.instances.values())
            if insts:
                # return_exceptions: one instance's failure must never end this loop
                await asyncio.gather(*(self._poll(i) for i in insts), return_exceptions=True)
            self._notify()  # also with no instance: waiting requests time out
            await asyncio.sleep(self.poll_interval_s)

    async def _poll(self, inst: Instance) -> None:
        asked_at = time.monotonic()
        request = prefill_pb2.LoadRequest()
        if self.prefixes is not None:  # every role caches prefixes (decode: earlier turns)
            epoch, seq = self.prefixes.cursor(inst.instance_id)
            request.prefixes.epoch, request.prefixes.seq = epoch, seq
            request.prefixes.SetInParent()  # asked for even from (0, 0)
        try:
            msg = await inst.stub.GetLoad(request, timeout=self.rpc_timeout_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the registry is closing
            inst.healthy = False  # its channel was closed under us: the instance left
            return
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            inst.healthy = False
            return
        if inst.role == kb.ROLE_PREFILL:
            inst.load = PrefillLoad(
                inst.instance_id, msg.waiting_tokens, msg.running_requests, msg.max_queued_tokens
            )
        else:
            inst.load = DecodeLoad(
                inst.instance_id,
                msg.free_pages,
                msg.total_pages,
                requests_held(inst.role, msg),
                msg.page_size,
                msg.max_running_requests,
            )
        if self.prefixes is not None and msg.HasField("prefixes"):
            digest = msg.prefixes
            changes = PrefixChanges(
                digest.epoch, digest.seq, digest.reset, list(digest.stored), list(digest.removed)
            )
            self.prefixes.apply(inst.instance_id, changes, digest.page_size)
        inst.asked_at = asked_at
        inst.healthy = True


def requests_held(role: int, load: decode_pb2.DecodeLoad) -> int:
    """Requests that hold (or wait for) one of the instance's ``max_running_requests`` slots.
    A decode's ``running_requests`` is its running batch only: those reserved and waiting for
    their KV, or waiting for room (``waiting_handoffs``), take slots too. A unified
    instance's ``running_requests`` already counts the requests queued in its engine."""
    if role == kb.ROLE_DECODE:
        return load.running_requests + load.waiting_handoffs
    return load.running_requests
