"""A whole mesh started the way users start it, ``dsmesh up``, with mTLS on every gRPC hop
(its ``--tls-*`` flags forwarded to every child, its own health probes over mTLS) and API keys
on the gateway (``--api-key``, reaching the gateway through its environment). Free ports."""

from __future__ import annotations

import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsmesh.gateway.service import GatewayConfig
from tests.mesh import UpProcess, free_port
from tests.security.certs import Pki, make_pki

API_KEY = "sk-test-0123456789"
OTHER_KEY = "sk-second-key"
MAX_MESSAGE_BYTES = 1 << 20  # small, so that an oversized message is cheap to send
MAX_BODY_BYTES = GatewayConfig("", "").max_body_bytes  # the gateway's default


@dataclass
class SecureMesh:
    pki: Pki
    grpc_services: dict[str, str]  # kv-broker, prefill, decode, gateway -> HOST:PORT
    http_url: str
    log_dir: Path

    @property
    def gateway(self) -> str:
        return self.grpc_services["gateway"]


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def secure_mesh(pki: Pki, tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("cache")
    logs = tmp_path_factory.mktemp("logs")
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    http_port = free_port()
    args = [
        *("--grpc-port", "0", "--http-port", str(http_port), "--log-dir", str(logs)),
        *pki.service_flags(),
        "--tls-client-auth",
        *("--api-key", API_KEY, "--api-key", OTHER_KEY),
        *("--max-message-bytes", str(MAX_MESSAGE_BYTES)),
        *("--max-total-tokens", "4096"),
    ]
    # a developer's own settings must not leak into the mesh under test
    env = {"DSMESH_CACHE_DIR": str(cache)}
    env |= dict.fromkeys(
        ("DSMESH_API_KEYS", "DSMESH_TLS_CERT", "DSMESH_TLS_KEY", "DSMESH_TLS_CA"), ""
    )
    env |= {"DSMESH_TLS_CLIENT_AUTH": "", "DSMESH_TLS_SERVER_NAME": ""}
    up = UpProcess(args, env)
    try:
        up.wait_for(r"^dsmesh mesh ready", 120)
        ready = up.ready_services()
        services = {
            "kv-broker": ready["kv-broker"][0],
            "prefill": ready["prefill-0"][0],
            "decode": ready["decode-0"][0],
            "gateway": ready["gateway"][0],
        }
        url = f"http://127.0.0.1:{http_port}"
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            assert resp.status == 200
        yield SecureMesh(pki, services, url, logs)
    finally:
        up.close()
