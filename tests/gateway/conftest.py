"""The mesh exactly as the README starts it: `dsmesh up` with its defaults (REST on
localhost:8000, gRPC on localhost:50051, one prefill, one decode, the tiny default model),
as a real process tree on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

HTTP_PORT = 8000  # the README's defaults
GRPC_PORT = 50051


def wait_http_ok(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"dsmesh up exited with {proc.returncode} before serving")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy within {timeout}s")
        time.sleep(0.1)


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


@pytest.fixture(scope="session")
def gw(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("gw-cache")
    logs = tmp_path_factory.mktemp("gw-logs")
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    from engine.tiny_model import default_model_dir

    model = default_model_dir()
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
