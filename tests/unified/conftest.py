"""Meshes of unified instances for the tests: kv_broker, unified instances and a gateway as
separate processes on loopback, with the tiny default model in float32 (no prefill, no
decode)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from tests.mesh import free_port, wait_http_ok

# Mesh "small": its pool holds 2048 tokens, less than the model's context (4096), so a
# request can be too large for every instance; 64-token forwards mix prompt chunks into the
# decode batches.
SMALL_POOL_TOKENS = 2048
SMALL_BATCH_TOKENS = 64
# Mesh "queue": a gateway that dispatches 4 requests at most and queues 6 at most.
QUEUE_MAX_INFLIGHT = 4
QUEUE_MAX_QUEUED = 6


@dataclass
class UnifiedMesh:
    broker: ServiceProcess
    unified: ServiceProcess
    gateway: ServiceProcess
    http_port: int
    unified_metrics_port: int
    model_dir: Path
    log_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return self.gateway.address

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    def stop(self) -> None:
        for proc in (self.gateway, self.unified, self.broker):
            proc.stop()


def start_mesh(
    cache: Path, logs: Path, unified: list[str], gateway: list[str]
) -> Iterator[UnifiedMesh]:
    env = {"DSMESH_CACHE_DIR": str(cache)}
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    from dsmesh.engine.model.tiny_model import default_model_dir

    model = default_model_dir()  # built once here, before the children race for it
    started: list[ServiceProcess] = []
    try:
        broker = start_service(
            "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
        )
        started.append(broker)
        http_port, metrics_port = free_port(), free_port()
        specs = {
            "unified": dsmesh_command(
                "unified",
                *("--broker", broker.address, "--dtype", "float32"),
                *("--metrics-port", str(metrics_port), *unified),
            ),
            "gateway": dsmesh_command(
                "gateway",
                *("--broker", broker.address, "--model", str(model)),
                *("--grpc-port", "0", "--http-port", str(http_port), *gateway),
            ),
        }
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(start_service, name, args, env, logs)
                for name, args in specs.items()
            }
            procs = {}
            for name, future in futures.items():
                procs[name] = future.result()
                started.append(procs[name])
        mesh = UnifiedMesh(
            broker, procs["unified"], procs["gateway"], http_port, metrics_port, model, logs
        )
        wait_http_ok(f"{mesh.url}/health", 60)  # the gateway found the instance
        yield mesh
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.fixture(scope="session")
def unified_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("unified-cache")


@pytest.fixture(scope="session")
def small_mesh(unified_cache, tmp_path_factory) -> Iterator[UnifiedMesh]:
    """One unified instance of a 2048-token pool behind a gateway with default limits."""
    yield from start_mesh(
        unified_cache,
        tmp_path_factory.mktemp("small-logs"),
        unified=[
            *("--max-total-tokens", str(SMALL_POOL_TOKENS)),
            *("--max-batch-tokens", str(SMALL_BATCH_TOKENS)),
        ],
        gateway=[],
    )


@pytest.fixture(scope="session")
def queue_mesh(unified_cache, tmp_path_factory) -> Iterator[UnifiedMesh]:
    """One unified instance (room for many requests) behind a gateway that dispatches at
    most QUEUE_MAX_INFLIGHT requests and queues at most QUEUE_MAX_QUEUED."""
    yield from start_mesh(
        unified_cache,
        tmp_path_factory.mktemp("queue-logs"),
        unified=["--max-total-tokens", "32768", "--max-running-requests", "16"],
        gateway=[
            *("--max-inflight", str(QUEUE_MAX_INFLIGHT)),
            *("--max-queued", str(QUEUE_MAX_QUEUED)),
        ],
    )
