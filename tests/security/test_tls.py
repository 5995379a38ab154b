"""mTLS on every gRPC hop of a real mesh: the gateway reaches broker, prefill and decode over
mTLS (a Generate succeeds), and nothing without a trusted client certificate gets in."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.runtime.grpc_server import sync_channel
from dsmesh.runtime.security import TLSConfig
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.security.conftest import API_KEY, MAX_MESSAGE_BYTES, SecureMesh

SERVICES = ("kv-broker", "prefill", "decode", "gateway")
AUTH = (("authorization", f"Bearer {API_KEY}"),)


def health_code(address: str, tls: TLSConfig) -> grpc.StatusCode:
    with sync_channel(address, tls) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


def generate(address: str, tls: TLSConfig, text: str = "Hello") -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_new_tokens=4))
    with sync_channel(address, tls) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        return list(stub.Generate(request, metadata=AUTH, timeout=60))


def test_generate_over_mtls(secure_mesh: SecureMesh) -> None:
    replies = generate(secure_mesh.gateway, secure_mesh.pki.client_tls())
    assert sum(len(r.token_ids) for r in replies) == 4
    assert replies[-1].finish_reason == "length"
    assert replies[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("service", SERVICES)
def test_client_certificate_gets_in(secure_mesh: SecureMesh, service: str) -> None:
    address = secure_mesh.grpc_services[service]
    assert health_code(address, secure_mesh.pki.client_tls()) == grpc.StatusCode.OK


@pytest.mark.parametrize("service", SERVICES)
def test_plaintext_is_refused(secure_mesh: SecureMesh, service: str) -> None:
    address = secure_mesh.grpc_services[service]
    assert health_code(address, TLSConfig()) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("service", SERVICES)
def test_tls_without_client_certificate_is_refused(secure_mesh: SecureMesh, service: str) -> None:
    address = secure_mesh.grpc_services[service]
    no_cert = TLSConfig(ca_file=str(secure_mesh.pki.ca))
    assert health_code(address, no_cert) == grpc.StatusCode.UNAVAILABLE


def test_client_certificate_from_another_ca_is_refused(secure_mesh: SecureMesh) -> None:
    pki = secure_mesh.pki
    assert health_code(secure_mesh.gateway, pki.client_tls(pki.rogue)) == (
        grpc.StatusCode.UNAVAILABLE
    )


def test_server_from_another_ca_is_not_trusted(secure_mesh: SecureMesh) -> None:
    pki = secure_mesh.pki
    distrustful = pki.client_tls(ca=pki.rogue_ca)  # a valid client cert, the wrong trust root
    assert (
        health_code(secure_mesh.grpc_services["kv-broker"], distrustful)
        == grpc.StatusCode.UNAVAILABLE
    )


def test_oversized_generate_is_resource_exhausted(secure_mesh: SecureMesh) -> None:
    text = "x" * (MAX_MESSAGE_BYTES + 1024)
    with pytest.raises(grpc.RpcError) as info:
        generate(secure_mesh.gateway, secure_mesh.pki.client_tls(), text)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the gateway is still there and serving
    replies = generate(secure_mesh.gateway, secure_mesh.pki.client_tls())
    assert replies[-1].finish_reason == "length"


@pytest.mark.parametrize("service", SERVICES)
def test_oversized_message_to_any_service(secure_mesh: SecureMesh, service: str) -> None:
    address = secure_mesh.grpc_services[service]
    request = health_pb2.HealthCheckRequest(service="x" * (MAX_MESSAGE_BYTES + 1))
    with (
        sync_channel(address, secure_mesh.pki.client_tls()) as ch,
        pytest.raises(grpc.RpcError) as info,
    ):
        health_pb2_grpc.HealthStub(ch).Check(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert health_code(address, secure_mesh.pki.client_tls()) == grpc.StatusCode.OK
