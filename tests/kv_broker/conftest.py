"""A real loopback broker per test, and attached-instance clients that collect events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest_asyncio

from dsmesh.kv_broker.config import BrokerConfig
from dsmesh.kv_broker.service import serve
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import kv_broker_pb2 as pb
from dsmesh.v1 import kv_broker_pb2_grpc

WAIT_S = 3.0  # upper bound for anything a test waits on

LAYOUT = pb.KVLayout(dtype="float32", page_size=4, kv_dim=96, num_layers=2, model="tiny-v3")
POOL = pb.RemotePool(
    transfer_session="127.0.0.1:17000", base_ptr=4096, num_pages=64, page_bytes=1536
)

TEST_CONFIG = BrokerConfig(
    handoff_timeout_s=5.0,
    heartbeat_interval_s=0.2,
    liveness_grace_s=0.3,
    drain_timeout_s=0.5,
)


def reserve_request(rid: str = "r1", decode: str = "d1", **overrides) -> pb.ReserveRequest:
    fields = dict(
        request_id=rid,
        decode_instance_id=decode,
        layout=LAYOUT,
        pool=POOL,
        page_ids=[3, 5, 7],
        num_tokens=10,
    )
    fields.update(overrides)
    return pb.ReserveRequest(**fields)


class Attached:
    """An instance's Attach stream; handoff events land in a queue, heartbeats are counted."""

    def __init__(self, stub: kv_broker_pb2_grpc.KVBrokerStub, instance_id: str, role: int):
        self.instance_id = instance_id
        self.call = stub.Attach(
            pb.AttachRequest(
                instance=pb.Instance(
                    instance_id=instance_id,
                    role=role,
                    grpc_address="127.0.0.1:1",
                    transfer_session="127.0.0.1:2",
                )
            )
        )
        self.events: asyncio.Queue[pb.BrokerEvent] = asyncio.Queue()
        self.heartbeats = 0
        self.heartbeat = asyncio.Event()  # set on every heartbeat after the first
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> Attached:
        first = await asyncio.wait_for(self.call.read(), WAIT_S)
        assert first.heartbeat, first  # the registration is confirmed by a first heartbeat
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            while True:
                event = await self.call.read()
                if event is grpc.aio.EOF:
                    return
                if event.heartbeat:
                    self.heartbeats += 1
                    self.heartbeat.set()
                else:
                    self.events.put_nowait(event)

    async def next_event(self, timeout: float = WAIT_S) -> pb.BrokerEvent:
        return await asyncio.wait_for(self.events.get(), timeout)

    async def states(self, n: int) -> list[tuple[str, int]]:
        return [((e := await self.next_event()).request_id, e.state) for _ in range(n)]

    def assert_no_event(self) -> None:
        assert self.events.empty(), self.events.get_nowait()

    async def ended(self) -> grpc.StatusCode:
        """Wait for the broker to end the stream; returns its status code."""
        assert self._reader is not None
        await asyncio.wait_for(self._reader, WAIT_S)
        return await self.call.code()

    async def close(self) -> None:
        self.call.cancel()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, WAIT_S)


@dataclass
class Broker:
    port: int
    stub: kv_broker_pb2_grpc.KVBrokerStub
    channel: grpc.aio.Channel
    stop: asyncio.Event
    task: asyncio.Task[None]
    attached: list[Attached]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def attach(self, instance_id: str, role: int) -> Attached:
        inst = Attached(self.stub, instance_id, role)
        self.attached.append(inst)
        return await inst.start()

    async def decode(self, instance_id: str = "d1") -> Attached:
        return await self.attach(instance_id, pb.ROLE_DECODE)

    async def prefill(self, instance_id: str = "p1") -> Attached:
        return await self.attach(instance_id, pb.ROLE_PREFILL)


@contextlib.asynccontextmanager
async def running_broker(config: BrokerConfig = TEST_CONFIG) -> AsyncIterator[Broker]:
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(config, stop, ready.set_result))
    port = await asyncio.wait_for(ready, WAIT_S)
    chan = channel(f"127.0.0.1:{port}")
    broker = Broker(port, kv_broker_pb2_grpc.KVBrokerStub(chan), chan, stop, task, [])
    try:
        yield broker
    finally:
        for inst in broker.attached:
            await inst.close()
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
        await chan.close()


@pytest_asyncio.fixture
async def broker() -> AsyncIterator[Broker]:
    async with running_broker() as b:
        yield b
