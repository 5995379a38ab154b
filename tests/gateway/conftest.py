"""The mesh exactly as the README starts it: `dsmesh up` with its defaults (REST on
localhost:8000, gRPC on localhost:50051, one prefill, one decode, the tiny default model with
DeepSeek-V3's tokenizer), as a real process tree on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.mesh import wait_http_ok

HTTP_PORT = 8000  # the README's defaults
GRPC_PORT = 50051


@dataclass
class GatewayMesh:
    process: subprocess.Popen
    model_dir: Path
    log_dir: Path
    url: str = f"http://127.0.0.1:{HTTP_PORT}"
    grpc_address: str = f"127.0.0.1:{GRPC_PORT}"

    @property
    def model_name(self) -> str:
        return self.model_dir.name


def port_taken(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:``port`` (SO_REUSEADDR: a listening
    socket still refuses the bind, connections in TIME_WAIT do not)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT leftovers
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.fixture(scope="session")
def gw(tmp_path_factory: pytest.TempPathFactory):
    # The README's fixed ports: another mesh there (a second test run, say) would answer
    # instead of this one, and its state would make these tests lie.
    taken = [port for port in (HTTP_PORT, GRPC_PORT) if port_taken(port)]
    if taken:
        pytest.fail(f"ports {taken} are in use: these tests start `dsmesh up` on them")
    cache = tmp_path_factory.mktemp("gw-cache")
    logs = tmp_path_factory.mktemp("gw-logs")
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    from dsmesh.engine.model.tiny_model import default_model_dir

    model = default_model_dir(tokenizer="deepseek-v3")  # what `dsmesh up` serves by default
    out = open(logs / "up.out", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsmesh", "up", "--log-dir", str(logs)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, "DSMESH_CACHE_DIR": str(cache)},
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{HTTP_PORT}/health", 120, proc)
        yield GatewayMesh(proc, model, logs)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()
