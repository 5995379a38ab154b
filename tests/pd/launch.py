"""Helpers that start mesh processes for the multi-process tests."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc


def start_gateway(broker: str, model: str, env: dict[str, str], log_dir: Path) -> ServiceProcess:
    """A gateway on free gRPC and HTTP ports, finding the mesh through ``broker``."""
    args = dsmesh_command(
        "gateway", "--broker", broker, "--model", model, "--grpc-port", "0", "--http-port", "0"
    )
    return start_service("gateway", args, env=env, log_dir=log_dir)


async def instance_load(inst: kb.Instance) -> prefill_pb2.PrefillLoad | decode_pb2.DecodeLoad:
    """GetLoad of a registered prefill or decode instance (pages free and total, queue)."""
    async with channel(inst.grpc_address) as ch:
        stub = (
            prefill_pb2_grpc.PrefillStub(ch)
            if inst.role == kb.ROLE_PREFILL
            else decode_pb2_grpc.DecodeStub(ch)
        )
        return await stub.GetLoad(prefill_pb2.LoadRequest())


def two_free_ports() -> int:
    """A port p with p + 1 also free (an EP 2 group's ranks serve /metrics on p + rank)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


async def _instances(broker_address: str) -> dict[int, list[kb.Instance]]:
    async with channel(broker_address) as ch:
        listing = await kb_grpc.KVBrokerStub(ch).ListInstances(kb.ListInstancesRequest())
    by_role: dict[int, list[kb.Instance]] = {}
    for inst in sorted(listing.instances, key=lambda i: i.instance_id):
        by_role.setdefault(inst.role, []).append(inst)
    return by_role


def group_ranks(
    broker_address: str, num_ranks: int = 2, within: float = 30.0
) -> tuple[list[kb.Instance], list[kb.Instance]]:
    """The prefill and the decode group's ranks, in rank order, once kv_broker lists
    ``num_ranks`` of each (a group prints its ports before every rank's Attach is up);
    whatever it lists after ``within`` seconds otherwise."""
    deadline = time.monotonic() + within
    while True:
        by_role = asyncio.run(_instances(broker_address))
        pre, dec = by_role.get(kb.ROLE_PREFILL, []), by_role.get(kb.ROLE_DECODE, [])
        if len(pre) == len(dec) == num_ranks or time.monotonic() > deadline:
            return pre, dec
        time.sleep(0.2)


def wait_pages_free(ranks: list[kb.Instance], within: float) -> bool:
    """Every rank's KV pages back in its pool (no page leaked by a finished request)."""

    async def all_free() -> bool:
        for inst in ranks:
            load = await instance_load(inst)
            if load.free_pages != load.total_pages:
                return False
        return True

    deadline = time.monotonic() + within
    while not asyncio.run(all_free()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
