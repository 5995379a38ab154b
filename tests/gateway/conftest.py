"""A real mesh behind a real gateway: kv_broker, prefill, two decodes and the gateway as
separate processes on loopback, serving the tiny default model."""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsmesh.launcher import ServiceProcess, dsmesh_command, start_service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GatewayMesh:
    broker: ServiceProcess
    prefill: ServiceProcess
    decodes: list[ServiceProcess]
    gateway: ServiceProcess
    http_port: int
    model_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return self.gateway.address

    @property
    def model_name(self) -> str:
        return self.model_dir.name


def wait_http_ok(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy within {timeout}s")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def gw(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("gw-cache")
    logs = tmp_path_factory.mktemp("gw-logs")
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    from engine.tiny_model import default_model_dir

    model = default_model_dir()
    env = {"DSMESH_CACHE_DIR": str(cache)}
    started: list[ServiceProcess] = []
    try:
        broker = start_service(
            "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
        )
        started.append(broker)
        common = ["--broker", broker.address, "--model", str(model)]
        specs = {
            "prefill": dsmesh_command("prefill", *common, "--max-batch-tokens", "256"),
            "decode-0": dsmesh_command("decode", *common, "--max-total-tokens", "16384"),
            "decode-1": dsmesh_command("decode", *common, "--max-total-tokens", "16384"),
        }
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {k: pool.submit(start_service, k, v, env, logs) for k, v in specs.items()}
            procs = {k: f.result() for k, f in futures.items()}
        started += list(procs.values())
        http_port = free_port()
        gateway = start_service(
            "gateway",
            dsmesh_command("gateway", *common, "--grpc-port", "0", "--http-port", str(http_port)),
            env=env,
            log_dir=logs,
        )
        started.append(gateway)
        mesh = GatewayMesh(
            broker,
            procs["prefill"],
            [procs["decode-0"], procs["decode-1"]],
            gateway,
            http_port,
            model,
        )
        wait_http_ok(f"{mesh.url}/health", 60)
        yield mesh
    finally:
        for proc in reversed(started):
            proc.stop()
