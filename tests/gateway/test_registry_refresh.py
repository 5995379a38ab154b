"""InstanceRegistry.refresh: a request about to move routes on a view of the mesh taken after
the loss. Against a real kv_broker on loopback: the listing is taken at once (not at the next
one-second round), and a broker that went away is seen as such, so routing holds requests
instead of failing each attempt."""

from __future__ import annotations

import asyncio

import pytest

from dsmesh.gateway.registry import InstanceRegistry
from dsmesh.v1 import kv_broker_pb2 as pb
from tests.kv_broker.conftest import running_broker
from tests.mesh import free_port

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_refresh_lists_the_brokers_instances_at_once() -> None:
    async with running_broker() as broker:
        await broker.decode("d1")
        registry = InstanceRegistry(f"127.0.0.1:{broker.port}")
        try:
            await registry.refresh()
            assert registry.broker_ok
            assert [i.instance_id for i in registry.instances.values()] == ["d1"]
            assert registry.instances["d1"].role == pb.ROLE_DECODE
        finally:
            await registry.close()


async def test_refresh_of_a_broker_that_is_gone_marks_it_unreachable_and_routes_nothing() -> None:
    registry = InstanceRegistry(f"127.0.0.1:{free_port()}", rpc_timeout_s=1.0)
    registry.broker_ok = True  # as before the broker died
    try:
        # Several requests moving at once share one listing; none waits past the RPC timeout.
        await asyncio.wait_for(asyncio.gather(*(registry.refresh() for _ in range(8))), 5)
        assert not registry.broker_ok
        assert not registry.is_healthy()
        assert registry.loads().decodes == ()
    finally:
        await registry.close()
