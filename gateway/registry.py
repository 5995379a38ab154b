"""The gateway's view of the mesh: instances discovered through kv_broker, and their load.

Prefill and decode instances attach to kv_broker with their gRPC address, so the gateway
needs only the broker's address: it lists instances every second and polls each one's
``GetLoad`` a few times a second. An instance that stops answering is skipped by routing
until it answers again; one that leaves the broker's list is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace

import grpc

from dsmesh.grpc_server import channel
from dsmesh.v1 import decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc
from gateway.routing import DecodeLoad, PrefillLoad, choose_decode, choose_prefill

log = logging.getLogger(__name__)


class NoInstanceError(Exception):
    """No healthy prefill or decode instance to route to."""


@dataclass
class Instance:
    instance_id: str
    role: int
    address: str
    channel: grpc.aio.Channel
    stub: prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub
    load: PrefillLoad | DecodeLoad | None = None
    healthy: bool = False


class InstanceRegistry:
    def __init__(
        self, broker_address: str, poll_interval_s: float = 0.25, rpc_timeout_s: float = 2.0
    ) -> None:
        self.broker_address = broker_address
        self.poll_interval_s = poll_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self._broker_channel = channel(broker_address)
        self.broker = kb_grpc.KVBrokerStub(self._broker_channel)
        self.broker_ok = False
        self.instances: dict[str, Instance] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.changed = asyncio.Event()

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
        return (
            self.broker_ok
            and bool(self.healthy_of(kb.ROLE_PREFILL))
            and bool(self.healthy_of(kb.ROLE_DECODE))
        )

    def kv_pages(self) -> tuple[int, int]:
        """(used, free) KV pages summed over healthy decode instances."""
        used = free = 0
        for inst in self.healthy_of(kb.ROLE_DECODE):
            load = inst.load
            if isinstance(load, DecodeLoad):
                used += load.total_pages - load.free_pages
                free += load.free_pages
        return used, free

    def pick(
        self, prompt_tokens: int, pages_needed: int, total_tokens: int = 0
    ) -> tuple[Instance, Instance]:
        """Choose a (prefill, decode) pair and account for the request until the next poll:
        the decode's free pages drop by what ``total_tokens`` (prompt + new) will take, so a
        burst of requests between two polls spreads instead of herding onto one instance."""
        prefills = {i.instance_id: i for i in self.healthy_of(kb.ROLE_PREFILL)}
        decodes = {i.instance_id: i for i in self.healthy_of(kb.ROLE_DECODE)}
        p = choose_prefill([i.load for i in prefills.values() if isinstance(i.load, PrefillLoad)])
        d = choose_decode(
            [i.load for i in decodes.values() if isinstance(i.load, DecodeLoad)], pages_needed
        )
        if p is None or d is None:
            missing = "prefill" if p is None else "decode"
            raise NoInstanceError(f"no healthy {missing} instance")
        pre, dec = prefills[p.instance_id], decodes[d.instance_id]
        pre.load = replace(
            p,
            waiting_tokens=p.waiting_tokens + prompt_tokens,
            running_requests=p.running_requests + 1,
        )
        dec.load = replace(
            d,
            free_pages=max(0, d.free_pages - max(pages_needed, d.pages_for(total_tokens))),
            running_requests=d.running_requests + 1,
        )
        return pre, dec

    async def wait_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.is_healthy():
            if time.monotonic() > deadline:
                return False
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 0.1)
        return True

    # ---- polling ---------------------------------------------------------------------------

    async def _watch_broker(self) -> None:
        while True:
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
            self.changed.set()
            await asyncio.sleep(1.0 if self.broker_ok else 0.25)

    def _sync(self, listed) -> None:
        seen = set()
        for desc in listed:
            if desc.role not in (kb.ROLE_PREFILL, kb.ROLE_DECODE) or not desc.grpc_address:
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

    async def _watch_loads(self) -> None:
        while True:
            insts = list(self.instances.values())
            if insts:
                # return_exceptions: one instance's failure must never end this loop
                await asyncio.gather(*(self._poll(i) for i in insts), return_exceptions=True)
                self.changed.set()
            await asyncio.sleep(self.poll_interval_s)

    async def _poll(self, inst: Instance) -> None:
        try:
            msg = await inst.stub.GetLoad(prefill_pb2.LoadRequest(), timeout=self.rpc_timeout_s)
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
            inst.load = PrefillLoad(inst.instance_id, msg.waiting_tokens, msg.running_requests)
        else:
            inst.load = DecodeLoad(
                inst.instance_id,
                msg.free_pages,
                msg.total_pages,
                msg.running_requests,
                msg.page_size,
            )
        inst.healthy = True
