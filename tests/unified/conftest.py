"""Meshes of unified instances for the tests: kv_broker, a unified instance and a gateway as
separate processes on loopback (tests/mesh.py, ``running_gateway_mesh``), with the tiny
default model in float32 (no prefill, no decode)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command
from tests.mesh import free_port, running_gateway_mesh

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


def start_mesh(
    cache: Path, logs: Path, unified: list[str], gateway: list[str]
) -> Iterator[UnifiedMesh]:
    metrics_port = free_port()

    def instances(broker: str) -> dict[str, list[str]]:
        flags = ("--broker", broker, "--dtype", "float32", "--metrics-port", str(metrics_port))
        return {"unified": dsmesh_command("unified", *flags, *unified)}

    with running_gateway_mesh(cache, logs, instances, tuple(gateway)) as (procs, port, model):
        yield UnifiedMesh(
            procs["kv-broker"], procs["unified"], procs["gateway"], port, metrics_port, model, logs
        )


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
