"""Helpers that start mesh processes for the multi-process tests."""

from __future__ import annotations

from pathlib import Path

from dsmesh.cli.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb


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
