"""API keys and body limits on the gateway's HTTP and gRPC front doors (real mesh, mTLS)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.runtime.grpc_server import sync_channel
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.security.conftest import API_KEY, MAX_BODY_BYTES, OTHER_KEY, SecureMesh

GENERATE = {"text": "Hello", "sampling": {"max_new_tokens": 2}}


def call(
    mesh: SecureMesh, method: str, path: str, body: Any = None, key: str | None = None
) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(mesh.http_url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            status, headers, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, headers, raw = exc.code, dict(exc.headers), exc.read()
    ctype = headers.get("Content-Type", "")
    return status, headers, json.loads(raw) if "json" in ctype else raw.decode()


def model_name(mesh: SecureMesh) -> str:
    return call(mesh, "GET", "/v1/models", key=API_KEY)[2]["data"][0]["id"]


ROUTES = [
    ("POST", "/v1/generate", GENERATE, "rest"),
    ("POST", "/v1/abort", {"request_id": "nope"}, "rest"),
    ("GET", "/v1/models", None, "openai"),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "openai"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "openai"),
]


@pytest.mark.parametrize(("method", "path", "body", "kind"), ROUTES)
@pytest.mark.parametrize("key", [None, "wrong-key", API_KEY + "x"])
def test_http_without_valid_key_is_401(
    secure_mesh: SecureMesh, method: str, path: str, body: Any, kind: str, key: str | None
) -> None:
    status, headers, reply = call(secure_mesh, method, path, body, key)
    assert status == 401
    assert headers["WWW-Authenticate"] == "Bearer"
    if kind == "openai":
        assert reply["error"]["type"] == "authentication_error"
        assert reply["error"]["code"] == "invalid_api_key"
    else:
        assert reply["error"]["code"] == 401
        assert reply["error"]["status"] == "UNAUTHENTICATED"
    assert "API key" in reply["error"]["message"]


@pytest.mark.parametrize("key", [API_KEY, OTHER_KEY])
def test_rest_with_key_is_200(secure_mesh: SecureMesh, key: str) -> None:
    status, _, reply = call(secure_mesh, "POST", "/v1/generate", GENERATE, key)
    assert status == 200
    assert len(reply["token_ids"]) == 2
    assert reply["finish_reason"] == "length"


def test_openai_with_key_is_200(secure_mesh: SecureMesh) -> None:
    body = {"model": model_name(secure_mesh), "prompt": "Hi", "max_tokens": 2}
    status, _, reply = call(secure_mesh, "POST", "/v1/completions", body, API_KEY)
    assert status == 200
    assert reply["usage"]["completion_tokens"] == 2
    chat = {
        "model": model_name(secure_mesh),
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
    }
    status, _, reply = call(secure_mesh, "POST", "/v1/chat/completions", chat, API_KEY)
    assert status == 200
    assert reply["usage"]["completion_tokens"] == 2


def test_lowercase_bearer_scheme_is_accepted(secure_mesh: SecureMesh) -> None:
    request = urllib.request.Request(secure_mesh.http_url + "/v1/models")
    request.add_header("Authorization", f"bearer {API_KEY}")
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_probes_need_no_key(secure_mesh: SecureMesh, path: str) -> None:
    status, _, _ = call(secure_mesh, "GET", path)
    assert status == 200


@pytest.mark.parametrize(
    ("path", "kind"), [("/v1/generate", "rest"), ("/v1/completions", "openai")]
)
def test_oversized_body_is_413(secure_mesh: SecureMesh, path: str, kind: str) -> None:
    body = {"text": "x" * (MAX_BODY_BYTES + 1)}
    status, _, reply = call(secure_mesh, "POST", path, body, API_KEY)
    assert status == 413
    assert str(MAX_BODY_BYTES) in reply["error"]["message"]
    if kind == "openai":
        assert reply["error"]["type"] == "invalid_request_error"
        assert reply["error"]["code"] == "request_too_large"
    else:
        assert reply["error"] == {
            "code": 413,
            "status": "RESOURCE_EXHAUSTED",
            "message": f"request body is larger than the limit of {MAX_BODY_BYTES} bytes",
        }


def test_oversized_chunked_body_is_413(secure_mesh: SecureMesh) -> None:
    """No Content-Length: the limit is found while reading."""
    port = int(secure_mesh.http_url.rsplit(":", 1)[1])
    chunks = (b"x" * 8192 for _ in range(MAX_BODY_BYTES // 8192 + 2))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/v1/generate",
            body=chunks,
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
            encode_chunked=True,
        )
        resp = conn.getresponse()
        assert resp.status == 413
        assert json.loads(resp.read())["error"]["code"] == 413
    finally:
        conn.close()


def test_unauthenticated_oversized_body_is_401(secure_mesh: SecureMesh) -> None:
    """The key is checked before the body is read."""
    status, _, _ = call(secure_mesh, "POST", "/v1/generate", {"text": "x" * MAX_BODY_BYTES * 2})
    assert status == 401


GRPC_REQUEST = pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("authorization", API_KEY),)],
    ids=["none", "wrong", "no-scheme"],
)
def test_grpc_without_valid_key_is_unauthenticated(secure_mesh: SecureMesh, metadata) -> None:
    with sync_channel(secure_mesh.gateway, secure_mesh.pki.client_tls()) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(GRPC_REQUEST, metadata=metadata, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            stub.Abort(pb.AbortRequest(request_id="x"), metadata=metadata, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_health_needs_no_key(secure_mesh: SecureMesh) -> None:
    with sync_channel(secure_mesh.gateway, secure_mesh.pki.client_tls()) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="dsmesh.v1.Generation"), timeout=10
        )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_with_second_key(secure_mesh: SecureMesh) -> None:
    with sync_channel(secure_mesh.gateway, secure_mesh.pki.client_tls()) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        metadata = (("authorization", f"Bearer {OTHER_KEY}"),)
        replies = list(stub.Generate(GRPC_REQUEST, metadata=metadata, timeout=60))
    assert sum(len(r.token_ids) for r in replies) == 2
