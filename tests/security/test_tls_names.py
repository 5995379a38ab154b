"""TLS names across hosts: a server bound to every interface is dialled at the address it
advertises, and its certificate is checked against that address (an IP SAN), not against
what it binds. In-process servers, no engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.runtime.address import advertise_host, default_route_address, host_port
from dsmesh.runtime.grpc_server import channel, start_server
from dsmesh.runtime.security import TLSConfig
from tests.security.certs import LOCAL_NAMES, make_service_pair


def _check(tmp_path: Path, names: list[str], dial: str) -> grpc.StatusCode:
    """The status of a health check dialled at ``dial`` to a server bound to 0.0.0.0 whose
    certificate has the SANs ``names``."""
    ca, pair = make_service_pair(tmp_path, names)

    async def main() -> grpc.StatusCode:
        server = await start_server(
            lambda s: None,
            [],
            host="0.0.0.0",
            tls=TLSConfig(str(pair.cert), str(pair.key), str(ca)),
        )
        try:
            async with channel(host_port(dial, server.port), tls=TLSConfig(ca_file=str(ca))) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK
        finally:
            await server.server.stop(0)

    return asyncio.run(main())


@pytest.fixture
def advertised() -> str:
    address = default_route_address()
    if address is None:
        pytest.skip("this machine has no IPv4 default route to advertise")
    assert advertise_host("0.0.0.0") == address  # what a server bound to 0.0.0.0 registers
    return address


def test_a_certificate_with_the_advertised_ip_is_accepted(tmp_path: Path, advertised: str) -> None:
    assert _check(tmp_path, [advertised, *LOCAL_NAMES], advertised) == grpc.StatusCode.OK


def test_a_certificate_without_the_advertised_ip_is_refused(
    tmp_path: Path, advertised: str
) -> None:
    assert _check(tmp_path, list(LOCAL_NAMES), advertised) == grpc.StatusCode.UNAVAILABLE
    assert _check(tmp_path, list(LOCAL_NAMES), "127.0.0.1") == grpc.StatusCode.OK
