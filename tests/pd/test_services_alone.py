"""Each service runs alone as `dsmesh <service>`, documents its flags, and serves the
standard gRPC health and reflection services."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dsmesh.runtime.grpc_server import channel


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (
            "prefill",
            [
                "--broker",
                "--page-size",
                "--max-batch-tokens",
                "--prefix-cache",
                "--transfer-protocol",
                "--transfer-device",
                "--resolve-wait",
            ],
        ),
        (
            "decode",
            [
                "--broker",
                "--page-size",
                "--handoff-timeout",
                "--max-total-tokens",
                "--transfer-protocol",
                "--release-quarantine",
            ],
        ),
        ("kv-broker", ["--port", "--handoff-timeout", "--liveness-grace", "--metrics-port"]),
    ],
)
def test_help_lists_the_flags(command: str, flags: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dsmesh", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in flags:
        assert flag in out, f"{command} --help lacks {flag}"


async def _check(address: str, service: str) -> tuple[int, list[str]]:
    ch = channel(address)
    try:
        health = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names: list[str] = []
        async for resp in stream:
            names = [s.name for s in resp.list_services_response.service]
        return health.status, names
    finally:
        await ch.close()


def test_health_and_reflection_on_every_service(mesh) -> None:
    targets = [
        (mesh.broker.address, "dsmesh.v1.KVBroker"),
        (mesh.prefill[16].address, "dsmesh.v1.Prefill"),
        (mesh.decode[16].address, "dsmesh.v1.Decode"),
    ]
    for address, service in targets:
        status, names = asyncio.run(_check(address, service))
        assert status == health_pb2.HealthCheckResponse.SERVING, service
        assert service in names and "grpc.health.v1.Health" in names
